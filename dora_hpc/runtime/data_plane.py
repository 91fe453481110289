"""The data plane: bulk buffers (weights, KV) between ranks, over a torch.distributed process group
spanning the MPI world (``runtime.data_plane: torch``, the default) or over MPI (``mpi``).

Why torch by default: MPICH's OFI netmod aborts a process whose large message to a process that died was
still in flight (a completion-queue error is fatal whatever the error handler, slurm/NOTES.md), so over MPI
a rollout rank SIGKILLed while the trainer sent it weights, or a peer migrated KV to it, took the sender and
then the job step along. Gloo reports a dead peer as an error on that transfer alone (``PeerLost``).

Invariants:
* a buffer is always announced by a control message (shape, dtype) on MPI and then sent by the same
  sender; per sender-receiver pair and tag, buffers arrive in the order they were sent (MPI's
  non-overtaking rule; the torch plane keeps one process group per tag, since NCCL has no tags), so a
  receiver may read weights and KV in any interleaving, each kind in the order of its headers;
* sends never block the sender: a send returns a handle, and the sender keeps the buffer alive until
  the handle completes (``Comm.wait_bulk``); a receive returns a handle too, which the receiver polls
  (``Comm.recv_array``), so it can give up on a sender that died or hung;
* the torch plane is its own process group, built over a TCPStore beside the MPI world (rank 0 picks the
  port and broadcasts it over MPI); it is independent of the trainers' default group, so FSDP2 and
  megatron-core keep torch.distributed's world to themselves. On GPUs it is NCCL (buffers pass through
  device memory, as weights held on GPUs would); on CPU boxes gloo, which the tests run. A replacement
  (runtime/join.py) is outside that group: buffers to and from it go over its link (runtime/link.py: gloo
  outside MPI too; Comm.plane_to);
* a transfer whose peer died raises ``PeerLost`` from ``test``: the sender drops it (and its destination
  is broken, Comm.broke), the receiver waits for rank 0 to fence the sender.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

if TYPE_CHECKING:
    import torch


class MPIPlane:
    def __init__(self, world, route=None) -> None:
        """``route(rank)``: the (communicator, rank in it) that reaches a rank (Comm.route: links to a
        replacement); default the world."""
        self.route = route or (lambda rank: (world, rank))

    def isend(self, buf: np.ndarray, dst: int, tag: int):
        comm, at = self.route(dst)
        return _MPIHandle(comm.Isend(buf, dest=at, tag=tag))

    def irecv(self, shape: tuple[int, ...], dtype, src: int, tag: int):
        buf = np.empty(shape, dtype=dtype)
        comm, at = self.route(src)
        return _MPIHandle(comm.Irecv(buf, source=at, tag=tag), buf)


class _MPIHandle:
    def __init__(self, req, buf: np.ndarray | None = None) -> None:
        self.req, self.buf = req, buf

    def test(self) -> bool:
        return bool(self.req.Test())

    def wait(self) -> None:
        self.req.Wait()

    def result(self) -> np.ndarray:
        return self.buf

    def cancel(self) -> None:  # a receive from a rank that will never send
        self.req.Cancel()


WORLD_TIMEOUT = datetime.timedelta(seconds=600)


def world_store(world):
    """The TCPStore the world's torch.distributed groups (the links' and this plane's) rendezvous through,
    hosted by the world's rank 0 (collective over ``world``)."""
    import torch.distributed as dist

    from ..train.dp import rendezvous

    host, port = rendezvous(world)
    return dist.TCPStore(host, port, world.Get_size(), world.Get_rank() == 0, timeout=WORLD_TIMEOUT)


class TorchPlane:
    def __init__(self, world, tags: tuple[int, ...], store) -> None:
        """``store``: world_store's."""
        import torch
        import torch.distributed as dist

        rank, size = world.Get_rank(), world.Get_size()
        timeout = WORLD_TIMEOUT
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        self.pgs = {}  # one group per tag: MPI's tag matching, which NCCL lacks
        for tag in tags:
            tagged = dist.PrefixStore(f"tag{tag}", store)
            self.pgs[tag] = (dist.ProcessGroupNCCL(tagged, rank, size) if self.cuda
                             else dist.ProcessGroupGloo(tagged, rank, size, timeout))

    def isend(self, buf: np.ndarray, dst: int, tag: int):
        import torch

        t = torch.from_numpy(buf)
        if self.cuda:
            t = t.cuda()
        try:
            return _TorchHandle(self.pgs[tag].send([t], dst, 0), t)
        except RuntimeError as err:  # gloo: the pair to dst is already closed
            raise PeerLost(str(err)) from None

    def irecv(self, shape: tuple[int, ...], dtype, src: int, tag: int):
        import torch

        t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype,
                        device="cuda" if self.cuda else "cpu")
        try:
            return _TorchHandle(self.pgs[tag].recv([t], src, 0), t)
        except RuntimeError as err:
            return _TorchHandle(None, t, PeerLost(str(err)))


class PeerLost(RuntimeError):
    """A torch-plane transfer failed: its peer's process is gone (gloo: the connection was reset)."""


class _TorchHandle:
    """A send or receive in flight. Gloo reports completion only to ``wait()``, so a helper thread
    waits and ``test`` asks it; the tensor stays alive until the transfer completed. A receive from a
    rank that hung is abandoned (its thread stays blocked until the job ends)."""

    def __init__(self, work, tensor: torch.Tensor, error: Exception | None = None) -> None:
        """``work`` None: a transfer that failed at once with ``error``."""
        self.tensor, self.error = tensor, error
        self.waiter = threading.Thread(target=self._wait, args=(work,), name="data-plane-transfer", daemon=True)
        self.waiter.start()

    def _wait(self, work) -> None:
        try:
            if work is not None:
                work.wait()
        except RuntimeError as err:  # gloo: the peer reset the connection, or the transfer timed out
            self.error = err

    def test(self) -> bool:
        if self.waiter.is_alive():
            return False
        if self.error is not None:
            raise PeerLost(str(self.error))
        return True

    def wait(self) -> None:
        self.waiter.join()
        if self.error is not None:
            raise PeerLost(str(self.error))

    def result(self) -> np.ndarray:
        return self.tensor.cpu().numpy()

    def cancel(self) -> None:
        pass  # gloo cannot cancel; the job's end takes the thread down


def make_plane(kind: str, world=None, tags: tuple[int, ...] = (), route=None, store=None):
    """``store``: world_store's, which the torch plane needs."""
    world = world or MPI.COMM_WORLD
    if kind == "mpi":
        return MPIPlane(world, route)
    if kind == "torch":
        return TorchPlane(world, tags, store)
    raise ValueError(f"runtime.data_plane: unknown data plane {kind!r} (mpi or torch)")
