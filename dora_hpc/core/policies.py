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
versions with the rebalancing planner (core/dora.py).
"""

from __future__ import annotations

from collections import deque

from .dora import Dora
from .events import Abort, Command, Drop
from .ledger import GroupState, Ledger
from .policy_base import MODES, Policy, PolicyConfig, Traits
from .resume import ResumeError, ResumePlan

__all__ = ["MODES", "POLICIES", "Dora", "OneStepOffPolicy", "Oversample", "PartialRollout", "Policy", "PolicyConfig",
           "Sync", "Traits", "make_policy", "policy_for", "traits_of"]


class BarrierPolicy(Policy):
    """Batch-synchronous rollout: batch b (RBS groups, one version >= b - lag) runs on every instance;
    the next batch starts only when this one is done (or, with ``drop_extra``, TBS groups are done
    and the rest are aborted and dropped). Step b trains on batch b."""

    lag = 0              # rolled-out batches that may wait for the trainer (staleness bound)
    drop_extra = False   # oversample: the batch closes at TBS complete groups, the rest dropped
    placement = "colocated"

    @classmethod
    def traits(cls, k: int) -> Traits:
        # a batch rolls out under the latest version once every instance holds it, so requests name the
        # latest or the one before it (a load in flight while the trainer publishes); lag adds one
        return Traits(uses_rbs=cls.drop_extra, staleness_bound=cls.lag, single_version=True, placement=cls.placement,
                      kv_offload=False, keep_versions=2 + cls.lag)

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        self.batch = 0                       # index of the batch being (or next to be) rolled out
        self.rolling: set[int] = set()       # groups of the batch in rollout
        self.ready: deque[list[int]] = deque()  # rolled-out batches waiting for the trainer

    def on_ready(self, instance: int) -> list[Command]:
        return self._maybe_train() + self._maybe_roll() + super().on_ready(instance)

    def restore(self, ledger: Ledger, plan: ResumePlan, window: dict | None = None) -> None:
        """Batch b holds groups [b*RBS, (b+1)*RBS): a batch with no group to re-dispatch is closed
        (waits for the trainer); at most one, the newest, may still be rolling."""
        super().restore(ledger, plan, window)
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

    def on_lost(self) -> list[Command]:  # the lost instance may be the load the next batch waited for
        return super().on_lost() + self._maybe_train() + self._maybe_roll()

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

    def train_wait(self) -> str | None:
        return None if self.trainer_busy or self.ready else self._queued_or_tail()

    def _maybe_train(self) -> list[Command]:
        if self.trainer_busy or not self.ready:
            return []
        return [self.start_train(self.ready.popleft())]

    def _maybe_roll(self) -> list[Command]:
        """Start the next batch once its version is out, the previous batch is done and at most
        ``lag`` rolled-out batches wait for the trainer."""
        if self.rolling or self.latest < self.batch - self.lag or len(self.ready) > self.lag:
            return []
        live = [self.view.instances[i] for i in self.view.live]
        if any(inst.target != self.latest or not inst.ready for inst in live):
            return [] if any(i.loading is not None for i in live) else self._assign_all(self.latest)
        for _ in range(self.cfg.rbs):
            self.rolling.add(self.admit(self.latest))
        return self.view.place(self.latest)


class Sync(BarrierPolicy):
    name = "sync"


class OneStepOffPolicy(BarrierPolicy):
    name = "one_step"
    lag = 1
    placement = "disaggregated"


class Oversample(BarrierPolicy):
    name = "oversample"
    drop_extra = True


class PartialRollout(Policy):
    """Streaming under a single version: keep up to RBS groups in flight, train on the first TBS
    complete; at each weight update every instance switches and its live trajectories continue under
    the new version after a re-prefill (AssignVersion(keep_requests=True))."""

    name = "partial"

    @classmethod
    def traits(cls, k: int) -> Traits:
        # a trajectory's tokens span versions; instances load the latest while the trainer trains on: the
        # latest, the one before and one spare
        return Traits(uses_rbs=True, staleness_bound=None, single_version=False, placement="colocated",
                      kv_offload=False, keep_versions=3, auto_rbs=True)

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        self.redo: deque[int] = deque()  # resumed groups waiting to start again, whole

    def _redispatch(self, group_id: int) -> None:
        self.redo.append(group_id)

    def on_ready(self, instance: int) -> list[Command]:
        return self._train() + self._admit() + super().on_ready(instance)

    def on_finished(self, instance: int | None) -> list[Command]:
        return self._train() + self._admit()

    def on_lost(self) -> list[Command]:
        return super().on_lost() + self._train() + self._admit()

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
        rbs = self.cfg.rbs if self.cfg.rbs is not None else float("inf")  # auto: the free slots alone decide
        while not self.redo and (self.pending_groups < rbs and self.n_complete() < self.cfg.tbs
               and self.view.free_slots(self.latest) - self.view.queued_count(self.latest) >= g):
            self.admit(self.latest)
        return self.view.place(self.latest)

    def _train(self) -> list[Command]:
        if self.trainer_busy or self.n_complete() < self.cfg.tbs:
            return []
        return [self.start_train(self.take_oldest(self.cfg.tbs))]


POLICIES: dict[str, type[Policy]] = {
    "sync": Sync, "one_step": OneStepOffPolicy, "partial": PartialRollout,
    "oversample": Oversample, "dora": Dora,
}


def traits_of(mode: str, k: int) -> Traits:
    """The traits of ``mode`` under staleness bound ``k`` (docs/architecture.md: who asks what)."""
    if mode not in POLICIES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    return POLICIES[mode].traits(k)


def make_policy(run_config, instances: int, mode: str | None = None, borrowed: int = 0) -> Policy:
    """The policy of a RunConfig (``mode``: another mode with the same settings, as the simulator's
    comparisons run) over ``instances`` rollout instances and ``borrowed`` ones on the trainer's
    accelerators; the only place a RunConfig becomes a PolicyConfig."""
    mode = mode or run_config.mode
    b, d, traits = run_config.batch, run_config.dora, traits_of(mode, run_config.dora.k)
    legacy_topup = d.admission == "eager" if d.legacy_topup is None else d.legacy_topup
    rbs = b.rbs
    if rbs == "auto":  # a mode with a fixed batch (the simulator compares every mode) takes what fills the slots
        rbs = None if traits.auto_rbs else max(b.tbs, instances * run_config.cluster.max_num_seqs // b.group_size)
    cfg = PolicyConfig(tbs=b.tbs, rbs=rbs if traits.uses_rbs else b.tbs, group_size=b.group_size,
                       n_instances=instances, slots=run_config.cluster.max_num_seqs, k=d.k,
                       kv_threshold=d.kv_threshold, rebalance_every=d.rebalance_every, carry_kv=d.kv_migration,
                       oldest_first=d.planner == "straggler", by_work=d.planner == "work", legacy_topup=legacy_topup,
                       topup_after_rebalance=d.supplement == "after_migration", filter_groups=b.filter_groups,
                       borrowed=borrowed, admission=d.admission, depth=d.depth,
                       group_together=run_config.engine.prefix_caching,
                       shared_instances=traits.shared_instances and shares_instances(run_config))
    return policy_for(mode, cfg)


def shares_instances(run_config) -> bool:
    """Whether a RunConfig's versions are adapters an instance can hold side by side: train.lora (the built-in
    engine and vLLM's backend both serve several adapters in one batch)."""
    return run_config.train.lora is not None


def policy_for(mode: str, cfg: PolicyConfig) -> Policy:
    """The policy of ``mode`` on a PolicyConfig (tests and drivers that build one directly)."""
    if mode not in POLICIES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if cfg.borrowed and not POLICIES[mode].traits(cfg.k).elastic:
        raise ValueError(f"borrowed instances (cluster.elastic) need a policy that drains them before training; "
                         f"mode {mode!r} has none")
    if cfg.shared_instances and not POLICIES[mode].traits(cfg.k).shared_instances:
        raise ValueError(f"shared instances (versions as adapters) need a policy that hosts several versions on an "
                         f"instance; mode {mode!r} has none")
    if cfg.shared_instances and cfg.borrowed:
        raise ValueError("shared instances (train.lora) do not run with borrowed ones (cluster.elastic) yet")
    if cfg.filter_groups and not POLICIES[mode].traits(cfg.k).dynamic_sampling:
        raise ValueError(f"filter_groups (dynamic sampling) streams replacements through DORA's window; mode {mode!r} "
                         "has none")
    return POLICIES[mode](cfg)
