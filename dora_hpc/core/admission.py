"""Lean admission (``dora.admission: lean``): keep the pipeline as shallow as the slots and the trainer allow.

The window (core/window.py) bounds staleness by K; what sets the *mean* is the pipeline's depth: the groups
whose update is not yet published -- the batch in training, plus the groups admitted and not consumed
(pending or complete). A group admitted behind ``d`` such groups is consumed about ``d // TBS`` steps after
the latest version, so that is its staleness. Eager admission fills the window, so nearly every group is
trained at K. Lean admission caps the depth and learns the cap from the run's own events:

* the trainer becomes free (a VersionPublished) and must wait for complete groups while the cap withheld
  admissions since the last train step: the cap grows by the groups it is short, but never by more than
  the cap held back at once (``withheld``): a slot free somewhere is not a batch's shortfall, and growing
  by the whole shortfall for one withheld group ratcheted the cap up until it stopped binding;
* the trainer becomes free and can take its batch with groups to spare: the cap shrinks by an eighth of
  the surplus, at least one group (those groups would only have waited, growing staler).

The gains are asymmetric on purpose: a shortfall idles the whole trainer until the batch's stragglers
finish, a surplus group costs that one group a step of staleness (results/sim/staleness/README.md).

The cap stays within [TBS, TBS * (K + 1)]: at TBS nothing is admitted while the trainer trains (sync); the
window holds at most K + 1 steps of groups (the batch in training and K more), so a cap above that never
binds. A fixed cap (``dora.depth``, in units of TBS) turns the learning off: the frontier
(results/sim/staleness/) sweeps it. The cap in force at each train step is logged (the ``admission_cap`` op;
``analyze``'s ``admission_cap``).

Invariants: pure (event counts only, no clock); the cap only ever withholds admissions the window allows,
so staleness <= K holds by the window's construction; a learned cap is part of the policy's snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMISSIONS = ("eager", "lean")
SHRINK = 8  # a surplus shrinks the cap by 1/SHRINK of itself (at least 1) a publish; a shortfall grows it by
#            up to all of itself


@dataclass
class LeanDepth:
    tbs: int
    k: int
    fixed: float | None = None    # dora.depth: the cap is round(fixed * TBS), not learned
    depth: int = 0                # the cap, in groups (0: start at two batches: one in training, one in the making)
    withheld: int = 0             # the most groups the cap held back at once since the trainer was last free

    def __post_init__(self) -> None:
        if self.fixed is not None:
            self.depth = self._clamp(round(self.fixed * self.tbs))
        else:  # a restored cap too: a checkpoint of another K or TBS may hold one out of range
            self.depth = self._clamp(self.depth or 2 * self.tbs)

    @property
    def capped(self) -> bool:
        """The cap withheld an admission since the trainer was last free."""
        return self.withheld > 0

    @property
    def ceiling(self) -> int:
        return self.tbs * (self.k + 1)

    def _clamp(self, depth: int) -> int:
        return max(self.tbs, min(self.ceiling, depth))

    def room(self, in_pipeline: int, wanted: int) -> int:
        """How many of ``wanted`` groups may be admitted with ``in_pipeline`` groups not yet in published
        weights; records whether the cap withheld any."""
        room = max(0, min(wanted, self.depth - in_pipeline))
        self.withheld = max(self.withheld, wanted - room)
        return room

    def on_trainer_free(self, complete: int, can_train: bool) -> None:
        """The trainer finished a step with ``complete`` groups ready (``can_train``: the window lets the
        next step start now)."""
        if self.fixed is None:
            if can_train and complete > self.tbs:
                self.depth = self._clamp(self.depth - -(-(complete - self.tbs) // SHRINK))
            elif complete < self.tbs:
                self.depth = self._clamp(self.depth + min(self.tbs - complete, self.withheld))
        self.withheld = 0
