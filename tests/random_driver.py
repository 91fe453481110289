"""A driver that executes a policy's commands and delivers their completions in a random order.

It keeps its own record of what happened (independent of the policy's bookkeeping) and checks the
run invariants (docs/invariants.md) on every command: single version per trajectory, groups never split across
versions, staleness bounds, exactly-once consumption, nothing lost.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

from dora_hpc.core.events import (
    FOLDER,
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
from dora_hpc.core.policies import Policy

STALENESS_BOUND = {"sync": 0, "one_step": 1, "oversample": 0}


class InvariantBroken(AssertionError):
    pass


class RandomDriver:
    def __init__(self, policy: Policy, rng: random.Random, lose: int = 0, rejoin: bool = False) -> None:
        """``lose``: instances to fence at random moments (InstanceLost), at least one always kept;
        ``rejoin``: a lost instance's replacement joins at a random moment (InstanceJoined)."""
        self.filtered: set[int] = set()
        self.rewards: dict[int, float] = {}  # traj -> the reward it finished with
        self.p, self.rng = policy, rng
        n = policy.cfg.n_instances + policy.cfg.borrowed  # borrowed instances come after the dedicated ones
        self.borrowed = set(range(policy.cfg.n_instances, n))
        self.asleep: set[int] = set()
        self.served: set[int] = set()                  # instances that were dispatched a request
        self.parked: dict[int, int] = {}               # offloaded traj -> the borrowed instance it waits for
        self.to_lose = min(lose, n - 1)
        self.lost: set[int] = set()
        self.rejoin = rejoin
        self.joined: set[int] = set()             # instances a replacement took over
        self.served_after_join: set[int] = set()  # ... and that were dispatched a request since
        self.regenerated: set[int] = set()  # trajectories that were running on a lost instance
        self.started = False
        self.version: list[int | None] = [None] * n   # ready version per instance
        self.loading: dict[int, int] = {}              # instance -> version being loaded
        self.extra: dict[int, set[int]] = defaultdict(set)   # shared: every version hosted (once ready)
        self.adding: dict[int, set[int]] = defaultdict(set)  # shared: versions loading beside them
        self.mixed_instances = 0                        # shared: most versions running on one instance at once
        self.where: dict[int, int] = {}                # live traj -> instance
        self.segments: dict[int, list[int]] = defaultdict(list)
        self.group_tag: dict[int, int] = {}
        self.finished: set[int] = set()
        self.consumed: Counter[int] = Counter()
        self.dropped: set[int] = set()
        self.staleness: list[int] = []
        self.train_step: int | None = None
        self.steps_done = 0
        self.max_live_versions = 0
        self.migrations = 0
        self.reprefills = 0
        self.elastic = {"sleeps": 0, "offloads": 0, "restores": 0, "drain_migrations": 0, "wakes": 0}
        self.woken_now: set[int] = set()  # borrowed instances woken by the event being executed

    # -- executing commands ------------------------------------------------------------------------
    def feed(self, event) -> None:
        self.woken_now = set()
        for cmd in self.p.on(event):
            self.execute(cmd)

    def serving(self, i: int) -> set[int]:
        """The versions instance ``i`` can run now (by this driver's own record)."""
        if self.version[i] is None:
            return set()
        return self.extra[i] if self.p.cfg.shared_instances else {self.version[i]}

    def execute(self, cmd) -> None:
        at = getattr(cmd, "dst", getattr(cmd, "instance", None))
        if isinstance(cmd, AssignVersion | Dispatch | Migrate) and at in self.lost:
            raise InvariantBroken(f"{cmd}: instance {at} is lost")
        match cmd:
            case AssignVersion(i, v, src, keep, add) if add:
                if not self.p.cfg.shared_instances or self.version[i] is None or v in self.serving(i) | self.adding[i]:
                    raise InvariantBroken(f"{cmd}: an added version where versions do not share instances, or twice")
                self.adding[i].add(v)
            case Retire(i, v):
                if v not in self.extra[i] or any(j == i and self.segments[t][-1] == v for t, j in self.where.items()):
                    raise InvariantBroken(f"{cmd}: not hosted there, or a request of it still runs there")
                self.extra[i].discard(v)
            case AssignVersion(i, v, src, keep, _):
                if i in self.asleep and self.train_step is not None:
                    raise InvariantBroken(f"{cmd}: a borrowed instance woken while the trainer trains")
                if i in self.asleep:
                    self.elastic["wakes"] += 1
                    self.woken_now.add(i)
                self.asleep.discard(i)
                live = [t for t, j in self.where.items() if j == i]
                if live and not keep:
                    raise InvariantBroken(f"{cmd}: instance still holds {live}")
                if keep and self.p.name != "partial":
                    raise InvariantBroken(f"{self.p.name} switched live requests to a new version")
                if src == FOLDER and v != 0:
                    raise InvariantBroken(f"{cmd}: only version 0 is the model folder")
                if src >= 0 and v not in self.serving(src):
                    raise InvariantBroken(f"{cmd}: peer {src} does not hold v{v}")
                for t in live:
                    self.segments[t].append(v)
                    self.reprefills += 1
                self.version[i] = None
                self.extra[i], self.adding[i] = set(), set()
                self.loading[i] = v
            case Dispatch(t, g, _, v, i):
                if v not in self.serving(i):
                    raise InvariantBroken(f"{cmd}: instance {i} holds {sorted(self.serving(i))}")
                cfg = self.p.cfg
                # partial rollout moves a group's samples to each new version; one started again after a
                # loss starts under the version of the moment, as its group's other samples run under
                may_split = self.p.name == "partial" and (cfg.group_size > cfg.slots * cfg.n_instances
                                                          or t in self.regenerated)
                if self.group_tag.setdefault(g, v) != v and not may_split:
                    raise InvariantBroken(f"group {g} split across v{self.group_tag[g]} and v{v}")
                if t in self.where or t in self.finished:
                    raise InvariantBroken(f"trajectory {t} dispatched twice")
                self.where[t] = i
                self.served.add(i)
                if i in self.joined:
                    self.served_after_join.add(i)
                self.segments[t].append(v)
            case Migrate(t, src, dst, _):
                if self.where.get(t) != src or self.segments[t][-1] not in self.serving(dst):
                    raise InvariantBroken(f"{cmd}: bad source or destination version")
                self.where[t] = dst
                self.migrations += 1
                self.elastic["drain_migrations"] += src in self.borrowed
            case Abort(t, i):
                if self.where.pop(t, None) != i:
                    raise InvariantBroken(f"{cmd}: trajectory not on that instance")
            case Drop(g, _):
                self.dropped.add(g)
            case Filter(g):
                g_size = self.p.cfg.group_size
                got = {self.rewards[t] for t in range(g * g_size, (g + 1) * g_size)}
                if len(got) != 1 or g in self.consumed:
                    raise InvariantBroken(f"{cmd}: rewards {got}, consumed {self.consumed[g]}")
                self.filtered.add(g)
            case Sleep(i):
                if i not in self.borrowed or any(j == i for j in self.where.values()):
                    raise InvariantBroken(f"{cmd}: not borrowed, or it still runs requests")
                if i in self.woken_now:
                    raise InvariantBroken(f"{cmd}: woken and put back to sleep by one decision")
                self.asleep.add(i)
                self.elastic["sleeps"] += 1
                self.version[i] = None
                self.extra[i], self.adding[i] = set(), set()
                self.loading.pop(i, None)  # a load in flight is cancelled
            case Offload(t, i):
                if self.where.get(t) != i or i not in self.borrowed:
                    raise InvariantBroken(f"{cmd}: trajectory not running on that borrowed instance")
                self.parked[t] = self.where.pop(t)
                self.elastic["offloads"] += 1
            case Restore(t, i):
                if t not in self.parked or self.segments[t][-1] not in self.serving(i):
                    raise InvariantBroken(f"{cmd}: not parked, or the instance holds another version")
                del self.parked[t]
                self.where[t] = i
                self.elastic["restores"] += 1
            case StartTrain(step, groups):
                awake = [i for i in self.borrowed if i not in self.asleep and i not in self.lost]
                if awake:
                    raise InvariantBroken(f"step {step} starts while borrowed instances {awake} serve")
                self._train(step, groups)
            case _:
                raise InvariantBroken(f"unexpected command {cmd}")
        live = {self.segments[t][-1] for t in self.where}
        self.max_live_versions = max(self.max_live_versions, len(live))
        if isinstance(cmd, Dispatch):
            here = {self.segments[t][-1] for t, j in self.where.items() if j == cmd.instance}
            self.mixed_instances = max(self.mixed_instances, len(here))

    def _train(self, step: int, groups: tuple[int, ...]) -> None:
        if self.train_step is not None:
            raise InvariantBroken("StartTrain while the trainer is busy")
        if step != self.steps_done or len(groups) != self.p.cfg.tbs:
            raise InvariantBroken(f"step {step} with {len(groups)} groups")
        g_size = self.p.cfg.group_size
        for g in groups:
            trajs = range(g * g_size, (g + 1) * g_size)
            if any(t not in self.finished for t in trajs):
                raise InvariantBroken(f"step {step} consumes incomplete group {g}")
            if g in self.dropped or g in self.filtered:
                raise InvariantBroken(f"step {step} consumes dropped or filtered group {g}")
            self.consumed[g] += 1
            if self.consumed[g] > 1:
                raise InvariantBroken(f"group {g} consumed twice")
            versions = {v for t in trajs for v in self.segments[t]}
            if self.p.name != "partial" and len(versions) != 1:
                raise InvariantBroken(f"group {g} mixes versions {versions}")
            stale = step - min(versions)
            self.staleness.append(stale)
            bound = self.p.cfg.k if self.p.name == "dora" else STALENESS_BOUND.get(self.p.name)
            if bound is not None and stale > bound:
                raise InvariantBroken(f"group {g} consumed at step {step} with staleness {stale} > {bound}")
        self.train_step = step

    # -- delivering completions --------------------------------------------------------------------
    def actions(self) -> list[tuple]:
        acts: list[tuple] = [("ready", i) for i in self.loading]
        acts += [("added", i, v) for i, vs in self.adding.items() for v in vs]
        acts += [("finish", t) for t, i in self.where.items() if self.version[i] is not None]
        if self.train_step is not None:
            acts.append(("train",))
        return acts

    def run(self, steps: int, max_events: int = 200_000) -> None:
        if not self.started:
            self.start()
        self.advance(steps, max_events)

    def start(self) -> None:
        self.started = True
        self.feed(Start())

    def advance(self, steps: int, max_events: int = 200_000) -> None:
        """Deliver random events until ``steps`` train steps are done (or ``max_events`` if fewer)."""
        for _ in range(max_events):
            if self.steps_done >= steps:
                return
            self.step_once()
        raise InvariantBroken(f"no progress: {self.steps_done} steps after {max_events} events")

    def step_once(self) -> None:
        acts = self.actions()
        if not acts:
            raise InvariantBroken(f"deadlock after {self.steps_done} steps: nothing can happen")
        r = self.rng.random()
        if r < 0.01 and self.to_lose:
            self.lose(self.rng.choice([i for i in range(len(self.version)) if i not in self.lost]))
            return
        if r < 0.02 and self.rejoin and self.lost:
            i = self.rng.choice(sorted(self.lost))
            self.lost.discard(i)
            self.joined.add(i)
            if i in self.borrowed:  # on the trainer's accelerators: it joins asleep
                self.asleep.add(i)
            self.feed(InstanceJoined(i))
            return
        if r < 0.03:
            self.feed(Tick())
        elif r < 0.04 and self.where:  # an instance reports its requests' progress (the work planner's input)
            i = self.rng.choice(sorted(set(self.where.values())))
            self.feed(Progress(i, tuple((t, self.rng.randrange(200)) for t, j in self.where.items() if j == i)))
        elif r < 0.05 and self.version.count(None) < len(self.version):
            i = self.rng.choice([i for i, v in enumerate(self.version) if v is not None])
            self.feed(KvPressure(i, self.rng.random()))
        act = self.rng.choice(acts)
        if act[0] == "ready":
            i = act[1]
            self.version[i] = self.loading.pop(i)
            self.extra[i] = {self.version[i]}
            self.feed(InstanceReady(i, self.version[i]))
        elif act[0] == "added":
            _, i, v = act
            self.adding[i].discard(v)
            self.extra[i].add(v)
            self.feed(InstanceReady(i, v))
        elif act[0] == "finish":
            t = act[1]
            i = self.where.pop(t)
            self.finished.add(t)
            self.rewards[t] = float(self.rng.random() < 0.5)  # groups of equal rewards are common
            self.feed(RequestFinished(t, i, self.rewards[t], tokens=self.rng.randrange(1, 200)))
        else:
            step, self.train_step = self.train_step, None
            self.steps_done += 1
            self.feed(VersionPublished(step + 1))

    def lose(self, i: int) -> None:
        """Fence instance i: what ran there is gone and must start again from its prompt elsewhere."""
        self.to_lose -= 1
        self.lost.add(i)
        self.version[i] = None
        self.extra[i], self.adding[i] = set(), set()
        self.loading.pop(i, None)
        for held in (self.where, self.parked):
            for t in [t for t, j in held.items() if j == i]:
                del held[t]
                self.segments[t] = []  # its tokens are discarded: it is generated again, whole
                self.regenerated.add(t)
        self.asleep.discard(i)
        self.feed(InstanceLost(i))
        for cmd_target in (self.where.values(), self.loading):
            if i in cmd_target:
                raise InvariantBroken(f"instance {i} was given work after it was lost")

    @classmethod
    def resumed(cls, policy: Policy, rng: random.Random, snapshot: dict, requeue: tuple[int, ...]) -> RandomDriver:
        """A driver for a restored policy: what the checkpoint's ledger says happened before it."""
        d = cls(policy, rng)
        g_size = policy.cfg.group_size
        for g, version, state, _finished, _step, _reason in snapshot["groups"]:
            if state == 2:  # consumed by a step before the checkpoint
                d.consumed[g] += 1
                d.group_tag[g] = version
            elif state == 3:
                d.dropped.add(g)
            elif state == 4:  # filtered (equal rewards): never trained on, before or after the restart
                d.filtered.add(g)
                d.group_tag[g] = version
        for g in requeue:
            d.group_tag[g] = policy.ledger.groups[g].version
            for t in range(g * g_size, (g + 1) * g_size):
                d.finished.add(t)
                d.segments[t] = [d.group_tag[g]]
        d.steps_done = policy.next_step
        return d

    def check_nothing_lost(self) -> None:
        """Every dispatched group is consumed, dropped, or still accounted pending/complete."""
        led = self.p.ledger
        for g in self.group_tag:
            state = led.groups[g].state.name
            if self.consumed[g]:
                ok = state == "CONSUMED"
            elif g in self.dropped:
                ok = state == "DROPPED"
            elif g in self.filtered:
                ok = state == "FILTERED"
            else:
                g_size = self.p.cfg.group_size
                trajs = range(g * g_size, (g + 1) * g_size)
                live_or_done = all(t in self.where or t in self.parked or t in self.finished or t in self.p.view.trajs
                                   for t in trajs)
                ok = state in ("PENDING", "COMPLETE") and live_or_done
            if not ok:
                raise InvariantBroken(f"group {g} lost: ledger says {state}")
