"""Rank 0: feeds MPI messages to the core policy as events and turns its commands into messages.

Invariants:
* the policy is the same object the simulator drives; this loop adds no scheduling decision;
* every command becomes exactly one message to the rank that executes it (AssignVersion becomes a
  LoadVersion to the instance and a SendWeights to each weight source: weight_loads.py);
* the run ends after ``train.max_steps`` published versions (fewer when ``dora-hpc finish`` asks), or on a
  stop request (a signal to any rank: Ctrl-C, preemption, requeue) once a checkpoint of the current state
  is committed; then every rank gets Shutdown;
* a checkpoint is two-phase: the policy's snapshot goes to the trainer (which writes its weights of
  the same version beside it) and every rollout rank flushes its trajectory shard; only when all
  confirmed is it committed, so every group it calls complete is on disk (store/resume.py);
* on resume the policy is restored from the checkpoint (core/resume.py) and the stored complete
  groups are streamed to the trainer again before anything else happens;
* under a colocated placement (``cluster.placement``) the rollout ranks are paused from each Train
  until the next version's LoadVersions are sent, as if trainer and rollout shared the devices.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from ..core.events import (
    FOLDER,
    TRAINER,
    Abort,
    AssignVersion,
    Dispatch,
    Drop,
    Filter,
    InstanceJoined,
    InstanceLost,
    InstanceReady,
    KvPressure,
    Migrate,
    Offload,
    Progress,
    RequestFinished,
    Restore,
    Retire,
    Sleep,
    Start,
    StartTrain,
    Tick,
    VersionPublished,
)
from ..core.ledger import Ledger
from ..core.policies import make_policy
from ..core.resume import ResumeError, plan_resume
from ..store.checkpoint import Checkpoint as StoredCheckpoint
from ..store.finish import FINISH, read_finish
from ..store.resume import stored_groups
from ..store.shards import ShardWriter
from .checkpoints import Checkpointer
from .clock import OpLog
from .comm import Comm
from .dashboard import Dashboard
from .join import JoinDesk
from .messages import (
    AbortTraj,
    Checkpointed,
    DecodeProgress,
    Done,
    EnvWaiting,
    Flushed,
    Forget,
    Generate,
    Heartbeat,
    Hello,
    Holds,
    Initial,
    Linked,
    MigrateOut,
    NotCheckpointed,
    Park,
    Pause,
    Published,
    Ready,
    Resume,
    RetireVersion,
    Shutdown,
    SleepEngine,
    StopRequest,
)
from .messages import Train as TrainMsg
from .metrics import Sinks, StepFigures, step_record
from .roles import TRAINERS
from .weight_loads import WeightLoads


class RankHung(RuntimeError):
    """A rank sent nothing for ``runtime.hang_timeout_s``; the run cannot continue without it (resumable)."""


class Orchestrator(OpLog):
    def __init__(self, comm: Comm, cfg, run_dir: Path, task, run_id: str, t0: float, attempt: int = 0,
                 resume: StoredCheckpoint | None = None, stop: threading.Event | None = None,
                 lighthouse: str | None = None) -> None:
        """``lighthouse``: torchft's lighthouse the trainer replicas meet at (train.replicas; a replacement
        replica is told it)."""
        self.lighthouse = lighthouse
        self.comm, self.cfg, self.task, self.t0, self.attempt, self.run_dir = comm, cfg, task, t0, attempt, run_dir
        self.roles = comm.roles
        self.policy = make_policy(cfg, self.roles.dedicated, borrowed=self.roles.borrowed)
        self.log = ShardWriter(run_dir, "events", 0, "orchestrator", run_id, cfg.model_dump_json(),
                               cfg.store.rows_per_shard, attempt)
        self.steps_done = 0
        self.max_steps = cfg.train.max_steps  # or earlier: ``dora-hpc finish`` (finish_at)
        self.finish_asked: int | None = None  # the finish request acted on
        self.checksums: dict[int, str] = {}  # version -> its checksum as the trainer published it
        self.reported: set[int] = set()      # versions whose Published has been acted on
        self.stale = Counter()
        self.env_waiting: dict[int, int] = {}  # instance -> its episodes waiting on their environment
        self.rewards: list[float] = []
        self.dashboard = Dashboard(os.environ.get("DORA_HPC_TTY") == "1")  # the launcher draws it
        self.stop = stop or threading.Event()  # set by a signal handler: checkpoint, then end the run
        self.checkpoints = Checkpointer(comm, self.op, self.log.flush)
        self.requeued: list[list] = []   # stored complete groups to stream to the trainer on resume
        # colocated placement (cluster.placement): rollout and training share the devices, so the rollout
        # ranks stop stepping while a train step runs (sync, partial and oversample by default)
        self.colocated = cfg.cluster.placement_of(cfg.mode) == "colocated"
        self.paused = False
        # liveness: a rank is watched from its first message on (model loading may take long before it)
        self.last_heard: dict[int, float] = {}
        self.fenced: set[int] = set()           # rollout ranks given up on (hung): never sent to again
        self.live_counts: list[tuple[float, int]] = [(0.0, len(self.roles.instance_ranks))]  # (t, live) changes
        self.epoch: dict[int, int] = {}         # traj -> its current dispatch (a Done of another is stale)
        self.moved_from: dict[int, int] = {}    # traj -> instance it last migrated away from, until Done
        self.weights = WeightLoads(comm)
        self.joins = JoinDesk(self)  # replacements of fenced rollout ranks and replicas (runtime/join.py)
        if resume is not None:
            self.restore(resume)
        else:  # analysis reads each launch's start step from this op (a fresh restart starts at 0)
            self.op("start", version=0, detail="fresh")
        if self.roles.replicated:  # every replica starts from the same version (the checkpoint's, or v0)
            self.weights.holders[self.steps_done] = set(self.roles.trainer_ranks)
        self.figures = StepFigures(self.now(), episodes=cfg.env.multi_turn)
        self.sinks = Sinks(cfg, run_dir, self.steps_done, run_id)  # TensorBoard / W&B, from this step on

    def restore(self, ckpt: StoredCheckpoint) -> None:
        st = ckpt.state["orchestrator"]
        if st["mode"] != self.policy.name:
            raise ResumeError(f"checkpoint {ckpt.path} is of mode {st['mode']!r}, the config says {self.cfg.mode!r}")
        ledger = Ledger.from_dict(st["ledger"])
        stored = stored_groups(self.run_dir, ledger, max_attempt=st["attempt"])
        plan = plan_resume(ledger, ckpt.step, {g: len(rows) for g, rows in stored.items()})
        self.policy.restore(ledger, plan, st.get("window"))
        self.requeued = [stored[g] for g in plan.requeue]
        self.steps_done = self.checkpoints.last = ckpt.step
        self.rewards = list(st.get("rewards", []))
        self.op("start", version=ckpt.step, detail=f"from_attempt={st['attempt']} checkpoint={ckpt.path.name} "
                f"requeued={len(plan.requeue)} redispatched={len(plan.redispatch)}")
        for g in plan.redispatch:  # its earlier tokens (if any) are never trained on
            self.op("discarded_by_preemption", version=ckpt.step, detail=f"group={g}")
        print(f"dora-hpc: resumed from {ckpt.path} (v{ckpt.step}): {len(plan.requeue)} complete groups re-queued "
              f"from the shards, {len(plan.redispatch)} re-dispatched whole", file=sys.stderr, flush=True)

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    def run(self) -> str:
        """Returns "done" (max_steps trained) or "preempted" (stopped by a signal, checkpoint committed)."""
        self.begin()
        next_tick = time.time() + self.cfg.runtime.tick_s
        deadline = time.time() + self.cfg.runtime.timeout_s
        while self.steps_done < self.max_steps or self.checkpoints.busy:
            if time.time() > deadline:
                raise RuntimeError(f"run exceeded runtime.timeout_s={self.cfg.runtime.timeout_s}")
            if self.stopping and not self.checkpoints.busy:
                if self.checkpoints.last == self.policy.next_step:
                    break
                print(f"dora-hpc: stop requested at step {self.policy.next_step}: committing a checkpoint",
                      file=sys.stderr, flush=True)
                self.start_checkpoint()
            got = self.comm.poll()
            if got is None:
                if time.time() >= next_tick:
                    next_tick = time.time() + self.cfg.runtime.tick_s
                    self.watch()
                    if not self.stopping:
                        self.feed(Tick())
                        self.report()
                time.sleep(0.0005)
                continue
            msg, src = got
            self.last_heard[src] = time.monotonic()
            if isinstance(msg, Hello):  # a replacement linked and loaded (runtime/join.py)
                self.joins.hello(src)
            elif isinstance(msg, Linked):  # a peer linked to a replacement: the next one may
                self.joins.linked(msg, src)
            elif src not in self.fenced:  # a fenced rank's work is being done elsewhere
                self.on_message(msg, src)
        return self.end()

    def begin(self) -> None:
        for bad in getattr(self.task, "malformed", []):  # skipped prompt rows: recorded, never fatal
            self.op("malformed_row", detail=bad)
            print(f"dora-hpc: skipping malformed prompt row {bad}", file=sys.stderr, flush=True)
        for trajs in self.requeued:  # before any Train: the trainer needs them for the steps to come
            for s in trajs:
                for t in self.comm.trainers_of(s.group_id):
                    self.comm.send(replace(s, prompt=self.task.prompt(s.group_id)), t)
        self.feed(Start())

    def on_message(self, msg, src: int) -> None:
        match msg:
            case Heartbeat():
                pass
            case EnvWaiting():
                self.env_waiting[msg.instance] = msg.waiting
            case Flushed() | Checkpointed():
                self.checkpoints.on_progress(msg)
            case NotCheckpointed() if self.checkpoints.busy and self.checkpoints.in_flight["version"] == msg.version:
                self.checkpoints.abandon(f"writer={src} holds v{msg.holds}")
                if self.steps_done >= self.max_steps:
                    self.start_checkpoint()
            case NotCheckpointed():
                pass  # of a checkpoint already abandoned
            case StopRequest():  # a signal reached another rank (a job-wide one reaches this one too)
                self.stop.set()
            case Published():  # every replica reports each step: the first report is acted on
                if not self.first_publish(msg, src):
                    pass
                elif self.stopping:  # the step under way when the stop came: it is in the checkpoint being
                    self.record_step(msg)  # taken, so its record is kept
                else:
                    self.on_published(msg)
            case Holds():  # a trainer replica recovered this version from a peer
                self.holder(src, msg.version, msg.checksum)
            case _ if self.stopping:
                pass  # frozen: the final snapshot is taken; what happens now is not kept
            case DecodeProgress():
                self.feed(Progress(msg.instance, msg.decoded))
            case Initial():
                self.weights.initial(msg.version, msg.checksum)
                self.holder(src, msg.version, msg.checksum)
            case Ready():
                self.weights.ready(msg)
                self.figures.loads.append(msg.load_s)
                self.feed(InstanceReady(msg.instance, msg.version))
            case Done():
                self.on_done(msg, src)
            case _:
                raise RuntimeError(f"orchestrator: unexpected message {msg!r}")

    def on_done(self, msg: Done, src: int) -> None:
        if self.epoch.get(msg.traj_id) != msg.epoch:
            return  # an earlier dispatch of a trajectory that was started again
        del self.epoch[msg.traj_id]
        self.moved_from.pop(msg.traj_id, None)
        self.checkpoints.done(src, msg.traj_id)
        self.figures.on_done(msg.response_len, msg.kv_transfer_s, msg, self.policy.ledger.group_of(msg.traj_id))
        self.feed(RequestFinished(msg.traj_id, msg.instance, msg.reward, msg.response_len))
        if msg.kv_used_fraction >= self.cfg.dora.kv_threshold:
            self.feed(KvPressure(msg.instance, msg.kv_used_fraction))

    def holder(self, src: int, version: int, checksum: str) -> None:
        """Trainer rank ``src`` holds ``version``: fault-tolerant replicas each report every version they hold
        (its holders, where loads come from), and all must hold the same weights."""
        if self.roles.replicated:
            self.weights.held(src, version)
        known = self.checksums.setdefault(version, checksum)
        if known != checksum:
            raise RuntimeError(f"trainer replicas diverged: v{version} has checksum {checksum} on rank {src}, "
                               f"{known} on another")

    def first_publish(self, msg: Published, src: int) -> bool:
        """Whether this is the step's first report (every replica reports it; one is acted on)."""
        self.holder(src, msg.version, msg.checksum)
        if self.roles.replicated and msg.version in self.reported:
            return False
        self.reported.add(msg.version)
        return True

    def on_published(self, msg: Published) -> None:
        self.steps_done += 1
        self.record_step(msg)
        self.op("publish", version=msg.version, detail=msg.checksum)
        self.report(force=True)
        every, last = self.cfg.train.checkpoint_every, self.steps_done >= self.max_steps
        if every and (msg.version % every == 0 or last) and not self.checkpoints.busy:  # the trained model is kept
            self.start_checkpoint()  # before the policy reacts: the snapshot is exactly v_n
        if not last:
            self.feed(VersionPublished(msg.version))
            if self.paused and not self.policy.trainer_busy:  # after the new weights' LoadVersion
                self.set_paused(False, msg.version)

    def start_checkpoint(self) -> None:
        """Phase one of a checkpoint of the next version: the policy's snapshot and what a resume needs."""
        state = {"orchestrator": {**self.policy.snapshot(), "attempt": self.attempt, "rewards": self.rewards,
                                  "run_id": self.log.run_id}}
        self.checkpoints.start(self.policy.next_step, state, self.live_instance_ranks, self.now())

    def end(self) -> str:
        outcome = "done" if self.steps_done >= self.max_steps else "preempted"
        if outcome == "done":  # a finish asked for is spent: a later resume goes on to train.max_steps
            (self.run_dir / FINISH).unlink(missing_ok=True)
        self.op("pending_at_end", detail=",".join(map(str, sorted(self.policy.ledger.open_groups()))))
        self.op(outcome, version=self.checkpoints.last, detail=f"next_group={self.policy.ledger.next_group}")
        self.dashboard.close(self)
        self.sinks.close()
        self.joins.close()
        self.comm.fenced = tuple(sorted(self.fenced))
        for r in range(1, self.roles.size):
            if r not in self.fenced:
                self.comm.send(Shutdown(outcome, self.comm.fenced), r)
        self.log.flush()
        return outcome

    def watch(self) -> None:
        """Act on a rank silent for ``hang_timeout_s`` (hung) or one its launcher saw die. A rollout rank
        is fenced while another is left; a trainer (or the last rollout rank, at once when it died) ends the
        job naming it, committing nothing: the last checkpoint stands (resumable: a requeued job continues
        from it)."""
        self.joins.poll()
        self.finish_at()
        now = time.monotonic()
        for r in [*self.live_rollout, *self.live_replicas]:  # its launcher saw it die (launch/local.py:
            if not self.died(r):                               # DeathWatch; launch/slurm.py: task)
                continue
            if self.others_live(r):
                self.fence(r, now - self.last_heard.get(r, now), cause="died")
                continue
            last = ("the last trainer replica" if self.roles.role(r) != "rollout" else "the last rollout instance"
                    if len(self.live_rollout) <= 1 else "a rollout instance (slurm.fence_rollout is off)")
            self.op("hung", peer=r, detail=f"died, {last}")
            self.log.flush()
            raise RankHung(f"rank {r}, {last}, died")
        for r, t in list(self.last_heard.items()):
            if r in self.fenced or now - t <= self.cfg.runtime.hang_timeout_s or self.joins.excused(r, now):
                continue
            if self.roles.fenceable(r) and self.others_live(r):
                self.fence(r, now - t)
                continue
            self.op("hung", peer=r, detail=f"silent {now - t:.0f}s")
            self.log.flush()
            raise RankHung(f"rank {r} ({self.roles.role(r)}) sent nothing for {now - t:.0f} s "
                           f"(runtime.hang_timeout_s={self.cfg.runtime.hang_timeout_s:g})")

    def finish_at(self) -> None:
        """``dora-hpc finish RUN_DIR --at STEP`` asked this run to end at STEP (RUN_DIR/finish.json): it ends
        there as at ``train.max_steps`` (the last checkpoint, exit 0); a step already trained ends it at the
        next one."""
        asked = read_finish(self.run_dir)
        if asked is None or asked == self.finish_asked:  # each request acts once: re-read later, a step it
            return                                        # named that has passed would move the end again
        self.finish_asked = asked
        self.max_steps = min(asked if asked > self.steps_done else self.steps_done + 1, self.cfg.train.max_steps)
        self.op("finish", version=self.max_steps, detail=f"asked={asked}")
        print(f"dora-hpc: finishing at step {self.max_steps} (dora-hpc finish --at {asked})", file=sys.stderr,
              flush=True)

    def died(self, r: int) -> bool:
        """``pids/rank-N.dead`` names this start's process of rank ``r`` (a marker of an earlier start, under
        Slurm, where the directory persists across requeues, names another pid)."""
        if r in self.comm.broken:  # a send to it, or its link, failed: its process is gone
            return True
        pids = self.run_dir / "pids"
        try:
            return (pids / f"rank-{r}.dead").read_text().strip() == (pids / f"rank-{r}").read_text().strip()
        except OSError:
            return False

    @property
    def live_rollout(self) -> list[int]:
        return [r for r in self.roles.rollout_ranks if r not in self.fenced]

    @property
    def live_replicas(self) -> list[int]:
        """The ranks of fault-tolerant trainer replica groups not fenced (none where the trainer is not
        replicated)."""
        return self.comm.live_trainers if self.roles.replicated else []

    @property
    def live_groups(self) -> int:
        """Fault-tolerant trainer replica groups not fenced."""
        return len({self.roles.replica_ranks(r)[0] for r in self.live_replicas})

    def others_live(self, r: int) -> bool:
        """Whether the run can go on without ``r``: another rank of its kind (rollout instance, trainer
        replica) is live, and, for a rollout rank under Slurm, ``slurm.fence_rollout`` is on (off, any lost
        rollout rank is the job's: it ends, and the job requeues)."""
        if self.roles.role(r) == "rollout":
            fencing = self.cfg.slurm.fence_rollout or "SLURM_JOB_ID" not in os.environ
            return fencing and len(self.live_rollout) > 1
        return self.live_groups > 1

    @property
    def live_instance_ranks(self) -> list[int]:
        """Ranks hosting an instance (a trainer with its borrowed one too), not fenced: they write shards."""
        return [r for r in self.roles.instance_ranks if r not in self.fenced]

    def fence(self, r: int, silent_s: float, cause: str = "hung") -> None:
        """Give up on rollout rank ``r`` (``cause``: hung, or died): nothing is sent to it again and nothing
        it sends is read; what ran on it (and what was migrating away from it) starts again elsewhere,
        through the policy; loads that waited for its weights take them from a trainer instead, and ranks
        waiting for a buffer from it stop waiting. The run goes on with one instance fewer. A trainer
        replica: ``fence_trainer``."""
        if self.roles.role(r) == "trainer":
            return self.fence_trainer(r, silent_s, cause)
        i = self.roles.instance_of_rank(r)
        self.fenced.add(r)
        self.figures.fenced += 1
        in_transit = tuple(sorted(t for t, src in self.moved_from.items() if src == i))
        again = len(self.policy.view.instances[i].active) + len(in_transit)
        # rows it held in memory are lost with it; the trainer has the trajectories, analyze is told which
        unlogged = self.checkpoints.forget(r)
        self.op("fence", peer=r, detail=f"cause={cause} silent={silent_s:.0f}s started_again={again} "
                f"unlogged={','.join(map(str, unlogged))}")
        self.log.flush()
        why = "died" if cause == "died" else f"sent nothing for {silent_s:.0f} s"
        print(f"dora-hpc: rank {r} (rollout instance {i}) {why}: fenced; {again} trajectories start again "
              f"on the {len(self.live_rollout)} other instances", file=sys.stderr, flush=True)
        self.weights.forget(i)
        # sends to it still under way, here and on every other rank, are not waited for
        self.comm.fence(r, [other for other in range(1, self.roles.size) if other not in self.fenced])
        for t in in_transit:
            self.moved_from.pop(t, None)
        self.weights.source_lost(r)
        self.live_counts.append((self.now(), len(self.live_instance_ranks)))
        self.feed(InstanceLost(i, in_transit))
        self.checkpoints.maybe_commit()

    def fence_trainer(self, r: int, silent_s: float, cause: str) -> None:
        """Give up on trainer rank ``r`` and with it its replica group (every rank of it: they shard one model):
        the other groups take each step from now on (a step it was lost in is taken again by them,
        train/ft.py); nothing is sent to its ranks again (one still running leaves once it hears of the
        fence: TrainerRank.leave), loads waiting for its weights take them from another
        replica, and a checkpoint it was writing is abandoned (taken again at once where no step is left to
        trigger the next)."""
        group = [r, *(q for q in self.roles.replica_ranks(r) if q != r and q not in self.fenced)]
        abandoned = False
        for q in group:  # ``r`` first: the rest of its group hears of it (and leaves) before being fenced itself
            self.fenced.add(q)
            self.op("fence", peer=q, detail=f"cause={cause if q == r else 'group'} silent={silent_s:.0f}s "
                    "role=trainer")
            self.comm.fence(q, [other for other in range(1, self.roles.size) if other not in self.fenced])
        self.log.flush()
        for q in group:  # the whole group fenced first: a load taken elsewhere never goes to its other ranks
            self.weights.source_lost(q)
            abandoned = self.checkpoints.trainer_lost(q) or abandoned
        why = "died" if cause == "died" else f"sent nothing for {silent_s:.0f} s"
        more = f" with its replica group (ranks {', '.join(map(str, sorted(group)))})" if len(group) > 1 else ""
        print(f"dora-hpc: rank {r} (trainer replica) {why}: fenced{more}; the replicas left ({self.live_groups}) "
              "take each step", file=sys.stderr, flush=True)
        if abandoned and self.steps_done >= self.max_steps:
            self.start_checkpoint()

    def rejoin(self, r: int) -> None:
        """A replacement took fenced rank ``r``'s place (runtime/join.py), linked to every live rank and
        loaded: it is live again, empty, and the policy gives it a version. A trainer replica's: it takes the
        next Train, and the state it trains from comes from a live replica at that step's quorum (train/ft.py);
        no load comes from it until it says it holds a version (``Holds``)."""
        self.fenced.discard(r)
        self.comm.unfence(r)
        self.comm.broken.discard(r)
        self.last_heard[r] = time.monotonic()
        if self.roles.role(r) == "trainer":
            self.weights.forget_holder(r)  # what the rank it replaces held is gone with it
            self.op("join", peer=r, detail="role=trainer")
            self.log.flush()
            print(f"dora-hpc: rank {r} (trainer replica) is back: its replacement joined; it takes the next step "
                  f"with the others ({self.live_groups} replicas)", file=sys.stderr, flush=True)
            return
        i = self.roles.instance_of_rank(r)
        self.figures.joined += 1
        self.op("join", peer=r, detail=f"instance={i}")
        self.log.flush()
        print(f"dora-hpc: rank {r} (rollout instance {i}) is back: its replacement joined; "
              f"{len(self.live_rollout)} instances", file=sys.stderr, flush=True)
        self.live_counts.append((self.now(), len(self.live_instance_ranks)))
        self.feed(InstanceJoined(i))

    # -- steps -------------------------------------------------------------------------------------
    def record_step(self, msg: Published) -> None:
        """The step's reward for the summary and its record for the metric sinks."""
        self.rewards.append(msg.metrics.get("reward_mean", float("nan")))
        view = self.policy.view
        rollout = self.figures.take(msg.version - 1, self.now(), view.instances, sum(self.env_waiting.values()),
                                    sum(len(q) for q in view.queues.values()), msg.version)
        self.sinks.log(msg.version - 1, step_record(msg.metrics, rollout))

    def feed(self, event) -> None:
        """One event into the policy; its commands out. The time of a decision that moves instances or
        requests is logged as a ``load_balancing`` op (the paper's Fig. 13 overhead)."""
        t = self.now()
        commands = self.policy.on(event)
        if any(isinstance(c, Migrate) or (isinstance(c, AssignVersion) and not c.add) for c in commands):
            self.op("load_balancing", detail=type(event).__name__, t_start=t)
        self.execute(commands)
        ended = self.figures.on_decision(t, self.policy.train_wait())
        if ended is not None:  # analysis reads what the trainer waited for from these ops
            self.op("trainer_wait", detail=ended[0], t_start=ended[1])

    def execute(self, commands) -> None:
        r = self.roles.rank_of_instance
        for c in commands:
            match c:
                case AssignVersion(i, v, src, keep, add):
                    # a borrowed instance's trainer rank keeps only its shard: that version comes from the trainers
                    source = src if src == FOLDER else (
                        TRAINERS if src == TRAINER or self.roles.role(r(src)) == "trainer" else r(src))
                    self.weights.start(i, v, source, keep, add)
                    self.op("assign", version=v, peer=source, detail=f"instance={i}")
                case Retire(i, v):
                    self.comm.send(RetireVersion(v), r(i))
                case Dispatch(t, g, s, v, i):
                    e = self.epoch[t] = self.epoch.get(t, 0) + 1
                    self.comm.send(Generate(t, g, s, v, self.task.prompt(g), self.task.max_tokens(t), e), r(i))
                case Migrate(t, src, dst, carry_kv):
                    self.moved_from[t] = src
                    self.figures.migrations += 1
                    self.comm.send(MigrateOut(t, r(dst), carry_kv), r(src))
                    self.op("migrate", traj_id=t, peer=r(dst), detail=f"{src}->{dst} kv={carry_kv}")
                case Abort(t, i):
                    self.epoch.pop(t, None)
                    self.comm.send(AbortTraj(t), r(i))
                case Offload(t, i):  # a borrowed instance's drain: its KV waits in that rank's memory
                    self.comm.send(Park(t), r(i))
                case Restore(t, i, src):  # from where it was parked, onto instance i (maybe the same one)
                    self.moved_from[t] = src
                    self.comm.send(MigrateOut(t, r(i), True), r(src))
                    self.op("migrate", traj_id=t, peer=r(i), detail=f"{src}->{i} kv=True restore")
                case Sleep(i):
                    self.weights.slept(i)
                    self.comm.send(SleepEngine(), r(i))
                case Drop(g, reason):
                    self.figures.forget(g)
                    self.op("drop", detail=f"group={g} {reason}")
                    self.forget_group(g)
                case Filter(g):
                    self.figures.forget(g)
                    self.op("filter", detail=f"group={g}")
                    self.forget_group(g)
                case StartTrain(step, groups):
                    stale = [step - self.policy.ledger.groups[g].version for g in groups]
                    self.stale.update(stale)
                    self.figures.on_train(step, stale, list(groups))
                    if (cap := self.policy.admission_cap()) is not None:
                        self.op("admission_cap", version=step, detail=f"groups={cap}")
                    for t in self.comm.live_trainers:  # each replica trains on its share of the groups
                        self.comm.send(TrainMsg(step, groups), t)
                    if self.colocated and not self.paused:
                        self.set_paused(True, step)
                case _:
                    raise RuntimeError(f"orchestrator: cannot execute {c!r}")

    def forget_group(self, g: int) -> None:
        for t in self.comm.trainers_of(g):
            self.comm.send(Forget(g), t)

    def set_paused(self, paused: bool, step: int) -> None:
        for r in self.live_rollout:
            self.comm.send(Pause(step) if paused else Resume(step), r)
        self.paused = paused
        self.op("pause" if paused else "resume", version=step)

    def report(self, force: bool = False) -> None:
        self.dashboard.update(self, force)
        self.sinks.live(self)
