"""The effective history of a run that was preempted and resumed, from its HDF5 logs alone.

Every launch (attempt) of a run logs a ``start`` op: the step it starts at and, when it resumed, the
attempt whose checkpoint it continued. Following those links back from the last attempt gives a chain;
attempt ``a`` in the chain owns the train steps from its start up to the start of the next attempt in
the chain. Rows outside what their attempt owns -- the future a preemption threw away, or attempts no
later attempt continued from -- are not part of the run's history (they stay in the logs, counted as
discarded). Invariant: a run never interrupted has one attempt owning every row, so this is a no-op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class History:
    starts: dict[int, int]          # attempt -> first train step it ran
    chain: list[int]                # attempts whose steps make up the run, oldest first
    owns: dict[int, tuple[int, float]]  # attempt -> [first step, end step) it owns

    def step_mask(self, attempts: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Rows (by writer attempt and train step) that belong to the effective history."""
        keep = np.zeros(len(steps), dtype=bool)
        for a, (lo, hi) in self.owns.items():
            keep |= (attempts == a) & (steps >= lo) & (steps < hi)
        return keep


def history(ops: dict[str, np.ndarray]) -> History:
    starts: dict[int, int] = {}
    parent: dict[int, int] = {}
    for kind, attempt, version, detail in zip(ops["kind"], ops["attempt"], ops["version"], ops["detail"],
                                              strict=True):
        if kind == "start":
            starts[int(attempt)] = int(version)
            m = re.search(r"from_attempt=(\d+)", str(detail))
            if m:
                parent[int(attempt)] = int(m.group(1))
    if not starts:  # logs without start ops (a run killed before its first flush): one attempt
        starts = {int(a): 0 for a in set(ops["attempt"].tolist())} or {0: 0}
    chain = [max(starts)]
    while chain[-1] in parent and parent[chain[-1]] in starts:
        chain.append(parent[chain[-1]])
    chain.reverse()
    owns = {a: (starts[a], float(starts[chain[i + 1]]) if i + 1 < len(chain) else float("inf"))
            for i, a in enumerate(chain)}
    return History(starts, chain, owns)
