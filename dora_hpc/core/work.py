"""Pending work (the paper's §3.3): the decode tokens each live request has left, estimated from its progress
and the response lengths seen so far; what ``dora.planner: work`` apportions instances by.

For a request that has decoded ``g`` tokens the estimate is the mean residual length of the finished
responses longer than ``g``: E[L - g | L > g]. Under a long tail that grows with ``g`` (a request that has
run long is likely a long one). A request past every finished length is given ``g`` more (it has outlived
the sample: as much again). Before any response has finished every request counts the same, as under the
count rule.

Invariants: pure (event counts and the token counts events carry); a request's progress is forgotten when
it finishes or leaves; estimates are never negative.
"""

from __future__ import annotations

import bisect
from itertools import accumulate


class WorkEstimate:
    def __init__(self) -> None:
        self.lengths: list[int] = []           # finished response lengths, sorted
        self.decoded: dict[int, int] = {}      # live traj -> tokens decoded so far (its latest Progress)
        self._suffix: list[int] | None = None  # suffix sums of lengths (rebuilt lazily)

    def finished(self, traj_id: int, tokens: int) -> None:
        self.decoded.pop(traj_id, None)
        if tokens > 0:
            bisect.insort(self.lengths, tokens)
            self._suffix = None

    def forget(self, traj_id: int) -> None:
        self.decoded.pop(traj_id, None)

    def progress(self, decoded: tuple[tuple[int, int], ...]) -> None:
        for traj_id, tokens in decoded:
            self.decoded[traj_id] = tokens

    def _suffix_sums(self) -> list[int]:
        if self._suffix is None:
            self._suffix = list(accumulate(reversed(self.lengths)))[::-1] + [0]
        return self._suffix

    def expected(self) -> float:
        """A request not started yet: the mean finished length (1 before any finished)."""
        return self._suffix_sums()[0] / len(self.lengths) if self.lengths else 1.0

    def remaining(self, traj_id: int) -> float:
        g = self.decoded.get(traj_id, 0)
        if not self.lengths:
            return 1.0
        i = bisect.bisect_right(self.lengths, g)
        longer = len(self.lengths) - i
        return self._suffix_sums()[i] / longer - g if longer else float(max(g, 1))
