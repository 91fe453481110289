"""Resume: from a checkpointed ledger and what the HDF5 shards hold, decide what to continue with.

Invariants (docs/invariants.md, invariant 3, across preemption):
* consumed and dropped groups keep their state: nothing is consumed twice, no drop is forgotten;
* a group complete at the checkpoint whose G trajectories are all in the shards under its tag is
  re-queued as complete: its data is trained on as it is, never regenerated;
* every other unconsumed group (in flight at the checkpoint, or complete but its rows were lost) is
  re-dispatched whole under the resumed version; its earlier tokens are discarded-by-preemption,
  never trained on;
* version numbering continues: the resumed latest version and next train step are the checkpoint's.

The checkpoint protocol (runtime/orchestrator.py) guarantees that the ledger's consumed groups are
exactly those of the steps before ``version``; a ledger that says otherwise is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .ledger import GroupState, Ledger


class ResumeError(RuntimeError):
    """The checkpoint and the logs cannot be continued from consistently (the message says why)."""


@dataclass(frozen=True)
class ResumePlan:
    version: int                    # the checkpoint's weights: latest version and next train step
    requeue: tuple[int, ...]        # complete groups re-read from the shards, in group order
    redispatch: tuple[int, ...]     # groups generated again, whole, under ``version``


def plan_resume(ledger: Ledger, version: int, stored: Mapping[int, int]) -> ResumePlan:
    """``stored[g]``: how many of group g's trajectories the shards hold under g's tag."""
    late = [g for g, r in ledger.groups.items() if r.state is GroupState.CONSUMED and r.consume_step >= version]
    if late:
        raise ResumeError(f"checkpoint of v{version} has groups consumed by later steps: {sorted(late)[:10]}")
    requeue, redispatch = [], []
    for g, rec in sorted(ledger.groups.items()):
        if rec.state is GroupState.COMPLETE and stored.get(g, 0) == ledger.group_size:
            requeue.append(g)
        elif rec.state in (GroupState.PENDING, GroupState.COMPLETE):
            redispatch.append(g)
    return ResumePlan(version, tuple(requeue), tuple(redispatch))
