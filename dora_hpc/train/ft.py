"""Fault-tolerant replicas of the trainer (``train.replicas``), on torchft: a lost replica costs the step it
was in, not the job.

Invariants:
* a replica is a group of G trainer ranks (``group``: G = 1, one rank with the whole model, or G ranks that
  shard it with FSDP2 over their own process group, HSDP's inner dimension); replicas find each other through
  torchft's lighthouse (``lighthouse``: rank 0 serves it) and agree, at the start of every step, on a
  quorum: the replicas that take the step. ``rank`` and ``size`` are this replica's index among them and
  their count, fixed from ``start_step`` until the step commits or is abandoned; ``share`` is this rank's
  part of a step's groups (every rank of every replica in the quorum takes its own);
* a sum over the trainer is the group's (its process group), then the replicas' (torchft's Manager over a
  fault-tolerant gloo group joining the ranks of the same index in every replica); a sharded gradient is
  summed over the replicas only, shard by shard (``sum_shards_``: FSDP2 summed it inside the group);
* a failed replica collective (a replica of the quorum lost) ends the step uncommitted with ``StepAborted``
  on every rank of the group at once (the ranks agree on it over their own group before any of them goes
  on), as ``commit`` answering False does, and the optimizer steps only on a committed step, so the replicas
  that go on hold bit-identical weights and take the step again in a new quorum;
* a replica that is new to the quorum (it joined late, or returned) takes the weights, optimizer state and
  the state ``extra`` names from a live one at the step's start (torchft's live recovery, no checkpoint
  read; rank i of a group from rank i of the other, shard for shard) before it computes anything;
* with one replica alive a step is that replica's alone (``size`` 1): no replica collective runs.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch

from .dp import BUCKET_BYTES, DataParallel, Reductions, StepAborted, buckets

QUORUM_TIMEOUT_S = 120.0   # a step's quorum: how long replicas wait for each other to reach the step
HEARTBEAT_MS = 100         # each replica's heartbeat to the lighthouse
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 5000  # a replica silent this long (dead, or stopped) is out of the next quorum


def quiet() -> None:
    """torchft's own lines at errors only: its Rust side logs every quorum and commit at info, its Python
    side a flight-recorder warning per quorum (NCCL's; the replicas reduce over gloo) and a torch warning
    on the buffer of a recovered state (read once, never written)."""
    import logging
    import warnings

    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def serve_lighthouse(join_timeout_s: float):
    """torchft's lighthouse on this host (any port), for the run's replicas; returns it (``address()``). A
    quorum waits for every replica still heartbeating, at most ``join_timeout_s`` (train.replica_timeout_s:
    a replica that slow is taken as hung); one that stopped heartbeating is left out after 5 s."""
    quiet()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=int(join_timeout_s * 1000),
                            heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS)


class Replicas(Reductions):
    """The data-parallel interface of ``DataParallel`` (train/dp.py) over torchft's Manager."""

    collectives = "gloo"
    device = torch.device("cpu")

    def __init__(self, lighthouse: str, replica_id: str, timeout_s: float,
                 state: Callable[[], dict], load_state: Callable[[dict], None],
                 group: DataParallel | None = None) -> None:
        """``state``/``load_state``: everything a replica that joins the quorum takes from a live one (this
        rank's part of it). ``group``: the replica's own ranks (None: this rank alone), every one of which
        makes its Replicas with the same ``replica_id``."""
        quiet()
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        self.replica_id = replica_id
        self.group = group if group is not None and group.size > 1 else None
        local, ranks = (self.group.rank, self.group.size) if self.group else (0, 1)
        host = socket.gethostname()
        addr = None
        if local == 0:  # the replica group's store: its first rank is the master
            with socket.socket() as s:
                s.bind(("", 0))
                addr = (host, s.getsockname()[1])
            self.store = TCPStore(*addr, is_master=True, wait_for_workers=False)
        if self.group:
            addr = self.group.mpi.bcast(addr, root=0)
            # every rank has it before the root blocks outside MPI (MPICH's OFI netmod across nodes delivers a
            # first message only while both sides progress: train/dp.py's rendezvous)
            self.group.mpi.Barrier()
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        self.manager = Manager(pg=self.pg, min_replica_size=1, load_state_dict=load_state, state_dict=state,
                               replica_id=replica_id, lighthouse_addr=lighthouse, store_addr=addr[0],
                               store_port=addr[1], rank=local, world_size=ranks, use_async_quorum=False,
                               hostname=host,
                               init_sync=False,  # replicas start alike: the same model folder or checkpoint
                               timeout=timedelta(seconds=timeout_s),
                               quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
                               heartbeat_interval=timedelta(milliseconds=HEARTBEAT_MS))
        self.rank, self.size = 0, 1
        self.initialised = True

    # -- the step ----------------------------------------------------------------------------------
    def start_step(self, timeout_s: float | None = None) -> None:
        """The quorum of this step (a replica new to it recovers here); sets ``rank`` and ``size``. ``timeout_s``:
        how long to wait for it (else QUORUM_TIMEOUT_S)."""
        self.manager.start_quorum(timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
        self.size = self.manager.num_participants()
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(f"replica {self.replica_id} is not in the quorum it joined")
        self.rank = rank

    def commit(self) -> bool:
        """Whether every replica of the quorum finished the step's collectives (then the optimizer steps);
        False: a replica was lost in it, and the step is taken again by those left."""
        return self.manager.should_commit()

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def shard_rank(self) -> int:
        """This rank's index in its replica group (what it shards by)."""
        return self.group.rank if self.group else 0

    @property
    def shard_size(self) -> int:
        return self.group.size if self.group else 1

    def share(self, groups: list) -> list:
        """This rank's part of a step's ``groups``: the quorum's replicas take every ``size``-th in turn, and
        the ranks of a replica every ``shard_size``-th of its part."""
        return groups[self.rank * self.shard_size + self.shard_rank::self.size * self.shard_size]

    # -- collectives (Reductions' sums and maxima, and DataParallel's checks) -----------------------
    def _all_reduce(self, t: torch.Tensor, op: str, group=None) -> torch.Tensor:
        if self.group:
            self.group._all_reduce(t, op)
        return self._across(t, op)

    def _across(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` reduced over the quorum's replicas, rank i of each with rank i of the others."""
        if self.size == 1:
            return t
        self._reduce(t, op)
        self._check_lost()
        return t

    def _reduce(self, t: torch.Tensor, op: str) -> None:
        from torch.distributed import ReduceOp

        self.manager.allreduce(t, reduce_op=ReduceOp.SUM if op == "sum" else ReduceOp.MAX).wait()

    def _check_lost(self) -> None:
        """Raise StepAborted on every rank of the group, or on none, where a replica collective of this step
        failed on any of them."""
        lost = torch.tensor([self.manager.errored() is not None], dtype=torch.int64)
        if self.group:  # every rank of the group ends the step, or none: the group's collectives stay in step
            self.group._all_reduce(lost, "max")
        if lost.item():  # what was reduced may hold anything: the step ends here, uncommitted
            self.commit()
            raise StepAborted(f"replica {self.replica_id}: a replica was lost in step {self.manager.current_step()}")

    def sum_shards_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each of this rank's gradient shards with the same shard of the other replicas (in place). The ranks
        of a group may cut their shards into different numbers of buckets (FSDP2 shards unevenly), so they agree
        on a lost replica once, after the last."""
        if self.size == 1:
            return
        for bucket in buckets(tensors, lambda t: t.numel() * t.element_size(), BUCKET_BYTES):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._reduce(flat, "sum")  # after an error torchft's reductions do nothing: the check below ends it
            off = 0
            for t in bucket:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
        self._check_lost()

    def allgather(self, obj) -> list:
        """Every rank of this replica group's ``obj`` in rank order: replicas share nothing outside a step's
        collectives, each publishes its own copy, so the layout it gathers is its own group's. Over the group's
        gloo group, not MPI: a rank of it may be gone, and gloo says so where MPI would end the process."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.group.size
        dist.all_gather_object(out, obj)
        return out

    def check_replicas(self, checksum: str, step: int) -> None:
        """Fail unless every replica of the quorum holds weights with this checksum: the largest and the
        smallest of a 62-bit digest of it agree."""
        if self.size == 1:
            return
        h = int(hashlib.sha256(checksum.encode()).hexdigest()[:15], 16)
        both = self._across(torch.tensor([h, -h], dtype=torch.int64), "max")
        if int(both[0]) != -int(both[1]):
            raise RuntimeError(f"trainer replicas diverged after step {step} (replica {self.replica_id})")

    def ensure_process_group(self) -> None:
        """The replica group's own process group (a sharded backend's world)."""
        if self.group is None:
            raise RuntimeError("a replica of one rank has no process group to shard over")
        self.group.ensure_process_group()

    def close(self) -> None:
        if self.initialised:
            self.manager.shutdown(wait=False)
            if self.group:
                self.group.close()
            self.initialised = False
