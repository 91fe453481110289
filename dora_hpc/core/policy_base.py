"""What every rollout policy shares: its config, the cluster view, the ledger, the complete groups
and the trainer state, and the ``on(event) -> commands`` dispatch (core/policies.py has the five
modes; DORA's own policy is core/dora.py).

Pure, like all of core/: same state + event -> same commands.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .admission import ADMISSIONS
from .cluster import ClusterView
from .events import (
    FOLDER,
    TRAINER,
    AssignVersion,
    Command,
    Event,
    Filter,
    InstanceJoined,
    InstanceLost,
    InstanceReady,
    KvPressure,
    Progress,
    RequestFinished,
    Start,
    StartTrain,
    Tick,
    VersionPublished,
)
from .ledger import Ledger
from .resume import ResumePlan
from .work import WorkEstimate

MODES = ("sync", "one_step", "partial", "oversample", "dora")
TRAIN_WAITS = ("capacity", "tail", "window")  # what an idle trainer may wait for (Policy.train_wait)


@dataclass(frozen=True)
class Traits:
    """What a mode means to the rest of the toolkit; the shell (runtime, simulator, trainer, analysis) asks
    these and never compares mode names."""

    uses_rbs: bool                # RBS >= TBS groups in flight (else RBS is TBS)
    staleness_bound: int | None   # the largest staleness a consumed group may have (None: not bounded)
    single_version: bool          # every trajectory is sampled under one version (partial: segments)
    placement: str                # default placement: colocated (rollout pauses to train) or disaggregated
    kv_offload: bool              # preempted KV may be parked in host memory (when engine.on_kv_full=offload)
    keep_versions: int            # weight versions a trainer keeps to serve every version still live
    dynamic_sampling: bool = False  # equal-reward groups may be filtered out (batch.filter_groups): their
    #                               replacements stream through a staleness window
    auto_rbs: bool = False        # RBS may be "auto": groups are admitted while rollout slots are free (and,
    #                               under a window, while it allows), so no fixed number bounds what is in flight
    elastic: bool = False         # may borrow the trainer's accelerators for rollout while it waits (cluster.elastic)
    uses_k: bool = False          # dora.k is its staleness bound (a staleness window of K versions)
    shared_instances: bool = False  # versions may share instances (train.lora: a version is an adapter, every
    #                               instance hosts each live one, requests are placed by load alone)


@dataclass(frozen=True)
class PolicyConfig:
    """What a policy needs to know about the batch and the cluster (built from RunConfig)."""

    tbs: int                      # groups per train step
    rbs: int | None               # groups in flight (RBS >= TBS); None: auto (Traits.auto_rbs)
    group_size: int               # samples per prompt (GRPO group)
    n_instances: int              # rollout instances (DP groups)
    slots: int                    # concurrent sequences per instance
    k: int = 1                    # Dora staleness bound
    kv_threshold: float = 0.9     # Dora: rebalance when an instance's KV use exceeds this
    rebalance_every: int = 1      # Dora: rebalance every N Ticks
    carry_kv: bool = True         # Dora: migrate with KV (False: re-prefill at the destination)
    oldest_first: bool = False    # Dora: the planner serves the oldest version's pending work first (straggler)
    by_work: bool = False         # Dora: the planner apportions by decode tokens left (core/work.py), not requests
    legacy_topup: bool = True     # Dora: fill idle legacy slots with (window-admitted) prompts
    topup_after_rebalance: bool = True  # Dora: on a publish, legacy top-up follows the planner's migrations
    filter_groups: bool = False   # Dora: a complete group whose rewards are all equal is filtered (DAPO)
    borrowed: int = 0             # Dora: instances on the trainer's accelerators (cluster.elastic), numbered
    #                               after the dedicated ones; they sleep while it trains
    admission: str = "eager"      # Dora: eager (fill the window) or lean (core/admission.py)
    depth: float | None = None    # Dora, lean: the pipeline depth's cap in units of TBS (None: learned)
    group_together: bool = False  # place a group's samples where one of them runs (engines share its prompt)
    shared_instances: bool = False  # versions share instances (Traits.shared_instances; versions are adapters)

    def __post_init__(self) -> None:
        if self.tbs < 1 or (self.rbs is not None and self.rbs < self.tbs):
            raise ValueError(f"need 1 <= tbs <= rbs, got tbs={self.tbs}, rbs={self.rbs}")
        if self.group_size < 1 or self.k < 0:
            raise ValueError("group_size must be >= 1 and k >= 0")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.filter_groups and self.group_size < 2:
            raise ValueError("filter_groups needs group_size >= 2 (a group of one always has equal rewards)")


class Policy:
    """Shared bookkeeping: the cluster view, the ledger, complete groups and the trainer state."""

    name = "policy"

    @classmethod
    def traits(cls, k: int) -> Traits:
        """This mode's traits under staleness bound ``k`` (only DORA reads it)."""
        raise NotImplementedError

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.view = ClusterView(cfg.n_instances, cfg.slots, cfg.group_size, cfg.borrowed, cfg.group_together,
                                cfg.shared_instances)
        self.ledger = Ledger(cfg.group_size)
        self.latest = 0
        self.trainer_busy = False
        self.next_step = 0
        self.complete: dict[int, deque[int]] = {}  # version -> complete, unconsumed group ids
        self.pending_groups = 0  # admitted groups with unfinished samples
        self.rewards: dict[int, set[float]] = {}  # filter_groups: distinct rewards of each pending group
        self.work = WorkEstimate() if cfg.by_work else None  # decode tokens left per live request (planner: work)

    # -- the one entry point -----------------------------------------------------------------------
    def on(self, event: Event) -> list[Command]:
        match event:
            case Start():
                # version 0 is the model folder the instances start from: rollout need not wait for the trainer
                return self._assign_all(self.latest, FOLDER if self.latest == 0 else TRAINER)
            case InstanceReady(instance, version):
                if self.view.instances[instance].asleep:
                    return []  # a load that a Sleep cancelled (drivers need not send it)
                self.view.ready(instance, version)
                return self.on_ready(instance)
            case RequestFinished(traj_id, _, reward, tokens):
                if traj_id not in self.view.trajs:
                    if self.work:
                        self.work.forget(traj_id)
                    return []  # it finished while our Abort was on the way (a dropped group): nothing to do
                t = self.view.remove(traj_id)
                if self.work:
                    self.work.finished(traj_id, tokens)
                out: list[Command] = []
                if self.cfg.filter_groups:
                    self.rewards.setdefault(t.group_id, set()).add(reward)
                if self.ledger.finish(traj_id):
                    self.pending_groups -= 1
                    version = self.ledger.groups[t.group_id].version
                    if self.cfg.filter_groups and len(self.rewards.pop(t.group_id)) == 1:
                        self.ledger.filter(t.group_id)
                        self.on_filtered(version)
                        out.append(Filter(t.group_id))
                    else:
                        self.complete.setdefault(version, deque()).append(t.group_id)
                return out + self.on_finished(t.instance)
            case VersionPublished(version):
                if version != self.latest + 1 or not self.trainer_busy:
                    raise ValueError(f"unexpected VersionPublished({version}) after v{self.latest}")
                self.latest, self.trainer_busy = version, False
                return self.on_published()
            case KvPressure() | Tick():
                return self.on_pressure(event)
            case Progress(_, decoded):
                if self.work:
                    self.work.progress(decoded)
                return []
            case InstanceLost(instance, in_transit):
                if self.view.instances[instance].lost:
                    return []
                if self.work:
                    for t in (*self.view.instances[instance].active, *in_transit):
                        self.work.forget(t)  # it starts again from its prompt
                out: list[Command] = list(self.view.lose(instance, in_transit))
                if all(inst.lost for inst in self.view.instances):
                    raise ValueError("every rollout instance is lost")
                return out + self.on_lost()
            case InstanceJoined(instance):
                self.view.rejoin(instance)
                return self.on_joined(instance)
        raise TypeError(f"unknown event {event!r}")

    def restore(self, ledger: Ledger, plan: ResumePlan, window: dict | None = None) -> None:
        """Continue a run from a checkpoint (core/resume.py); call on a fresh policy before Start.
        Stored complete groups wait for the trainer; the others are queued again, whole, under
        ``plan.version``, which is also the latest version and the next train step. ``window``: the
        checkpoint's own (``snapshot``), which a windowed policy checks against the ledger's."""
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

    def on_filtered(self, version: int) -> None:
        """A complete group of ``version`` was filtered (its place is free for a replacement)."""

    def on_lost(self) -> list[Command]:
        """An instance was lost and its trajectories queued again: place what the others can take."""
        out: list[Command] = []
        for v in sorted(self.view.queues, reverse=True):
            out += self.view.place(v)
        return out

    def on_joined(self, instance: int) -> list[Command]:
        """A replacement took lost ``instance``'s place: it loads the latest version (every mode may generate
        under it) from a peer instance that holds it, else from the trainer, and takes work once loaded
        (``on_ready``). A peer first, as the planner does: a replacement that dies while it loads can take
        its sender's process with it (slurm/NOTES.md), and a lost peer is fenced where a lost trainer ends
        the start. A borrowed one stays asleep until the policy wakes it."""
        if self.view.instances[instance].asleep:
            return []
        peers = self.view.hosts(self.latest, ready_only=True)  # never ``instance``: it holds no version
        cmd = AssignVersion(instance, self.latest, peers[0] if peers else FOLDER if self.latest == 0 else TRAINER)
        self.view.assign(cmd)
        return [cmd]

    # -- helpers -----------------------------------------------------------------------------------
    def admit(self, version: int) -> int:
        gid = self.ledger.new_group(version)
        self.pending_groups += 1
        self.view.enqueue_group(gid, version)
        return gid

    def capacity(self) -> int:
        """Groups to admit so that every rollout slot of the live instances has a trajectory, counting every
        trajectory already in flight (queued, running or migrating): what ``rbs: auto`` admits. The last
        group may overfill by less than a group, so a group larger than the free slots still starts."""
        free = self.view.n_live * self.cfg.slots - len(self.view.trajs)
        return max(0, -(-free // self.cfg.group_size))

    def admission_cap(self) -> int | None:
        """The cap on the pipeline's depth in groups (lean admission, core/admission.py); None: not capped."""
        return None

    def n_complete(self) -> int:
        return sum(len(q) for q in self.complete.values())

    def train_wait(self) -> str | None:
        """What an idle trainer waits for (None while it trains or may start):

        * ``"capacity"``: fewer than TBS complete groups, and requests wait in a queue for a rollout slot
          (more rollout capacity shortens it);
        * ``"tail"``: fewer than TBS complete groups, nothing queued: the last requests it needs are
          decoding (a batch's straggler tail; more in flight or a larger K shortens it);
        * ``"window"`` (Dora): TBS groups are complete, but the staleness window needs older ones still
          decoding (their decode latency binds; a larger K shortens it)."""
        if self.trainer_busy or self.n_complete() >= self.cfg.tbs:
            return None
        return self._queued_or_tail()

    def _queued_or_tail(self) -> str:
        return "capacity" if any(self.view.queues.values()) else "tail"

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

    def _assign_all(self, version: int, source: int = TRAINER, keep_requests: bool = False) -> list[Command]:
        out: list[Command] = []
        for i, inst in enumerate(self.view.instances):
            if inst.target != version and not inst.lost:
                cmd = AssignVersion(i, version, source, keep_requests)
                self.view.assign(cmd)
                out.append(cmd)
        return out
