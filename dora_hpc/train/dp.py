"""Data parallelism across the trainer ranks: torch.distributed (gloo; NCCL for a GPU trainer), bootstrapped
over the trainers' MPI sub-communicator, no environment variables needed.

Invariants:
* every replica starts from the same weights (same checkpoint or same seeded init) and applies the same
  all-reduced gradient with the same optimizer, so replicas stay bit-identical; ``check_replicas``
  proves it after each step by comparing weight checksums and fails loudly when they differ;
* the loss of a step is normalised by global counts (all ranks' tokens or samples), so the summed
  gradient equals the gradient one rank would compute on the whole batch;
* with one trainer rank nothing is initialised and every call is the identity (a sharded backend may
  still ask for a one-rank process group: ``ensure_process_group``).
"""

from __future__ import annotations

import datetime
import socket

import torch

BUCKET_BYTES = 64 << 20  # gradients are all-reduced in flat buckets of at most this size


class StepAborted(RuntimeError):
    """A fault-tolerant step lost a replica in its collectives (train/ft.py): nothing of it was applied
    since the last commit, and the replicas left take it again."""


def buckets(items: list, nbytes, limit: int) -> list[list]:
    """Consecutive ``items`` grouped so that no group's ``nbytes`` exceed ``limit`` (an item larger than
    ``limit`` is a group of its own)."""
    out: list[list] = [[]]
    size = 0
    for item in items:
        n = nbytes(item)
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out


def rendezvous(mpi_comm) -> tuple[str, int]:
    """(host, port) for a torch.distributed rendezvous among the ranks of ``mpi_comm`` (None: this process
    alone): its rank 0 takes a free port from the OS (released just before use) and broadcasts it over
    MPI, with 127.0.0.1 when every rank is on one host. Returns on every rank once every rank has it."""
    hosts = mpi_comm.allgather(socket.gethostname()) if mpi_comm is not None else [socket.gethostname()]
    addr = None
    if mpi_comm is None or mpi_comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            addr = ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0], s.getsockname()[1])
    if mpi_comm is None:
        return addr
    addr = mpi_comm.bcast(addr, root=0)
    # every rank has it before any blocks outside MPI (in the TCPStore): with MPICH's OFI netmod a first
    # message between two ranks needs progress on both sides, and a root gone into the store never sends it
    mpi_comm.Barrier()
    return addr


class Reductions:
    """The sums and maxima a train step needs, over ``_all_reduce`` (in place; the identity with one replica)."""

    size: int

    def _all_reduce(self, t: torch.Tensor, op: str, group=None) -> torch.Tensor:
        raise NotImplementedError

    def sum_(self, t: torch.Tensor, group=None) -> torch.Tensor:
        """In-place sum over the replicas, or over a subgroup of them (the identity with one rank); returns ``t``."""
        return self._all_reduce(t, "sum", group)

    def max_int(self, n: int) -> int:
        """The largest ``n`` over the replicas."""
        return int(self._all_reduce(torch.tensor([n], dtype=torch.int64), "max"))

    def sum_floats(self, *xs: float) -> list[float]:
        return [float(x) for x in self.sum_(torch.tensor(xs, dtype=torch.float64))]

    def sum_shards_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each gradient shard of this rank with the same shard of the other replica groups (train/ft.py):
        none here, the identity."""

    def sum_grads_(self, params: list[torch.nn.Parameter], group=None) -> None:
        """Replace every parameter's gradient with its sum over the replicas, or over ``group`` (a missing
        gradient counts as 0), in flat buckets."""
        if self.size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in buckets(params, lambda p: p.numel() * p.element_size(), BUCKET_BYTES):
            flat = self.sum_(torch.cat([q.grad.reshape(-1) for q in bucket]), group)
            off = 0
            for q in bucket:
                q.grad.copy_(flat[off:off + q.numel()].view_as(q.grad))
                off += q.numel()


class DataParallel(Reductions):
    def __init__(self, mpi_comm=None, collectives: str = "gloo", timeout_s: float = 600.0) -> None:
        """``mpi_comm``: an mpi4py communicator over exactly the trainer ranks (None: one rank). The trainer
        computes on CPU, hence gloo collectives; a GPU trainer passes "nccl" (each rank then uses GPU rank % count)."""
        self.rank = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size = mpi_comm.Get_size() if mpi_comm is not None else 1
        self.mpi = mpi_comm
        self.collectives = collectives  # torch.distributed's backend: gloo or nccl
        self.timeout_s = timeout_s
        self.initialised = False
        if self.size > 1:
            self.ensure_process_group()

    def ensure_process_group(self) -> None:
        """Initialise torch.distributed over the trainer ranks (also for one rank) unless done already."""
        import torch.distributed as dist

        if self.initialised:
            return
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised by someone else in this process")
        host, port = rendezvous(self.mpi)
        if self.collectives == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.collectives, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.size, timeout=datetime.timedelta(seconds=self.timeout_s))
        self.initialised = True

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its GPU (rank % visible GPUs) under NCCL, else the CPU."""
        if self.collectives == "nccl":
            return torch.device("cuda", self.rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def shard_rank(self) -> int:
        """This rank's index among the ranks a sharded backend shards over: every trainer rank."""
        return self.rank

    @property
    def shard_size(self) -> int:
        return self.size

    def commit(self) -> bool:
        """Whether the optimizer may step: always, here (a failed collective raises); fault-tolerant replicas
        (train/ft.py) answer False when one of them was lost in the step."""
        return True

    def _all_reduce(self, t: torch.Tensor, op: str, group=None) -> torch.Tensor:
        if self.size == 1:
            return t
        import torch.distributed as dist

        op_ = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        if self.collectives == "nccl" and not t.is_cuda:  # NCCL reduces device memory only
            t.copy_(self._all_reduce(t.cuda(), op, group).cpu())
        else:
            dist.all_reduce(t, op=op_, group=group)
        return t

    def allgather(self, obj) -> list:
        """Every trainer rank's ``obj`` in rank order (pickled over MPI: small objects only)."""
        return [obj] if self.size == 1 else self.mpi.allgather(obj)

    def check_replicas(self, checksum: str, step: int) -> None:
        """Fail unless every replica holds weights with this checksum (they must be bit-identical)."""
        if self.size == 1:
            return
        every = self.mpi.allgather(checksum)
        if len(set(every)) > 1:
            raise RuntimeError(f"trainer replicas diverged after step {step}: weight checksums by trainer "
                               f"rank {dict(enumerate(every))}")

    def close(self) -> None:
        if self.initialised:
            import torch.distributed as dist

            if dist.is_initialized():  # a borrowed vLLM engine that shared this world may have ended it
                dist.destroy_process_group()
            self.initialised = False
