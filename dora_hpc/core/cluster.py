"""ClusterView: the policy's picture of rollout instances, live trajectories and per-version queues.

Invariants kept here (checked on every change, so a policy bug fails loudly in tests):
* an instance hosts at most one version; a trajectory is placed only on an instance whose ready
  version equals the trajectory's version (single version per trajectory). With ``shared`` (versions share
  instances: a version is an adapter) an instance hosts every version it loaded and was not told to retire
  (``resident``), and a trajectory is placed only on one that hosts its version; its free slots count for
  each of them;
* an instance never holds more live trajectories than it has slots;
* every live trajectory is in exactly one place: its version's queue or one instance's active set;
* a lost (fenced) instance hosts nothing and is given no work until a replacement joins in its place;
* a borrowed instance (on the trainer's accelerators) is asleep while the trainer trains: it hosts no
  version and runs nothing. A trajectory it offloaded to host memory waits at the front of its version's
  queue (``TrajView.parked``) and is placed like any other, by a Restore instead of a Dispatch: its KV
  comes back onto whichever instance of its version has room first, nothing re-prefilled.

A trajectory admitted but not yet placed waits in ``queues[version]``; ``place`` turns waiting
trajectories into Dispatch commands on the least-loaded ready instance of that version -- or, with
``group_together`` (the engines share a prompt's KV: engine.prefix_caching), on the dedicated instance that
runs a sample of its group while that one has a free slot, so the group's prompt is prefilled once there.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from .events import Abort, AssignVersion, Dispatch, Migrate, Offload, Restore, Retire, Sleep


@dataclass
class InstanceView:
    slots: int
    version: int | None = None
    loading: int | None = None
    active: set[int] = field(default_factory=set)
    lost: bool = False  # fenced by the driver: hosts nothing until a replacement joins
    borrowed: bool = False  # on the trainer's accelerators: asleep while it trains
    asleep: bool = False
    resident: set[int] = field(default_factory=set)  # shared: every version hosted (``version``: the newest)
    adding: set[int] = field(default_factory=set)    # shared: versions loading beside those hosted

    def serves(self, version: int) -> bool:
        """A trajectory of ``version`` may run here now."""
        return self.ready and (version == self.version or version in self.resident)

    @property
    def ready(self) -> bool:
        return self.loading is None and self.version is not None and not self.lost

    @property
    def target(self) -> int | None:
        """The version this instance holds or is loading."""
        return self.loading if self.loading is not None else self.version

    @property
    def free(self) -> int:
        return self.slots - len(self.active) if self.ready else 0


@dataclass
class TrajView:
    group_id: int
    sample_idx: int
    version: int
    instance: int | None = None
    parked: int | None = None  # its KV waits in the host memory of this (borrowed) instance's node
    started: bool = False      # it was dispatched once (a lost instance's trajectory restarts under its tag)


class ClusterView:
    def __init__(self, n_instances: int, slots: int, group_size: int, borrowed: int = 0,
                 group_together: bool = False, shared: bool = False) -> None:
        if n_instances < 1 or slots < 1 or borrowed < 0:
            raise ValueError("a cluster needs at least one instance with at least one slot")
        self.group_size, self.group_together, self.shared = group_size, group_together, shared
        self.instances = [InstanceView(slots) for _ in range(n_instances)]
        self.instances += [InstanceView(slots, borrowed=True) for _ in range(borrowed)]
        n_instances += borrowed
        self.trajs: dict[int, TrajView] = {}
        self.queues: dict[int, deque[int]] = {}
        self._has_free: dict[int, set[int]] = {}  # version -> ready instances with a free slot
        self._free: dict[int, int] = {}            # version -> free slots on its ready instances
        self._contrib: list[tuple[tuple[int, ...], int]] = [((), 0)] * n_instances  # (versions, free)
        self._by_load: dict[int, list[tuple[int, int]]] = {}  # version -> lazy heap of (_load_key, instance)
        self._live = set(range(n_instances))  # not lost, not asleep (kept by _refresh)

    # -- queries -----------------------------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        """Instances that can take work now or once loaded: not lost, not asleep."""
        return sorted(self._live)

    @property
    def n_live(self) -> int:
        return len(self._live)

    @property
    def borrowed(self) -> list[int]:
        """Borrowed instances not lost, asleep or awake."""
        return [i for i, inst in enumerate(self.instances) if inst.borrowed and not inst.lost]

    def hosts(self, version: int, ready_only: bool = False) -> list[int]:
        return [i for i, inst in enumerate(self.instances)
                if inst.serves(version) or (not ready_only and (inst.target == version or version in inst.adding))]

    def active_count(self, version: int) -> int:
        return sum(len(inst.active) for inst in self.instances if inst.target == version)

    def queued_count(self, version: int) -> int:
        q = self.queues.get(version)
        return len(q) if q else 0

    def free_slots(self, version: int) -> int:
        return self._free.get(version, 0)

    def idle_slots(self, version: int) -> int:
        """Free slots where ``version`` could run that no queued trajectory will take: with shared instances
        every queue competes for the same slots."""
        if not self.shared:
            return self.free_slots(version) - self.queued_count(version)
        free = sum(inst.free for inst in self.instances if inst.serves(version))
        return free - sum(len(q) for q in self.queues.values())

    # -- admission and placement -------------------------------------------------------------------
    def enqueue_group(self, group_id: int, version: int) -> None:
        q = self.queues.setdefault(version, deque())
        for s in range(self.group_size):
            tid = group_id * self.group_size + s
            self.trajs[tid] = TrajView(group_id, s, version)
            q.append(tid)

    def place(self, version: int) -> list[Dispatch]:
        """Dispatch queued trajectories of ``version`` onto its ready instances, least loaded first and
        dedicated before borrowed (a borrowed instance's requests must leave it before each train step);
        with ``group_together``, onto a dedicated instance running a sample of the same group first."""
        q, free, heap = self.queues.get(version), self._has_free.get(version), self._by_load.get(version)
        out: list[Dispatch] = []
        while q and free:
            i = self.with_its_group(q[0], free) if self.group_together else None
            if i is None:
                key, i = heapq.heappop(heap)
                if i not in free or self._load_key(i) != key:
                    continue  # stale entry
            tid = q.popleft()
            t = self.trajs[tid]
            self._put(tid, i)
            if t.parked is not None:
                out.append(Restore(tid, i, t.parked))
                t.parked = None
            else:
                out.append(Dispatch(tid, t.group_id, t.sample_idx, version, i))
        return out

    # -- changes -----------------------------------------------------------------------------------
    def remove(self, traj_id: int) -> TrajView:
        """Forget a trajectory (finished or aborted), wherever it is."""
        t = self.trajs.pop(traj_id)
        if t.instance is None:
            self.queues[t.version].remove(traj_id)
        else:
            inst = self.instances[t.instance]
            inst.active.discard(traj_id)
            self._refresh(t.instance)
        return t

    def assign(self, cmd: AssignVersion) -> None:
        """Load ``cmd.version`` on an instance; an asleep one wakes. With ``cmd.add`` (shared) the version
        loads beside those hosted, which keep running."""
        inst = self.instances[cmd.instance]
        if cmd.add:
            if not self.shared or not inst.ready or cmd.version in inst.resident | inst.adding:
                raise AssertionError(f"instance {cmd.instance} told to add v{cmd.version} (shared: {self.shared}, "
                                     f"hosts {sorted(inst.resident)}, adding {sorted(inst.adding)})")
            inst.adding.add(cmd.version)
            return
        if inst.active and not cmd.keep_requests:
            raise AssertionError(f"instance {cmd.instance} reassigned with {len(inst.active)} live requests")
        inst.asleep = False
        inst.loading = cmd.version
        if cmd.keep_requests:
            for tid in inst.active:
                self.trajs[tid].version = cmd.version
        self._refresh(cmd.instance)

    def ready(self, instance: int, version: int) -> None:
        inst = self.instances[instance]
        if version in inst.adding:
            inst.adding.discard(version)
            inst.resident.add(version)
            inst.version = max(inst.resident)
        elif inst.loading != version:
            raise AssertionError(f"instance {instance} ready with v{version}, was loading v{inst.loading}")
        else:
            inst.version, inst.loading = version, None
            inst.resident = {version} if self.shared else set()
        self._refresh(instance)

    def retire(self, instance: int, version: int) -> Retire:
        """Shared: ``instance`` stops hosting ``version``, which no trajectory there has."""
        inst = self.instances[instance]
        if version not in inst.resident or version == inst.version or any(
                self.trajs[t].version == version for t in inst.active):
            raise AssertionError(f"instance {instance} told to retire v{version} (hosts {sorted(inst.resident)})")
        inst.resident.discard(version)
        self._refresh(instance)
        return Retire(instance, version)

    def migrate(self, cmd: Migrate) -> None:
        t = self.trajs[cmd.traj_id]
        dst = self.instances[cmd.dst]
        if t.instance != cmd.src or not dst.serves(t.version) or dst.free < 1:
            raise AssertionError(f"bad migration {cmd} of a v{t.version} trajectory")
        self.instances[cmd.src].active.discard(cmd.traj_id)
        self._refresh(cmd.src)
        self._put(cmd.traj_id, cmd.dst)

    def lose(self, instance: int, in_transit: tuple[int, ...] = ()) -> list[Abort]:
        """Fence ``instance``: its trajectories and ``in_transit`` (migrating away from it) go back to the
        front of their version's queue, to start again from their prompts; a trajectory in transit that
        may have reached its destination is aborted there (it starts again too)."""
        inst = self.instances[instance]
        out: list[Abort] = []
        again = sorted(inst.active)
        for t in self.trajs.values():
            if t.parked == instance:  # its KV was in that node's host memory: it starts again from its prompt
                t.parked = None
        for tid in in_transit:
            t = self.trajs.get(tid)
            if t is not None and t.instance is not None and t.instance != instance:
                out.append(Abort(tid, t.instance))
                self.instances[t.instance].active.discard(tid)
                self._refresh(t.instance)
                again.append(tid)
        for tid in reversed(again):
            t = self.trajs[tid]
            t.instance = None
            self.queues.setdefault(t.version, deque()).appendleft(tid)
        inst.active.clear()
        inst.lost, inst.asleep, inst.version, inst.loading = True, False, None, None
        inst.resident, inst.adding = set(), set()
        self._refresh(instance)
        return out

    def rejoin(self, instance: int) -> None:
        """Lost ``instance``'s replacement joins: empty, with no weights (a borrowed one asleep)."""
        inst = self.instances[instance]
        if not inst.lost:
            raise ValueError(f"instance {instance} joined but was never lost")
        inst.lost, inst.asleep = False, inst.borrowed
        self._refresh(instance)

    def offload(self, traj_id: int) -> Offload:
        """Park a running trajectory of a borrowed instance in host memory, at the front of its queue."""
        t = self.trajs[traj_id]
        i = t.instance
        if i is None or not self.instances[i].borrowed or traj_id not in self.instances[i].active:
            raise AssertionError(f"trajectory {traj_id} offloaded from instance {i}")
        self.instances[i].active.discard(traj_id)
        self._refresh(i)
        t.instance, t.parked = None, i
        self.queues.setdefault(t.version, deque()).appendleft(traj_id)
        return Offload(traj_id, i)

    def sleep(self, instance: int) -> Sleep:
        inst = self.instances[instance]
        if not inst.borrowed or inst.active or inst.lost:
            raise AssertionError(f"instance {instance} put to sleep (borrowed: {inst.borrowed}, "
                                 f"{len(inst.active)} live requests)")
        inst.asleep, inst.version, inst.loading = True, None, None
        inst.resident, inst.adding = set(), set()
        self._refresh(instance)
        return Sleep(instance)

    def retag_queued(self, version: int) -> list[int]:
        """Move every queued (not yet started) trajectory to ``version``; returns their ids."""
        moved: list[int] = []
        for v in [v for v in self.queues if v != version]:
            q = self.queues.pop(v)
            for tid in q:
                self.trajs[tid].version = version
            moved.extend(q)
        self.queues.setdefault(version, deque()).extend(moved)
        return moved

    def retag_unstarted(self, version: int) -> list[tuple[int, int]]:
        """Move every group queued whole under an older version (none of its samples ever started) to
        ``version``'s queue, behind what waits there; returns (group_id, old version) for each."""
        moved: list[tuple[int, int]] = []
        for v in [v for v in self.queues if v < version]:
            q, seen = self.queues[v], {}
            for tid in q:
                t = self.trajs[tid]
                if not t.started:
                    seen[t.group_id] = seen.get(t.group_id, 0) + 1
            whole = {gid for gid, n in seen.items() if n == self.group_size}
            if not whole:
                continue
            keep, move = deque(), []
            for tid in q:
                (move if self.trajs[tid].group_id in whole else keep).append(tid)
            self.queues[v] = keep
            if not keep:
                del self.queues[v]
            for tid in move:
                self.trajs[tid].version = version
            self.queues.setdefault(version, deque()).extend(move)
            moved += [(gid, v) for gid in sorted(whole)]
        return moved

    def _put(self, traj_id: int, instance: int) -> None:
        inst, t = self.instances[instance], self.trajs[traj_id]
        if not inst.serves(t.version) or inst.free < 1:
            raise AssertionError(f"trajectory {traj_id} (v{t.version}) cannot run on instance {instance}")
        inst.active.add(traj_id)
        t.instance, t.started = instance, True
        self._refresh(instance)

    def _refresh(self, i: int) -> None:
        """Re-index instance i after any change: free-slot sets, counters and the load heap."""
        old_vs, old_free = self._contrib[i]
        for v in old_vs:
            self._free[v] -= old_free
            self._has_free.get(v, set()).discard(i)
        inst = self.instances[i]
        if inst.lost or inst.asleep:
            self._live.discard(i)
        else:
            self._live.add(i)
        vs = (tuple(sorted(inst.resident | {inst.version})) if self.shared else (inst.version,)) if inst.ready else ()
        free = inst.free if inst.ready else 0
        self._contrib[i] = (vs, free)
        for v in vs:
            self._free[v] = self._free.get(v, 0) + free
            if free > 0:
                self._has_free.setdefault(v, set()).add(i)
                heap = self._by_load.setdefault(v, [])
                if len(heap) > 4 * len(self.instances) + 64:  # drop stale entries now and then
                    heap[:] = [(self._load_key(j), j) for j in self._has_free[v]]
                    heapq.heapify(heap)
                else:
                    heapq.heappush(heap, (self._load_key(i), i))

    def with_its_group(self, traj_id: int, free) -> int | None:
        """A dedicated instance among ``free`` (those with room) that runs a sample of ``traj_id``'s group."""
        first = self.trajs[traj_id].group_id * self.group_size
        for j in range(first, first + self.group_size):
            t = self.trajs.get(j)
            if t is not None and t.instance in free and not self.instances[t.instance].borrowed:
                return t.instance
        return None

    def _load_key(self, i: int) -> int:
        inst = self.instances[i]
        return len(inst.active) + (inst.slots if inst.borrowed else 0)
