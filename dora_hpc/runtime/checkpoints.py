"""Rank 0's two-phase checkpoint, owned by the Orchestrator.

Phase one sends the policy's snapshot to the trainers (the lead writes its weights of the same version
beside it) and asks every live rank hosting an instance to flush its trajectory shard; phase two commits
once each of those has, or was fenced meanwhile. A replacement that joins while one is in flight is not
waited for: it holds nothing the snapshot calls complete. Invariant: every group a committed checkpoint calls
complete is on disk (store/resume.py), and at most one checkpoint is in flight. One live trainer writes it
(the lead; with fault-tolerant replicas the lowest live one); a writer lost before its Checkpointed abandons it.
"""

from __future__ import annotations

from collections.abc import Callable

from .comm import Comm
from .messages import Checkpoint, Checkpointed, Commit, Flush, Flushed


class Checkpointer:
    """Takes checkpoints over ``comm``; ``op`` logs an op row (the orchestrator's ``OpLog.op``) and
    ``flush_log`` writes rank 0's events shard. The orchestrator tells it which ranks are live at each call
    (fencing changes them) and which trajectories each rank finished (``done``)."""

    def __init__(self, comm: Comm, op: Callable[..., None], flush_log: Callable[[], None]) -> None:
        self.comm, self.roles, self.op, self.flush_log = comm, comm.roles, op, flush_log
        self.in_flight: dict | None = None  # version, ranks still to flush, start time, writer, committing
        self.last = -1                      # version of the last committed checkpoint
        self.unflushed: dict[int, list[int]] = {}  # rank -> trajectories done since its last Flushed
        self.abandoned: set[int] = set()  # versions whose checkpoint was abandoned

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def done(self, rank: int, traj_id: int) -> None:
        """A trajectory finished on ``rank``: its row is in that rank's memory until the next flush."""
        self.unflushed.setdefault(rank, []).append(traj_id)

    def forget(self, rank: int) -> list[int]:
        """The trajectories a fenced ``rank`` finished since its last flush: their rows are lost with it (and
        the checkpoint in flight no longer waits for it)."""
        if self.in_flight is not None:
            self.in_flight["waits"].discard(rank)
        return self.unflushed.pop(rank, [])

    def start(self, version: int, state: dict, live_ranks: list[int], t: float) -> None:
        """Phase one for ``version``: ``state`` (the orchestrator's snapshot) goes to the writer."""
        trainers = self.comm.live_trainers
        writer = trainers[0]  # the lead (a replica: the lowest live one)
        self.in_flight = {"version": version, "waits": set(live_ranks), "t": t, "writer": writer}
        for r in live_ranks:
            self.comm.send(Flush(version), r)
        for t_rank in trainers:  # all join (a sharded trainer gathers its optimizer); the writer writes
            self.comm.send(Checkpoint(version, state if t_rank == writer else None), t_rank)
        self.flush_log()  # so the ops up to here survive a crash too

    def trainer_lost(self, rank: int) -> bool:
        """A trainer replica was fenced: the checkpoint it was writing is abandoned (the next one is taken
        as usual). Returns whether one was."""
        if self.in_flight is None or self.in_flight["writer"] != rank:
            return False
        self.abandon(f"writer={rank} lost")
        return True

    def abandon(self, why: str) -> None:
        """The checkpoint in flight will not be written (its writer is lost, or it recovered a later version
        from a peer); what its ranks still report for it is ignored."""
        self.op("checkpoint_abandoned", version=self.in_flight["version"], detail=why)
        self.abandoned.add(self.in_flight["version"])
        self.in_flight = None

    def on_progress(self, msg: Flushed | Checkpointed) -> None:
        ckpt = self.in_flight
        if msg.version in self.abandoned and (ckpt is None or msg.version != ckpt["version"]):
            if isinstance(msg, Flushed):
                self.unflushed.pop(self.roles.rank_of_instance(msg.instance), None)
            return
        if ckpt is None or msg.version != ckpt["version"]:
            raise RuntimeError(f"orchestrator: {msg!r} for no checkpoint in flight ({ckpt})")
        if isinstance(msg, Flushed):
            rank = self.roles.rank_of_instance(msg.instance)
            ckpt["waits"].discard(rank)
            self.unflushed.pop(rank, None)
            self.maybe_commit()
            return
        self.op("checkpoint", version=msg.version, detail=msg.path, t_start=ckpt["t"])
        self.last, self.in_flight = msg.version, None

    def maybe_commit(self) -> None:
        """Phase two once every rank asked to flush has, or was fenced (``forget``)."""
        ckpt = self.in_flight
        if ckpt is None or ckpt.get("committing"):
            return
        if not ckpt["waits"]:
            ckpt["committing"] = True
            self.comm.send(Commit(ckpt["version"]), ckpt["writer"])
