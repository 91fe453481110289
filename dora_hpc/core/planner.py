"""Rebalancing planner: instances per version in proportion to pending work, and the moves to get there.

Pending work (``by_work``, ``dora.planner: work``): a version's weight is the decode tokens its requests have
left (core/work.py: from their progress and the lengths seen so far; a queued request counts the mean
length), not their number; the bounds stay in requests and slots.

Invariants:
* ``target_counts`` gives every version with live requests at least one instance and never fewer
  than its active requests need (``ceil(active / slots)``), so consolidation always fits; it never
  gives a legacy version more instances than its requests could fill; leftovers go to the latest.
  Proportional (the paper's §3.3): the rest is shared in proportion to pending work. Oldest first (the
  straggler-aware planner): versions are served oldest first up to what their requests can fill, since
  a train step consumes the oldest complete groups and the window waits for the oldest version; the
  latest keeps its lower bound and takes what is left.
* ``plan`` is minimal: an instance is reassigned only when its version has a surplus *and* another
  version is starved (queued requests beyond its free slots). Requests on a released instance
  migrate to kept instances of the same version (best fit: the fullest peer with room, so legacy
  requests consolidate; with ``group_together``, where their group runs or fits whole, so no prompt
  is held twice), with their KV unless told otherwise, never to another version. An
  instance still loading weights is never released (its InstanceReady is outstanding). Weights
  come peer-to-peer from a ready instance of the version when one exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import ClusterView
from .events import TRAINER, AssignVersion, Command, Migrate
from .work import WorkEstimate


@dataclass(frozen=True)
class VersionLoad:
    active: int
    queued: int
    work: float | None = None  # decode tokens left (by_work); None: weigh by requests

    @property
    def total(self) -> int:
        return self.active + self.queued

    @property
    def weight(self) -> float:
        return self.total if self.work is None else self.work


def version_loads(view: ClusterView, latest: int, work: WorkEstimate | None = None) -> dict[int, VersionLoad]:
    versions = {inst.target for inst in view.instances if inst.target is not None}
    versions |= {v for v, q in view.queues.items() if q} | {latest}
    out = {v: VersionLoad(view.active_count(v), view.queued_count(v)) for v in versions}
    if work is None:
        return out
    left = dict.fromkeys(versions, 0.0)
    for tid, t in view.trajs.items():
        left[t.version] += work.remaining(tid) if t.instance is not None else work.expected()
    return {v: VersionLoad(ld.active, ld.queued, left[v]) for v, ld in out.items()}


def target_counts(n: int, slots: int, loads: dict[int, VersionLoad], latest: int,
                  oldest_first: bool = False) -> dict[int, int]:
    """Instances per version within [lower, upper]: proportional to load (D'Hondt apportionment), or
    (``oldest_first``) filled oldest version first."""
    lower = {v: math.ceil(ld.active / slots) or (1 if ld.queued else 0) for v, ld in loads.items()}
    upper = {v: n if v == latest else math.ceil(ld.total / slots) for v, ld in loads.items()}
    # Too many versions for too few instances: queued-only versions wait, newest first.
    for v in sorted(loads, reverse=True):
        if sum(lower.values()) <= n:
            break
        if loads[v].active == 0:
            lower[v] = 0
    target = dict(lower)
    if oldest_first:
        for v in sorted(loads):
            target[v] += max(0, min(upper[v] - target[v], n - sum(target.values())))
    for _ in range(n - sum(target.values())):
        open_ = [v for v in target if target[v] < upper[v]] or [latest]
        best = max(open_, key=lambda v: (loads[v].weight / (target[v] + 1), v == latest, v))
        target[best] += 1
    return target


def plan(view: ClusterView, latest: int, carry_kv: bool = True, oldest_first: bool = False,
         work: WorkEstimate | None = None) -> list[Command]:
    """The AssignVersion + Migrate commands that move today's partition toward ``target_counts``; freed
    instances go to starved versions latest first, or (``oldest_first``) oldest first; ``work``: weigh
    versions by their decode tokens left instead of their requests."""
    loads = version_loads(view, latest, work)
    target = target_counts(view.n_live, view.instances[0].slots, loads, latest, oldest_first)
    current = {v: len(view.hosts(v)) for v in target}
    starved = {v: target[v] - current[v] for v in target
               if target[v] > current[v] and loads[v].queued > view.free_slots(v)}
    if not starved:
        return []
    need = sum(starved.values())
    donors: list[int] = []
    out: list[Command] = []
    for v in sorted(target):  # oldest versions give instances back first
        surplus = min(current[v] - target[v], need - len(donors))
        if surplus <= 0:
            continue
        mine = view.hosts(v, ready_only=True)
        free = {j: view.instances[j].free for j in mine}
        room, moving, released = sum(free.values()), 0, []
        for i in sorted(mine, key=lambda j: (len(view.instances[j].active), -j)):
            if len(released) == surplus:
                break
            n = len(view.instances[i].active)
            if moving + n <= room - free[i]:  # its requests still fit on the instances kept
                released.append(i)
                room -= free[i]
                moving += n
        rooms = {j: free[j] for j in mine if j not in set(released) and free[j] > 0}
        for i in released:
            for tid in sorted(view.instances[i].active):
                j = _destination(view, tid, i, rooms)
                m = Migrate(tid, i, j, carry_kv)
                view.migrate(m)
                out.append(m)
                rooms[j] -= 1
                if not rooms[j]:
                    del rooms[j]
        donors += released
    for v in sorted(starved, reverse=not oldest_first):
        for _ in range(starved[v]):
            if not donors:
                break
            i = donors.pop(0)
            peers = view.hosts(v, ready_only=True)
            cmd = AssignVersion(i, v, peers[0] if peers else TRAINER)
            view.assign(cmd)
            out.append(cmd)
    return out


def _destination(view: ClusterView, tid: int, src: int, rooms: dict[int, int]) -> int:
    """Where a request of a released instance goes: best fit (the fullest kept peer with room). When the engines
    share a group's prompt (``group_together``), first a peer running a sample of its group (its prompt is held
    there already), then the fullest peer with room for every sample of its group still on ``src`` (a split
    group holds its prompt twice)."""
    if view.group_together:
        j = view.with_its_group(tid, rooms)
        if j is not None:
            return j
        g = view.trajs[tid].group_id
        moving = sum(1 for t in view.instances[src].active if view.trajs[t].group_id == g)
        whole = [x for x in rooms if rooms[x] >= moving and not view.instances[x].borrowed]
        if whole:
            return min(whole, key=lambda x: (rooms[x], x))
    return min(rooms, key=lambda x: (rooms[x], x))
