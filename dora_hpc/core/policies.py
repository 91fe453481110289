"""The five rollout policies behind one interface: ``policy.on(event) -> list[Command]``.

Every policy is a pure state machine (same state + event -> same commands). Shared invariants:
* a group is tagged with one version when it is admitted and all its samples carry it (invariant 4);
* a trajectory runs only on instances hosting its version, so every token is sampled under it
  (invariant 1) -- except PartialRollout, whose AssignVersion(keep_requests=True) re-prefills live
  trajectories under the new weights (drivers record each segment's version);
* each group is consumed by exactly one StartTrain or recorded by one Drop (invariant 3, Ledger);
* StartTrain takes exactly TBS complete groups, oldest version first.

Policies: BarrierPolicy covers Sync (lag 0), OneStepOffPolicy (lag 1) and Oversample (RBS > TBS,
drop the unfinished); PartialRollout streams under one version; Dora(K) streams under a window of
versions with the rebalancing planner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from . import planner
from .cluster import ClusterView
from .events import (
    TRAINER,
    Abort,
    AssignVersion,
    Command,
    Drop,
    Event,
    InstanceReady,
    KvPressure,
    RequestFinished,
    Start,
    StartTrain,
    Tick,
    VersionPublished,
)
from .ledger import GroupState, Ledger
from .resume import ResumeError, ResumePlan
from .window import VersionWindow

MODES = ("sync", "one_step", "partial", "oversample", "dora")


@dataclass(frozen=True)
class PolicyConfig:
    """What a policy needs to know about the batch and the cluster (built from RunConfig)."""

    tbs: int                      # groups per train step
    rbs: int                      # groups in flight (RBS >= TBS)
    group_size: int               # samples per prompt (GRPO group)
    n_instances: int              # rollout instances (DP groups)
    slots: int                    # concurrent sequences per instance
    k: int = 1                    # Dora staleness bound
    kv_threshold: float = 0.9     # Dora: rebalance when an instance's KV use exceeds this
    rebalance_every: int = 1      # Dora: rebalance every N Ticks
    carry_kv: bool = True         # Dora: migrate with KV (False: re-prefill at the destination)
    legacy_topup: bool = True     # Dora: fill idle legacy slots with (window-admitted) prompts

    def __post_init__(self) -> None:
        if not 1 <= self.tbs <= self.rbs:
            raise ValueError(f"need 1 <= tbs <= rbs, got tbs={self.tbs}, rbs={self.rbs}")
        if self.group_size < 1 or self.k < 0:
            raise ValueError("group_size must be >= 1 and k >= 0")


class Policy:
    """Shared bookkeeping: the cluster view, the ledger, complete groups and the trainer state."""

    name = "policy"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.view = ClusterView(cfg.n_instances, cfg.slots, cfg.group_size)
        self.ledger = Ledger(cfg.group_size)
        self.latest = 0
        self.trainer_busy = False
        self.next_step = 0
        self.complete: dict[int, deque[int]] = {}  # version -> complete, unconsumed group ids
        self.pending_groups = 0  # admitted groups with unfinished samples

    # -- the one entry point -----------------------------------------------------------------------
    def on(self, event: Event) -> list[Command]:
        match event:
            case Start():
                return self._assign_all(self.latest)
            case InstanceReady(instance, version):
                self.view.ready(instance, version)
                return self.on_ready(instance)
            case RequestFinished(traj_id, _):
                if traj_id not in self.view.trajs:
                    return []  # it finished while our Abort was on the way (a dropped group): nothing to do
                t = self.view.remove(traj_id)
                if self.ledger.finish(traj_id):
                    self.pending_groups -= 1
                    self.complete.setdefault(self.ledger.groups[t.group_id].version, deque()).append(t.group_id)
                return self.on_finished(t.instance)
            case VersionPublished(version):
                if version != self.latest + 1 or not self.trainer_busy:
                    raise ValueError(f"unexpected VersionPublished({version}) after v{self.latest}")
                self.latest, self.trainer_busy = version, False
                return self.on_published()
            case KvPressure() | Tick():
                return self.on_pressure(event)
        raise TypeError(f"unknown event {event!r}")

    def restore(self, ledger: Ledger, plan: ResumePlan) -> None:
        """Continue a run from a checkpoint (core/resume.py); call on a fresh policy before Start.
        Stored complete groups wait for the trainer; the others are queued again, whole, under
        ``plan.version``, which is also the latest version and the next train step."""
        self.ledger = ledger
        self.latest = self.next_step = plan.version
        for g in plan.redispatch:
            ledger.reopen(g, plan.version)
            self.pending_groups += 1
            self._redispatch(g)
        for g in plan.requeue:
            self.complete.setdefault(ledger.groups[g].version, deque()).append(g)

    def _redispatch(self, group_id: int) -> None:
        self.view.enqueue_group(group_id, self.latest)

    def snapshot(self) -> dict:
        """What a checkpoint keeps of the policy (JSON-able): with the checkpoint's weights of version
        ``next_step`` this is all ``restore`` needs."""
        out = {"mode": self.name, "next_step": self.next_step, "latest": self.latest,
               "ledger": self.ledger.to_dict()}
        if hasattr(self, "window"):
            out["window"] = self.window.to_dict()
        return out

    # -- hooks -------------------------------------------------------------------------------------
    def on_ready(self, instance: int) -> list[Command]:
        return self.view.place(self.view.instances[instance].version)

    def on_finished(self, instance: int | None) -> list[Command]:
        raise NotImplementedError

    def on_published(self) -> list[Command]:
        raise NotImplementedError

    def on_pressure(self, event: KvPressure | Tick) -> list[Command]:
        return []

    # -- helpers -----------------------------------------------------------------------------------
    def admit(self, version: int) -> int:
        gid = self.ledger.new_group(version)
        self.pending_groups += 1
        self.view.enqueue_group(gid, version)
        return gid

    def n_complete(self) -> int:
        return sum(len(q) for q in self.complete.values())

    def start_train(self, group_ids: list[int]) -> StartTrain:
        step = self.next_step
        for g in group_ids:
            self.ledger.consume(g, step)
        self.next_step += 1
        self.trainer_busy = True
        return StartTrain(step, tuple(group_ids))

    def take_oldest(self, n: int) -> list[int]:
        out: list[int] = []
        for v in sorted(self.complete):
            q = self.complete[v]
            while q and len(out) < n:
                out.append(q.popleft())
            if not q:
                del self.complete[v]
        return out

    def _assign_all(self, version: int, keep_requests: bool = False) -> list[Command]:
        out: list[Command] = []
        for i, inst in enumerate(self.view.instances):
            if inst.target != version:
                cmd = AssignVersion(i, version, TRAINER, keep_requests)
                self.view.assign(cmd)
                out.append(cmd)
        return out


class BarrierPolicy(Policy):
    """Batch-synchronous rollout: batch b (RBS groups, one version >= b - lag) runs on every instance;
    the next batch starts only when this one is done (or, with ``drop_extra``, TBS groups are done
    and the rest are aborted and dropped). Step b trains on batch b."""

    def __init__(self, cfg: PolicyConfig, lag: int, drop_extra: bool) -> None:
        super().__init__(cfg)
        self.lag, self.drop_extra = lag, drop_extra
        self.batch = 0                       # index of the batch being (or next to be) rolled out
        self.rolling: set[int] = set()       # groups of the batch in rollout
        self.ready: deque[list[int]] = deque()  # rolled-out batches waiting for the trainer

    def on_ready(self, instance: int) -> list[Command]:
        return self._maybe_train() + self._maybe_roll() + super().on_ready(instance)

    def restore(self, ledger: Ledger, plan: ResumePlan) -> None:
        """Batch b holds groups [b*RBS, (b+1)*RBS): a batch with no group to re-dispatch is closed
        (waits for the trainer); at most one, the newest, may still be rolling."""
        super().restore(ledger, plan)
        self.complete.clear()
        batches: dict[int, list[int]] = {}
        for g in sorted(plan.requeue + plan.redispatch):
            batches.setdefault(g // self.cfg.rbs, []).append(g)
        again = set(plan.redispatch)
        rolling = [b for b, gs in batches.items() if again.intersection(gs)]
        if len(rolling) > 1 or (rolling and rolling[0] != max(batches)):
            raise ResumeError(f"{self.name}: batches {rolling} lost rows of closed batches; cannot resume")
        for b in sorted(batches):
            if b in rolling:
                self.rolling = set(batches[b])
                for g in batches[b]:
                    if g not in again:
                        self.complete.setdefault(ledger.groups[g].version, deque()).append(g)
            else:
                self.ready.append(batches[b])
        self.batch = rolling[0] if rolling else (max(batches) + 1 if batches else plan.version)

    def on_finished(self, instance: int | None) -> list[Command]:
        out: list[Command] = []
        if instance is not None:
            out += self.view.place(self.view.instances[instance].version)
        done = self.n_complete()  # barrier: every complete group belongs to the rolling batch
        if self.rolling and (done == len(self.rolling) or (self.drop_extra and done >= self.cfg.tbs)):
            out += self._close_batch()
        return out + self._maybe_train() + self._maybe_roll()

    def on_published(self) -> list[Command]:
        return self._maybe_train() + self._maybe_roll()

    def _close_batch(self) -> list[Command]:
        out: list[Command] = []
        batch = self.take_oldest(self.cfg.tbs)
        for g in sorted(self.rolling - set(batch)):
            for tid in self.ledger.traj_ids(g):
                t = self.view.trajs.get(tid)
                if t is not None:
                    if t.instance is not None:
                        out.append(Abort(tid, t.instance))
                    self.view.remove(tid)
            if self.ledger.groups[g].state is GroupState.PENDING:
                self.pending_groups -= 1
            self.ledger.drop(g, "oversample")
            out.append(Drop(g, "oversample"))
        self.complete.clear()
        self.rolling.clear()
        self.ready.append(batch)
        self.batch += 1
        return out

    def _maybe_train(self) -> list[Command]:
        if self.trainer_busy or not self.ready:
            return []
        return [self.start_train(self.ready.popleft())]

    def _maybe_roll(self) -> list[Command]:
        """Start the next batch once its version is out, the previous batch is done and at most
        ``lag`` rolled-out batches wait for the trainer."""
        if self.rolling or self.latest < self.batch - self.lag or len(self.ready) > self.lag:
            return []
        if any(inst.target != self.latest or not inst.ready for inst in self.view.instances):
            return [] if any(i.loading is not None for i in self.view.instances) else self._assign_all(self.latest)
        for _ in range(self.cfg.rbs):
            self.rolling.add(self.admit(self.latest))
        return self.view.place(self.latest)


class Sync(BarrierPolicy):
    name = "sync"

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg, lag=0, drop_extra=False)


class OneStepOffPolicy(BarrierPolicy):
    name = "one_step"

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg, lag=1, drop_extra=False)


class Oversample(BarrierPolicy):
    name = "oversample"

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg, lag=0, drop_extra=True)


class PartialRollout(Policy):
    """Streaming under a single version: keep up to RBS groups in flight, train on the first TBS
    complete; at each weight update every instance switches and its live trajectories continue under
    the new version after a re-prefill (AssignVersion(keep_requests=True))."""

    name = "partial"

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        self.redo: deque[int] = deque()  # resumed groups waiting to start again, whole

    def _redispatch(self, group_id: int) -> None:
        self.redo.append(group_id)

    def on_ready(self, instance: int) -> list[Command]:
        return self._train() + self._admit() + super().on_ready(instance)

    def on_finished(self, instance: int | None) -> list[Command]:
        return self._train() + self._admit()

    def on_published(self) -> list[Command]:
        out = self._assign_all(self.latest, keep_requests=True)
        self.view.retag_queued(self.latest)  # only when a group is larger than the cluster can anything wait
        return out + self._train() + self._admit()

    def _admit(self) -> list[Command]:
        """Admit whole groups only when all their samples can start now, so no sample of a group waits
        in the queue across a weight update: every group keeps one tag (invariant 4)."""
        g = min(self.cfg.group_size, self.cfg.slots * self.cfg.n_instances)
        while self.redo and self.view.free_slots(self.latest) - self.view.queued_count(self.latest) >= g:
            gid = self.redo.popleft()
            self.ledger.retag(gid, self.latest)
            self.view.enqueue_group(gid, self.latest)
        while not self.redo and (self.pending_groups < self.cfg.rbs and self.n_complete() < self.cfg.tbs
               and self.view.free_slots(self.latest) - self.view.queued_count(self.latest) >= g):
            self.admit(self.latest)
        return self.view.place(self.latest)

    def _train(self) -> list[Command]:
        if self.trainer_busy or self.n_complete() < self.cfg.tbs:
            return []
        return [self.start_train(self.take_oldest(self.cfg.tbs))]


class Dora(Policy):
    """Multi-version streaming rollout (the paper's §3): RBS > TBS groups in flight, each tagged with
    one version at admission; training starts as soon as TBS groups are complete; a VersionWindow
    keeps staleness <= K; the planner re-partitions instances across versions on every update, on KV
    pressure, every ``rebalance_every`` Ticks and when an instance runs dry; requests move with their
    KV. Admission is tiered: the latest version first (up to RBS), legacy versions only into idle
    slots and only with a step of slack in the window."""

    name = "dora"

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        self.window = VersionWindow(cfg.k, cfg.tbs)
        self.ticks = 0

    def admit(self, version: int) -> int:
        self.window.admit(version)
        return super().admit(version)

    def restore(self, ledger: Ledger, plan: ResumePlan) -> None:
        super().restore(ledger, plan)
        live: dict[int, int] = {}
        for rec in ledger.groups.values():
            if rec.state in (GroupState.PENDING, GroupState.COMPLETE):
                live[rec.version] = live.get(rec.version, 0) + 1
        self.window = VersionWindow(self.cfg.k, self.cfg.tbs, latest=plan.version, next_step=plan.version,
                                    unconsumed=live)
        if not self.window.fits():
            raise ResumeError(f"dora: the checkpoint's unconsumed groups {live} do not fit K={self.cfg.k} at "
                              f"step {plan.version}")

    def on_ready(self, instance: int) -> list[Command]:
        return self._admit() + self._train()

    def on_finished(self, instance: int | None) -> list[Command]:
        out = self._train() + self._admit()
        if instance is not None:
            inst = self.view.instances[instance]
            if inst.ready and not inst.active and not self.view.queued_count(inst.version):
                out += self._rebalance()
        return out

    def on_published(self) -> list[Command]:
        self.window.publish(self.latest)
        return self._admit() + self._rebalance() + self._train()

    def on_pressure(self, event: KvPressure | Tick) -> list[Command]:
        if isinstance(event, Tick):
            self.ticks += 1
            if self.ticks % self.cfg.rebalance_every:
                return []
        elif event.used_fraction < self.cfg.kv_threshold:
            return []
        return self._rebalance()

    def _admit(self) -> list[Command]:
        latest, g = self.latest, self.cfg.group_size
        for _ in range(min(self.cfg.rbs - self.pending_groups, self.window.room(latest))):
            self.admit(latest)
        if self.cfg.legacy_topup:
            for v in sorted(self.window.live_versions, reverse=True):
                if v == latest:
                    continue
                idle = self.view.free_slots(v) - self.view.queued_count(v)
                while idle >= g and self.window.room(v, slack=1) > 0:
                    self.admit(v)
                    idle -= g
        return self._place_all()

    def _place_all(self) -> list[Command]:
        out: list[Command] = []
        for v in sorted(self.view.queues, reverse=True):
            out += self.view.place(v)
        return out

    def _rebalance(self) -> list[Command]:
        return planner.plan(self.view, self.latest, self.cfg.carry_kv)

    def _train(self) -> list[Command]:
        if self.trainer_busy:
            return []
        if not self.window.can_train({v: len(q) for v, q in self.complete.items()}):
            return []
        batch = self.take_oldest(self.cfg.tbs)
        self.window.consume([self.ledger.groups[g].version for g in batch])
        return [self.start_train(batch)]


POLICIES: dict[str, type[Policy]] = {
    "sync": Sync, "one_step": OneStepOffPolicy, "partial": PartialRollout,
    "oversample": Oversample, "dora": Dora,
}


def make_policy(mode: str, cfg: PolicyConfig) -> Policy:
    try:
        return POLICIES[mode](cfg)
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}") from None
