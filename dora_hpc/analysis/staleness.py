"""Did staleness cost quality? The paper's naive vs difficulty-stratified comparison (Tables 1 and 3).

Per consumed trajectory: its staleness (consume step - version), reward, response length, group and
prompt. A trajectory *passes* when its reward >= ``threshold``; a prompt's difficulty is its pass rate over
every consumed sample of it in the run (its groups at every staleness), or its group's alone where the run
does not say which prompt a group got (``prompt`` None). A group's samples share one staleness, so with a
few samples per group a bin of group pass rates would fix the pass rate inside it.
Stale data comes disproportionately from hard prompts (long responses finish late), so the naive pass
rate by staleness mixes two effects; within a pass-rate bin the difficulty is held roughly fixed and
what is left is the effect of staleness (Table 1). Invariant: every figure is a plain count or mean
over the given rows; an empty cell is reported with n = 0 and no rate, never as 0.
"""

from __future__ import annotations

import numpy as np

BINS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.01))
# Table 3's own bins, as k of 16 right (a group with none right carries no signal and is left out); a group of
# G fills the bin its k/G falls in, so with G = 4 "Hard" (1-3 of 16) stays empty
PAPER_TABLE3 = (("Hard (1-3/16)", 1 / 16, 4 / 16), ("Medium-Hard (4-7/16)", 4 / 16, 8 / 16),
                ("Medium-Easy (8-11/16)", 8 / 16, 12 / 16), ("Easy (12-14/16)", 12 / 16, 15 / 16),
                ("Very Easy (15-16/16)", 15 / 16, 1.01))


def _label(lo: float, hi: float) -> str:
    return f"[{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}"


def _cells(stale: np.ndarray, passed: np.ndarray) -> dict[str, dict]:
    values, inverse, n = np.unique(stale, return_inverse=True, return_counts=True)
    passes = np.bincount(inverse, weights=passed, minlength=len(values))
    return {str(int(s)): {"n": int(k), "pass_rate": float(p / k)} for s, k, p in zip(values, n, passes, strict=True)}


def _delta(cells: dict[str, dict]) -> float | None:
    """Pass rate of stale (>= 1) minus fresh (0) trajectories; None when either side is empty."""
    fresh = cells.get("0")
    stale = [(c["n"], c["pass_rate"]) for s, c in cells.items() if s != "0"]
    n = sum(k for k, _ in stale)
    if not fresh or not n:
        return None
    return sum(k * p for k, p in stale) / n - fresh["pass_rate"]


def _rate(key: np.ndarray, passed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index of each row's key, pass rate per key, rows per key)."""
    _, idx, n = np.unique(key, return_inverse=True, return_counts=True)
    return idx, np.bincount(idx, weights=passed, minlength=len(n)) / np.maximum(n, 1), n


def stratified(stale: np.ndarray, reward: np.ndarray, group: np.ndarray, length: np.ndarray,
               threshold: float = 0.5, prompt: np.ndarray | None = None) -> dict:
    stale, reward, group, length = (np.asarray(x) for x in (stale, reward, group, length))
    stale = stale.astype(np.int64)
    reward = reward.astype(float)
    passed = (reward >= threshold).astype(float)
    g_idx, g_pass, g_n = _rate(group, passed)
    g_mean = np.bincount(g_idx, weights=reward, minlength=len(g_n)) / np.maximum(g_n, 1)
    g_var = np.bincount(g_idx, weights=(reward - g_mean[g_idx]) ** 2, minlength=len(g_n)) / np.maximum(g_n, 1)
    p_idx, p_pass, _ = _rate(group if prompt is None else np.asarray(prompt), passed)
    difficulty = p_pass[p_idx]
    naive = _cells(stale, passed)
    rows, table3 = [], []
    for lo, hi in BINS:
        m = (difficulty >= lo) & (difficulty < hi)
        cells = _cells(stale[m], passed[m]) if m.any() else {}
        rows.append({"bin": _label(lo, hi), "n": int(m.sum()), "by_staleness": cells, "delta": _delta(cells)})
        table3.append(_signal(_label(lo, hi), (g_pass >= lo) & (g_pass < hi), g_idx, g_var, length, stale))
    paper3 = [_signal(label, (g_pass >= lo) & (g_pass < hi), g_idx, g_var, length, stale)
              for label, lo, hi in PAPER_TABLE3]
    order = np.argsort(stale, kind="stable")
    values, starts = np.unique(stale[order], return_index=True)
    median_len = {str(int(s)): float(np.median(chunk))
                  for s, chunk in zip(values, np.split(length[order], starts[1:]), strict=True)}
    return {"threshold": threshold, "difficulty_of": "group" if prompt is None else "prompt",
            "naive": {"by_staleness": naive, "delta": _delta(naive)},
            "rows": rows, "by_difficulty": table3, "by_difficulty_paper_bins": paper3,
            "median_length_by_staleness": median_len}


def _signal(label: str, groups_in: np.ndarray, g_idx: np.ndarray, g_var: np.ndarray, length: np.ndarray,
            stale: np.ndarray) -> dict:
    """Table 3's row for the groups selected by ``groups_in`` (binned by their own pass rate, k of G right)."""
    rows_in = groups_in[g_idx]
    return {"bin": label, "groups": int(groups_in.sum()),
            "reward_variance": float(g_var[groups_in].mean()) if groups_in.any() else None,
            "mean_length": float(length[rows_in].mean()) if rows_in.any() else None,
            "mean_staleness": float(stale[rows_in].mean()) if rows_in.any() else None}
