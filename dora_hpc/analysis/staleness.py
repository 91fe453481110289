"""Did staleness cost quality? The paper's naive vs difficulty-stratified comparison (Tables 1 and 3).

Per consumed trajectory: its staleness (consume step - version), reward, response length and group.
A trajectory *passes* when its reward >= ``threshold``; a prompt's difficulty is its group's pass rate.
Stale data comes disproportionately from hard prompts (long responses finish late), so the naive pass
rate by staleness mixes two effects; within a pass-rate bin the difficulty is held roughly fixed and
what is left is the effect of staleness (Table 1). Invariant: every figure is a plain count or mean
over the given rows; an empty cell is reported with n = 0 and no rate, never as 0.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

BINS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.01))


def _label(lo: float, hi: float) -> str:
    return f"[{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}"


def _cells(stale: np.ndarray, passed: np.ndarray) -> dict[str, dict]:
    out = {}
    for s in sorted(set(stale.tolist())):
        m = stale == s
        out[str(s)] = {"n": int(m.sum()), "pass_rate": float(passed[m].mean())}
    return out


def _delta(cells: dict[str, dict]) -> float | None:
    """Pass rate of stale (>= 1) minus fresh (0) trajectories; None when either side is empty."""
    fresh = cells.get("0")
    stale = [(c["n"], c["pass_rate"]) for s, c in cells.items() if s != "0"]
    n = sum(k for k, _ in stale)
    if not fresh or not n:
        return None
    return sum(k * p for k, p in stale) / n - fresh["pass_rate"]


def stratified(stale: np.ndarray, reward: np.ndarray, group: np.ndarray, length: np.ndarray,
               threshold: float = 0.5) -> dict:
    stale, reward, group, length = (np.asarray(x) for x in (stale, reward, group, length))
    passed = (reward >= threshold).astype(float)
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group.tolist()):
        by_group[g].append(i)
    difficulty = np.zeros(len(group))
    for idx in by_group.values():
        difficulty[idx] = passed[idx].mean()
    naive = _cells(stale, passed)
    rows, table3 = [], []
    for lo, hi in BINS:
        m = (difficulty >= lo) & (difficulty < hi)
        cells = _cells(stale[m], passed[m]) if m.any() else {}
        rows.append({"bin": _label(lo, hi), "n": int(m.sum()), "by_staleness": cells, "delta": _delta(cells)})
        groups_in = [g for g, idx in by_group.items() if lo <= difficulty[idx[0]] < hi]
        table3.append({"bin": _label(lo, hi), "groups": len(groups_in),
                       "reward_variance": float(np.mean([reward[by_group[g]].var() for g in groups_in]))
                       if groups_in else None,
                       "mean_length": float(length[m].mean()) if m.any() else None,
                       "mean_staleness": float(stale[m].mean()) if m.any() else None})
    median_len = {str(s): float(np.median(length[stale == s])) for s in sorted(set(stale.tolist()))}
    return {"threshold": threshold, "naive": {"by_staleness": naive, "delta": _delta(naive)},
            "rows": rows, "by_difficulty": table3, "median_length_by_staleness": median_len}
