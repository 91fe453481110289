"""Rank 0's two-phase checkpoint (part of the Orchestrator): phase one sends the policy's snapshot to
the trainers (the lead writes its weights of the same version beside it) and asks every rank hosting an
instance to flush its trajectory shard; phase two commits once every live one has, so every group the
checkpoint calls complete is on disk (store/resume.py)."""

from __future__ import annotations

from .comm import Checkpoint, Checkpointed, Commit, Flush, Flushed


class TwoPhaseCheckpoints:
    def start_checkpoint(self) -> None:
        v = self.policy.next_step
        state = {"orchestrator": {**self.policy.snapshot(), "attempt": self.attempt, "rewards": self.rewards,
                                  "run_id": self.log.run_id}}
        self.ckpt = {"version": v, "flushed": set(), "t": self.now()}
        for r in self.live_instance_ranks:
            self.comm.send(Flush(v), r)
        for t in self.roles.trainer_ranks:  # all join (a sharded trainer gathers its optimizer); the lead writes
            self.comm.send(Checkpoint(v, state if t == self.roles.lead_trainer else None), t)
        self.log.flush()  # so the ops up to here survive a crash too

    def on_checkpoint_progress(self, msg: Flushed | Checkpointed) -> None:
        if self.ckpt is None or msg.version != self.ckpt["version"]:
            raise RuntimeError(f"orchestrator: {msg!r} for no checkpoint in flight ({self.ckpt})")
        if isinstance(msg, Flushed):
            self.ckpt["flushed"].add(msg.instance)
            self.unflushed.pop(self.roles.rank_of_instance(msg.instance), None)
            self.maybe_commit()
            return
        self.op("checkpoint", version=msg.version, detail=msg.path, t_start=self.ckpt["t"])
        self.last_ckpt, self.ckpt = msg.version, None

    def maybe_commit(self) -> None:
        """Phase two once every live rollout rank has flushed (a rank fenced meanwhile is not waited for)."""
        live = {self.roles.instance_of_rank(r) for r in self.live_instance_ranks}
        if not self.ckpt.get("committing") and live <= self.ckpt["flushed"]:
            self.ckpt["committing"] = True
            self.comm.send(Commit(self.ckpt["version"]), self.roles.lead_trainer)
