"""Dora(K), the paper's policy: multi-version streaming rollout under a staleness window, with the
rebalancing planner and (cluster.elastic) instances borrowed from the trainer.

Pure, like all of core/. Invariants (beyond core/policies.py's shared ones): every consumed group has
staleness <= K (core/window.py keeps it by construction); requests move only between instances of
their own version, with their KV unless told otherwise; a borrowed instance holds no request when a
train step starts.
"""

from __future__ import annotations

from . import planner
from .admission import LeanDepth
from .events import TRAINER, AssignVersion, Command, KvPressure, Migrate, Tick
from .ledger import GroupState, Ledger
from .policy_base import Policy, PolicyConfig, Traits
from .resume import ResumeError, ResumePlan
from .window import VersionWindow


class Dora(Policy):
    """Multi-version streaming rollout (the paper's §3): RBS > TBS groups in flight, each tagged with
    one version at admission; training starts as soon as TBS groups are complete; a VersionWindow
    keeps staleness <= K; the planner re-partitions instances across versions on every update, on KV
    pressure, every ``rebalance_every`` Ticks and when an instance is idle (run dry, or ready with a
    version that has no work left); requests move with their KV. Admission is tiered: the latest
    version first (up to RBS), legacy versions only into idle slots and only with a step of slack in
    the window.

    Admission (``cfg.admission``): ``eager`` admits whatever RBS and the window allow, so the window
    fills and staleness sits near K; ``lean`` (core/admission.py) admits only groups the slots can start
    now, caps the pipeline's depth (groups not yet in published weights) at a learned cap, and at each
    publish moves groups still queued whole to the new version: a group takes its version when it can
    start to generate.

    Elastic (``borrowed`` instances on the trainer's accelerators): they serve while the trainer waits
    for the window; before a train step each gives its accelerators back -- its requests migrate with
    their KV to dedicated instances of their version with room, the rest are offloaded to host memory
    and restored, first of their queue, on the next instance of their version with room -- and sleeps;
    after the step it wakes with the latest version. Nothing is re-prefilled and every trajectory keeps
    its one version.

    Shared instances (``cfg.shared_instances``: a version is an adapter): every instance hosts every version
    that live work needs. On a publish each instance adds the new version and retires those no trajectory,
    queued or running, is tagged with; a request is placed on the least-loaded instance with room whatever
    its version, the oldest version's queue first (the window waits on it). There is nothing to re-partition,
    so the planner and its migrations do not run."""

    name = "dora"

    @classmethod
    def traits(cls, k: int) -> Traits:
        # versions v-K..v live on the instances, v+1 being made: K + 2
        return Traits(uses_rbs=True, staleness_bound=k, single_version=True, placement="disaggregated",
                      kv_offload=True, keep_versions=k + 2, dynamic_sampling=True, auto_rbs=True, elastic=True,
                      uses_k=True, shared_instances=True)

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        self.window = VersionWindow(cfg.k, cfg.tbs)
        self.lean = LeanDepth(cfg.tbs, cfg.k, cfg.depth) if cfg.admission == "lean" else None
        self.ticks = 0

    def admit(self, version: int) -> int:
        self.window.admit(version)
        return super().admit(version)

    def restore(self, ledger: Ledger, plan: ResumePlan, window: dict | None = None) -> None:
        """The window is rebuilt from the ledger; the checkpoint's stored window, taken at the same
        moment, must count the same unconsumed groups per version (else the checkpoint is inconsistent)."""
        stored = _unconsumed(ledger)  # before re-dispatched groups move to plan.version
        if window is not None:
            kept = {int(v): c for v, c in window["unconsumed"].items() if c}
            if kept != stored or window["k"] != self.cfg.k:
                raise ResumeError(f"dora: the checkpoint's window (K={window['k']}, unconsumed {kept}) is not the "
                                  f"one its ledger gives (K={self.cfg.k}, unconsumed {stored})")
        super().restore(ledger, plan, window)
        if self.lean is not None and window is not None and window.get("depth") and self.cfg.depth is None:
            self.lean = LeanDepth(self.cfg.tbs, self.cfg.k, depth=int(window["depth"]))
        live = _unconsumed(ledger)
        self.window = VersionWindow(self.cfg.k, self.cfg.tbs, latest=plan.version, next_step=plan.version,
                                    unconsumed=live)
        if not self.window.fits():
            raise ResumeError(f"dora: the checkpoint's unconsumed groups {live} do not fit K={self.cfg.k} at "
                              f"step {plan.version}")

    def on_ready(self, instance: int) -> list[Command]:
        out = self._admit() + self._train() + self._rebalance_if_idle(instance)
        return out + (self._retire() + self._add_needed() if self.cfg.shared_instances else [])

    def _rebalance_if_idle(self, instance: int) -> list[Command]:
        """An instance with nothing to run for its version (its load outlived the version's work, or
        its last request finished) is offered to a starved version now, not at the next Tick."""
        if self.cfg.shared_instances:
            return []
        inst = self.view.instances[instance]
        if inst.ready and not inst.active and not self.view.queued_count(inst.version):
            return self._rebalance()
        return []

    def on_filtered(self, version: int) -> None:
        self.window.drop(version)  # it leaves the window; _admit (next) dispatches a replacement

    def on_finished(self, instance: int | None) -> list[Command]:
        out = self._train() + self._admit()
        return out + (self._rebalance_if_idle(instance) if instance is not None else [])

    def snapshot(self) -> dict:
        out = super().snapshot()
        if self.lean is not None:
            out["window"]["depth"] = self.lean.depth
        return out

    def admission_cap(self) -> int | None:
        return self.lean.depth if self.lean is not None else None

    def on_published(self) -> list[Command]:
        self.window.publish(self.latest)
        if self.lean is not None:
            self.lean.on_trainer_free(self.n_complete(), self._can_train())
            self._retag_unstarted()
        wake = [] if self._can_train() else self._wake()  # a step that starts at once would put them back to sleep
        if self.cfg.shared_instances:
            return self._add_needed() + self._admit() + self._retire() + self._train()
        if self.cfg.topup_after_rebalance:  # the paper's tiers: fresh work, then migration, then legacy top-up
            return wake + self._admit(legacy=False) + self._rebalance() + self._admit() + self._train()
        return wake + self._admit() + self._rebalance() + self._train()

    def _needed(self) -> set[int]:
        """Shared instances: the versions live work needs: the latest, every trajectory's (queued or running),
        and with legacy top-up every version the window may still admit under; all within the window."""
        needed = {self.latest} | {t.version for t in self.view.trajs.values()}
        return needed | set(self.window.live_versions) if self.cfg.legacy_topup else needed

    def _add_needed(self) -> list[Command]:
        """Shared instances: each ready instance with no load under way adds the newest needed version it lacks
        (one load at a time: the next follows its InstanceReady). A publish brings the latest; a replacement,
        or an instance that missed a publish, catches up with what the window still holds, from the trainers
        (which keep every live version)."""
        needed, out = self._needed(), []
        for i, inst in enumerate(self.view.instances):
            missing = needed - inst.resident - {inst.version}
            if inst.ready and not inst.adding and missing:
                cmd = AssignVersion(i, max(missing), TRAINER, add=True)
                self.view.assign(cmd)
                out.append(cmd)
        return out

    def _retire(self) -> list[Command]:
        """Shared instances: each instance drops the versions no live work needs (``_needed``); at most the K + 1
        versions the window holds stay resident."""
        needed, out = self._needed(), []
        for i, inst in enumerate(self.view.instances):
            for v in sorted(inst.resident - needed - {inst.version}):
                out.append(self.view.retire(i, v))
        return out

    def _wake(self) -> list[Command]:
        """The trainer is free and must wait: each asleep borrowed instance loads the latest version from
        the trainer that hosts it (the planner may give it another)."""
        out: list[Command] = []
        for i in self.view.borrowed:
            if self.view.instances[i].asleep:
                cmd = AssignVersion(i, self.latest, TRAINER)
                self.view.assign(cmd)
                out.append(cmd)
        return out

    def _lend_back(self) -> list[Command]:
        """Before a train step: each awake borrowed instance's requests migrate (with KV) to the fullest
        dedicated instance of their version with room, or are offloaded to host (first in their queue:
        the next free slot of their version restores them); then it sleeps."""
        out: list[Command] = []
        for i in self.view.borrowed:
            inst = self.view.instances[i]
            if inst.asleep:
                continue
            for tid in sorted(inst.active):  # (one version per instance)
                v = self.view.trajs[tid].version
                room = [(self.view.instances[j].free, j) for j in self.view.hosts(v, ready_only=True)
                        if not self.view.instances[j].borrowed and self.view.instances[j].free > 0]
                if room:
                    m = Migrate(tid, i, min(room)[1], self.cfg.carry_kv)
                    self.view.migrate(m)
                    out.append(m)
                else:
                    out.append(self.view.offload(tid))
            out.append(self.view.sleep(i))
        return out

    def on_pressure(self, event: KvPressure | Tick) -> list[Command]:
        if isinstance(event, Tick):
            self.ticks += 1
            if self.ticks % self.cfg.rebalance_every:
                return []
        elif event.used_fraction < self.cfg.kv_threshold:
            return []
        return self._rebalance()

    def _admit(self, legacy: bool = True) -> list[Command]:
        """Fresh groups of the latest version up to RBS; then (``legacy``) window-admitted groups of older
        versions into their idle slots; then every queue is placed."""
        latest, g = self.latest, self.cfg.group_size
        fresh = self.cfg.rbs - self.pending_groups if self.cfg.rbs is not None else self.capacity()
        fresh = min(fresh, self.window.room(latest))
        if self.lean is not None:  # only what the slots can start now, within the depth cap
            fresh = self.lean.room(self._in_pipeline(), min(fresh, self.capacity()))
        for _ in range(fresh):
            self.admit(latest)
        if self.cfg.legacy_topup and legacy:
            for v in sorted(self.window.live_versions, reverse=True):
                if v == latest:
                    continue
                idle = self.view.idle_slots(v)
                while idle >= g and self.window.room(v, slack=1) > 0 and (
                        self.lean is None or self._in_pipeline() < self.lean.depth):
                    self.admit(v)
                    idle -= g
        return self._place_all()

    def _in_pipeline(self) -> int:
        """The pipeline's depth: groups whose update is not yet published -- admitted and not consumed
        (pending or complete), and the batch in the trainer. What lean admission caps (core/admission.py)."""
        return sum(self.window.unconsumed.values()) + (self.cfg.tbs if self.trainer_busy else 0)

    def _retag_unstarted(self) -> None:
        """Lean: groups of older versions still queued whole (no sample started) take the latest version,
        which they will start under; the window only gets roomier (a group moves to a newer version)."""
        for gid, old in self.view.retag_unstarted(self.latest):
            self.ledger.retag(gid, self.latest)
            self.window.drop(old)
            self.window.admit(self.latest)

    def on_lost(self) -> list[Command]:
        adds = self._add_needed() if self.cfg.shared_instances else []  # requeued work may need older versions
        return adds + self._rebalance() + self._admit() + self._train()

    def _place_all(self) -> list[Command]:
        """Each version's queue onto its instances: newest first, or with shared instances (where the queues
        compete for the same slots) oldest first, as the window waits on the oldest."""
        out: list[Command] = []
        for v in sorted(self.view.queues, reverse=not self.cfg.shared_instances):
            out += self.view.place(v)
        return out

    def _rebalance(self) -> list[Command]:
        if self.cfg.shared_instances:
            return []  # nothing to re-partition: every instance hosts every live version
        return planner.plan(self.view, self.latest, self.cfg.carry_kv, self.cfg.oldest_first, self.work)

    def train_wait(self) -> str | None:
        """As Policy's, and ``"window"`` when the gate needs older groups; that wait counts as
        ``"capacity"`` while a request of a version the next step must consume is queued for a slot."""
        if self.trainer_busy or self.n_complete() < self.cfg.tbs:
            return super().train_wait()
        if self._can_train():
            return None
        oldest = self.window.must_consume()
        return "capacity" if any(self.view.queued_count(v) for v in self.view.queues if v <= oldest) else "window"

    def _can_train(self) -> bool:
        return self.window.can_train({v: len(q) for v, q in self.complete.items()})

    def _train(self) -> list[Command]:
        if self.trainer_busy:
            return []
        if not self._can_train():
            return []
        batch = self.take_oldest(self.cfg.tbs)
        self.window.consume([self.ledger.groups[g].version for g in batch])
        return self._lend_back() + [self.start_train(batch)]


def _unconsumed(ledger: Ledger) -> dict[int, int]:
    """Groups per version not yet consumed (pending or complete): what the window counts."""
    live: dict[int, int] = {}
    for rec in ledger.groups.values():
        if rec.state in (GroupState.PENDING, GroupState.COMPLETE):
            live[rec.version] = live.get(rec.version, 0) + 1
    return live
