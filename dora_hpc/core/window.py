"""VersionWindow: which policy versions may receive prompts, and when training may proceed.

Staleness (docs/invariants.md, invariant 2): a group sampled under v_j and consumed by train step n (the step
that turns v_n into v_{n+1}) has staleness n - j. The window keeps n - j <= K for every consumed group
*by construction*, through two rules:

* Train gate: step n (taking the TBS oldest complete groups) may start only if what it leaves behind
  still fits the admission bound below for step n + 1; in particular every unconsumed group of a
  version <= n - K is complete and in this batch (after step n it would be over-stale).
* Admission: a new group under version j is admitted only if, for every j' >= j, the groups tagged
  <= j' still fit into the steps that may consume them: count(<= j') <= TBS * (j' + K - n + 1), where
  n is the next step to start. Hence the train gate never has more than TBS must-consume groups.

The live versions are those with unconsumed groups, plus the latest. The oldest live version leaves
the window only when all of its groups have been consumed (or dropped): the window never skips one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field


class StalenessViolation(AssertionError):
    """A consume would break staleness <= K: a bug in a policy, never a user error."""


@dataclass
class VersionWindow:
    k: int
    tbs: int
    latest: int = 0
    next_step: int = 0
    unconsumed: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k < 0 or self.tbs < 1:
            raise ValueError(f"VersionWindow needs k >= 0 and tbs >= 1, got k={self.k}, tbs={self.tbs}")

    # -- versions ----------------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        if version != self.latest + 1:
            raise ValueError(f"version {version} published after v{self.latest}: versions go up by one")
        self.latest = version

    @property
    def oldest(self) -> int:
        live = [v for v, c in self.unconsumed.items() if c > 0]
        return min(live) if live else self.latest

    @property
    def live_versions(self) -> list[int]:
        return sorted({v for v, c in self.unconsumed.items() if c > 0} | {self.latest})

    # -- admission ---------------------------------------------------------------------------------
    def room(self, version: int, slack: int = 0) -> int:
        """How many more groups may be tagged ``version`` now (0 when it is out of the window).

        ``slack`` asks for that many spare steps beyond the next one (legacy top-up uses 1, so a
        group admitted under an old version cannot stall the very next train step).
        """
        n = self.next_step
        if version > self.latest or version + self.k < n + slack:
            return 0
        return max(0, min(self._headroom(self.unconsumed, n, range(version, self.latest + 1))))

    def fits(self) -> bool:
        """Does every unconsumed group still fit the admission bound (a restored window must)?"""
        versions = sorted(self.unconsumed)
        return (not versions or versions[-1] <= self.latest) and all(
            h >= 0 for h in self._headroom(self.unconsumed, self.next_step, versions))

    def admit(self, version: int) -> None:
        if self.room(version) < 1:
            raise StalenessViolation(f"v{version} admitted with no room (next step {self.next_step})")
        self.unconsumed[version] = self.unconsumed.get(version, 0) + 1

    def drop(self, version: int) -> None:
        self._release(version)

    # -- training ----------------------------------------------------------------------------------
    def must_consume(self) -> int:
        """Versions <= this must be fully consumed by the next step (or staleness would exceed K)."""
        return self.next_step - self.k

    def can_train(self, completed: Mapping[int, int]) -> bool:
        """May step ``next_step`` start, given the number of complete unconsumed groups per version?

        The batch is the TBS oldest complete groups. The step may start only if what it leaves behind
        still fits the admission bound for the following steps -- in particular every group of a
        version <= next_step - K is in this batch. Otherwise the trainer waits for older groups.
        """
        if sum(completed.values()) < self.tbs:
            return False
        take, left = {}, self.tbs
        for v in sorted(completed):
            take[v] = min(completed[v], left)
            left -= take[v]
        left = {v: c - take.get(v, 0) for v, c in self.unconsumed.items()}
        return all(h >= 0 for h in self._headroom(left, self.next_step + 1, sorted(left)))

    def consume(self, versions: list[int]) -> int:
        """Record that step ``next_step`` consumes groups of these versions; returns the step."""
        step = self.next_step
        for v in versions:
            if step - v > self.k or v > self.latest:
                raise StalenessViolation(f"step {step} would consume a group of v{v} with K={self.k}")
            self._release(v)
        cutoff = self.must_consume()
        left = {v: c for v, c in self.unconsumed.items() if v <= cutoff and c > 0}
        if left:
            raise StalenessViolation(f"step {step} leaves groups of versions {left} unconsumed")
        self.next_step += 1
        return step

    def _headroom(self, counts: Mapping[int, int], step: int, versions: Iterable[int]) -> Iterator[int]:
        """The admission bound, the one rule behind ``room``, ``fits`` and ``can_train``: for each ``v`` of
        ``versions`` (ascending), how many more groups of versions <= v the steps from ``step`` on can
        still take before v leaves the window (TBS a step, ``v + k - step + 1`` steps), given ``counts``
        groups unconsumed per version."""
        order, below, i = sorted(counts), 0, 0
        for v in versions:
            while i < len(order) and order[i] <= v:
                below += counts[order[i]]
                i += 1
            yield self.tbs * (v + self.k - step + 1) - below

    def _release(self, version: int) -> None:
        if self.unconsumed.get(version, 0) < 1:
            raise StalenessViolation(f"no unconsumed group of v{version} to release")
        self.unconsumed[version] -= 1
        if self.unconsumed[version] == 0:
            del self.unconsumed[version]

    # -- checkpoint --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"k": self.k, "tbs": self.tbs, "latest": self.latest, "next_step": self.next_step,
                "unconsumed": {str(v): c for v, c in self.unconsumed.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> VersionWindow:
        return cls(k=d["k"], tbs=d["tbs"], latest=d["latest"], next_step=d["next_step"],
                   unconsumed={int(v): c for v, c in d["unconsumed"].items()})
