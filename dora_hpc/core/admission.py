"""Lean admission (``dora.admission: lean``): hold the fewest groups that keep the slots and the trainer busy.

The window (core/window.py) bounds staleness by K; what sets the *mean* is how many groups are held
untrained -- admitted and not yet consumed, pending or complete. By Little's law mean staleness is about
that number over TBS, so eager admission, which fills the window, trains nearly every group at K. Lean
admission caps the groups held at ``hold`` and learns ``hold`` from the run's own events:

* the trainer becomes free (a VersionPublished) and cannot start for want of complete groups, while the
  cap held an admission back since the last train step: ``hold`` grows by the groups it is short (the
  next step needs them and the tail held too few);
* the trainer becomes free and could take its batch with groups to spare: ``hold`` shrinks by half the
  surplus (those groups would only have waited, growing staler).

``hold`` stays within [TBS, TBS * (K + 1)] (below TBS no step could start; above it the window binds).
A fixed ``hold`` (``dora.hold``, in units of TBS) turns the learning off: the frontier sweeps it.

Invariants: pure (event counts only, no clock); the cap only ever withholds admissions, so staleness
<= K still holds by the window's construction; a learned ``hold`` is part of the policy's snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMISSIONS = ("eager", "lean")


@dataclass
class LeanHold:
    tbs: int
    k: int
    fixed: float | None = None    # dora.hold: groups held = round(fixed * TBS), not learned
    hold: int = 0                 # groups that may be held untrained (pending + complete); 0: the start value
    capped: bool = False          # the cap withheld an admission since the last train step

    def __post_init__(self) -> None:
        if self.fixed is not None:
            self.hold = self._clamp(round(self.fixed * self.tbs))
        elif not self.hold:
            self.hold = self._clamp(2 * self.tbs)  # a batch in training and the next one in the making

    @property
    def ceiling(self) -> int:
        return self.tbs * (self.k + 2)  # the window's K + 1 steps of unconsumed groups and the batch in training

    def _clamp(self, hold: int) -> int:
        return max(self.tbs, min(self.ceiling, hold))

    def room(self, held: int, wanted: int) -> int:
        """How many of ``wanted`` groups may be admitted with ``held`` untrained now; records whether the
        cap withheld any."""
        room = max(0, min(wanted, self.hold - held))
        if room < wanted:
            self.capped = True
        return room

    def on_trainer_free(self, complete: int, can_train: bool) -> None:
        """The trainer finished a step with ``complete`` groups ready (``can_train``: the window lets the
        next step start now)."""
        if self.fixed is None:
            if can_train:
                self.hold = self._clamp(self.hold - (complete - self.tbs + 1) // 2)
            elif complete < self.tbs and self.capped:
                self.hold = self._clamp(self.hold + self.tbs - complete)
        self.capped = False

    def to_dict(self) -> dict:
        return {"hold": self.hold}
