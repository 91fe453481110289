"""Rank 0: feeds MPI messages to the core policy as events and turns its commands into messages.

Invariants:
* the policy is the same object the simulator drives; this loop adds no scheduling decision;
* every command becomes exactly one message to the rank that executes it (AssignVersion becomes
  two: SendWeights to the weight source, LoadVersion to the instance);
* the run ends after ``train.max_steps`` published versions; then every rank gets Shutdown.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

from ..core.events import (
    TRAINER,
    Abort,
    AssignVersion,
    Dispatch,
    Drop,
    InstanceReady,
    KvPressure,
    Migrate,
    RequestFinished,
    Start,
    StartTrain,
    Tick,
    VersionPublished,
)
from ..core.policies import PolicyConfig, make_policy
from ..store.shards import ShardWriter
from .comm import AbortTraj, Comm, Done, Generate, LoadVersion, MigrateOut, Published, Ready, SendWeights, Shutdown
from .comm import Train as TrainMsg
from .dashboard import Dashboard


class Orchestrator:
    def __init__(self, comm: Comm, cfg, run_dir: Path, task, run_id: str, t0: float) -> None:
        self.comm, self.cfg, self.task, self.t0 = comm, cfg, task, t0
        self.roles = comm.roles
        b = cfg.batch
        self.policy = make_policy(cfg.mode, PolicyConfig(
            tbs=b.tbs, rbs=b.tbs if cfg.mode in ("sync", "one_step") else b.rbs, group_size=b.group_size,
            n_instances=len(self.roles.rollout_ranks), slots=cfg.cluster.max_num_seqs, k=cfg.dora.k,
            kv_threshold=cfg.dora.kv_threshold, rebalance_every=cfg.dora.rebalance_every,
            carry_kv=cfg.dora.kv_migration, legacy_topup=cfg.dora.legacy_topup))
        self.log = ShardWriter(run_dir, "events", 0, "orchestrator", run_id, cfg.model_dump_json(),
                               cfg.store.rows_per_shard)
        self.steps_done = 0
        self.finished_tokens = 0
        self.stale = Counter()
        self.rewards: list[float] = []
        self.dashboard = Dashboard(os.environ.get("DORA_HPC_TTY") == "1", cfg.train.max_steps)

    def now(self) -> float:
        return time.time() - self.t0

    def run(self) -> None:
        for bad in getattr(self.task, "malformed", []):  # skipped prompt rows: recorded, never fatal
            self.op("malformed_row", detail=bad)
            print(f"dora-hpc: skipping malformed prompt row {bad}", file=sys.stderr, flush=True)
        self.execute(self.policy.on(Start()))
        next_tick = time.time() + self.cfg.runtime.tick_s
        deadline = time.time() + self.cfg.runtime.timeout_s
        while self.steps_done < self.cfg.train.max_steps:
            if time.time() > deadline:
                raise RuntimeError(f"run exceeded runtime.timeout_s={self.cfg.runtime.timeout_s}")
            got = self.comm.poll()
            if got is None:
                if time.time() >= next_tick:
                    next_tick = time.time() + self.cfg.runtime.tick_s
                    self.execute(self.policy.on(Tick()))
                    self.report()
                time.sleep(0.0005)
                continue
            msg, _src = got
            match msg:
                case Ready():
                    self.execute(self.policy.on(InstanceReady(msg.instance, msg.version)))
                case Done():
                    self.finished_tokens += msg.response_len
                    self.execute(self.policy.on(RequestFinished(msg.traj_id, msg.instance)))
                    if msg.kv_used_fraction >= self.cfg.dora.kv_threshold:
                        self.execute(self.policy.on(KvPressure(msg.instance, msg.kv_used_fraction)))
                case Published():
                    self.steps_done += 1
                    self.rewards.append(msg.metrics.get("reward_mean", float("nan")))
                    self.op("publish", version=msg.version, detail=msg.checksum)
                    self.report(force=True)
                    if self.steps_done < self.cfg.train.max_steps:
                        self.execute(self.policy.on(VersionPublished(msg.version)))
                case _:
                    raise RuntimeError(f"orchestrator: unexpected message {msg!r}")
        from ..core.ledger import GroupState

        open_groups = [g for g, rec in self.policy.ledger.groups.items()
                       if rec.state in (GroupState.PENDING, GroupState.COMPLETE)]
        self.op("pending_at_end", detail=",".join(map(str, open_groups)))
        self.dashboard.close(self)
        for r in range(1, self.roles.size):
            self.comm.send(Shutdown("done"), r)
        self.log.flush()

    def execute(self, commands) -> None:
        r = self.roles.rank_of_instance
        for c in commands:
            match c:
                case AssignVersion(i, v, src, keep):
                    source = self.roles.lead_trainer if src == TRAINER else r(src)
                    self.comm.send(SendWeights(v, r(i)), source)
                    self.comm.send(LoadVersion(v, source, keep), r(i))
                    self.op("assign", version=v, peer=source, detail=f"instance={i}")
                case Dispatch(t, g, s, v, i):
                    self.comm.send(Generate(t, g, s, v, self.task.prompt(g), self.task.max_tokens(t)), r(i))
                case Migrate(t, src, dst, carry_kv):
                    self.comm.send(MigrateOut(t, r(dst), carry_kv), r(src))
                    self.op("migrate", traj_id=t, peer=r(dst), detail=f"{src}->{dst} kv={carry_kv}")
                case Abort(t, i):
                    self.comm.send(AbortTraj(t), r(i))
                case Drop(g, reason):
                    self.op("drop", detail=f"group={g} {reason}")
                case StartTrain(step, groups):
                    for g in groups:
                        self.stale[step - self.policy.ledger.groups[g].version] += 1
                    self.comm.send(TrainMsg(step, groups), self.roles.lead_trainer)
                case _:
                    raise RuntimeError(f"orchestrator: cannot execute {c!r}")

    def op(self, kind: str, traj_id: int = -1, peer: int = -1, version: int = -1, detail: str = "") -> None:
        t = self.now()
        self.log.append("ops", {"t_start": t, "t_end": t, "kind": kind, "traj_id": traj_id, "peer": peer,
                                "bytes": 0, "version": version, "detail": detail})

    def report(self, force: bool = False) -> None:
        self.dashboard.update(self, force)
