"""Ledger: exactly-once accounting of prompt groups and their trajectories.

Invariant (docs/invariants.md, invariant 3): every group taken from the data stream is, at any moment, in
exactly one state -- pending (dispatched, some samples unfinished), complete (all samples finished,
waiting for training), consumed (by exactly one train step), dropped (recorded with a reason) or
filtered (complete with equal rewards: never trained on, dynamic sampling).
Transitions only go forward (the one exception, ``reopen``, is resume's: an unconsumed group is
generated again); anything else raises LedgerError. Group ids are the data cursor: group
``g`` is the g-th prompt of the stream, so ``next_group`` is all a resume needs to continue the data.

``to_dict()``/``from_dict()`` round-trip the whole ledger so it can live in a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class LedgerError(RuntimeError):
    """A transition that would lose or double-count a group or trajectory."""


class GroupState(IntEnum):
    PENDING = 0
    COMPLETE = 1
    CONSUMED = 2
    DROPPED = 3
    FILTERED = 4  # complete, but its rewards carry no signal: never trained on (dynamic sampling)


@dataclass
class GroupRecord:
    version: int
    state: GroupState = GroupState.PENDING
    finished: int = 0
    consume_step: int = -1
    drop_reason: str = ""


@dataclass
class Ledger:
    group_size: int
    next_group: int = 0
    groups: dict[int, GroupRecord] = field(default_factory=dict)
    finished_trajs: set[int] = field(default_factory=set)

    def new_group(self, version: int) -> int:
        """Take the next prompt of the stream and tag it with ``version``; returns its group id."""
        gid = self.next_group
        self.next_group += 1
        self.groups[gid] = GroupRecord(version=version)
        return gid

    def traj_ids(self, group_id: int) -> range:
        return range(group_id * self.group_size, (group_id + 1) * self.group_size)

    def group_of(self, traj_id: int) -> int:
        return traj_id // self.group_size

    def finish(self, traj_id: int) -> bool:
        """Record a finished trajectory; returns True when it completes its group."""
        rec = self._get(self.group_of(traj_id))
        if rec.state is not GroupState.PENDING or traj_id in self.finished_trajs:
            raise LedgerError(f"trajectory {traj_id} finished twice or after its group was {rec.state.name}")
        self.finished_trajs.add(traj_id)
        rec.finished += 1
        if rec.finished == self.group_size:
            rec.state = GroupState.COMPLETE
            self.finished_trajs.difference_update(self.traj_ids(self.group_of(traj_id)))
            return True
        return False

    def consume(self, group_id: int, step: int) -> None:
        rec = self._get(group_id)
        if rec.state is not GroupState.COMPLETE:
            raise LedgerError(f"group {group_id} consumed while {rec.state.name}")
        rec.state, rec.consume_step = GroupState.CONSUMED, step

    def drop(self, group_id: int, reason: str) -> None:
        rec = self._get(group_id)
        if rec.state in (GroupState.CONSUMED, GroupState.DROPPED):
            raise LedgerError(f"group {group_id} dropped while {rec.state.name}")
        rec.state, rec.drop_reason = GroupState.DROPPED, reason
        self.finished_trajs.difference_update(self.traj_ids(group_id))

    def filter(self, group_id: int) -> None:
        rec = self._get(group_id)
        if rec.state is not GroupState.COMPLETE:
            raise LedgerError(f"group {group_id} filtered while {rec.state.name}")
        rec.state = GroupState.FILTERED

    def retag(self, group_id: int, version: int) -> None:
        """Change a pending group's tag (only before any of its tokens exist, e.g. on resume)."""
        rec = self._get(group_id)
        if rec.state is not GroupState.PENDING:
            raise LedgerError(f"group {group_id} retagged while {rec.state.name}")
        rec.version = version

    def reopen(self, group_id: int, version: int) -> None:
        """Resume only: an unconsumed group goes back to pending with no finished samples under a new
        tag -- its earlier tokens were discarded by the preemption (core/resume.py)."""
        rec = self._get(group_id)
        if rec.state not in (GroupState.PENDING, GroupState.COMPLETE):
            raise LedgerError(f"group {group_id} reopened while {rec.state.name}")
        rec.state, rec.finished, rec.version = GroupState.PENDING, 0, version
        self.finished_trajs.difference_update(self.traj_ids(group_id))

    def _get(self, group_id: int) -> GroupRecord:
        try:
            return self.groups[group_id]
        except KeyError:
            raise LedgerError(f"group {group_id} was never dispatched") from None

    # -- queries -----------------------------------------------------------------------------------
    def count(self, state: GroupState) -> int:
        return sum(1 for r in self.groups.values() if r.state is state)

    def open_groups(self) -> set[int]:
        """Groups admitted and not yet ended: pending or complete, neither consumed, dropped nor filtered."""
        return {g for g, r in self.groups.items() if r.state in (GroupState.PENDING, GroupState.COMPLETE)}

    def totals(self) -> dict[str, int]:
        return {"dispatched": len(self.groups), **{s.name.lower(): self.count(s) for s in GroupState}}

    # -- checkpoint --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "group_size": self.group_size,
            "next_group": self.next_group,
            "groups": [[g, r.version, int(r.state), r.finished, r.consume_step, r.drop_reason]
                       for g, r in self.groups.items()],
            "finished_trajs": sorted(self.finished_trajs),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Ledger:
        led = cls(group_size=d["group_size"], next_group=d["next_group"])
        for g, version, state, finished, step, reason in d["groups"]:
            led.groups[g] = GroupRecord(version, GroupState(state), finished, step, reason)
        led.finished_trajs = set(d["finished_trajs"])
        return led
