"""The paper's Appendix C tables from a run's stratified figures (analysis/staleness.py ``stratified``, as
``dora-hpc analyze --json`` writes them): Tables 1 and 2 (within-bin pass-rate gaps, staleness 1 against 0, with
standard errors), Table 3 (its three claims, true or false) and Fig. 14b (median length by staleness).

Comparisons, not verdicts: tools/paper_report.py judges each (results/paper/README.md).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

FEW = 30  # responses in a cell: fewer and its pass rate (or median length) is a handful of groups, not a finding
# Table 3's middle bins: the paper's Medium-Hard and Medium-Easy (4-11 of 16 right); in pass-rate bins of groups
# of 4, 1 and 2 of 4 right (4/16 and 8/16)
MIDDLE = ("[0.25", "[0.50", "Medium")


def within_bin_gaps(strat: dict) -> list[dict]:
    """Per difficulty bin, as Tables 1 and 2 compare them: staleness 1 against staleness 0, the pass-rate gap, its
    standard error (two proportions) and whether either cell has fewer than FEW responses."""
    out = []
    for row in strat["rows"]:
        fresh, stale = row["by_staleness"].get("0"), row["by_staleness"].get("1")
        n0, n1 = fresh["n"] if fresh else 0, stale["n"] if stale else 0
        if not n0 or not n1:
            out.append({"bin": row["bin"], "n0": n0, "n1": n1, "gap": None, "se": None, "few": True})
            continue
        p0, p1 = fresh["pass_rate"], stale["pass_rate"]
        p = (n0 * p0 + n1 * p1) / (n0 + n1)
        se = math.sqrt(max(p * (1 - p), 1e-12) * (1 / n0 + 1 / n1))
        out.append({"bin": row["bin"], "n0": n0, "p0": p0, "n1": n1, "p1": p1, "gap": p1 - p0, "se": se,
                    "few": min(n0, n1) < FEW})
    return out


def degenerate(strat: dict, group_size: int) -> str | None:
    """Why a stratified comparison says nothing on this run, if it does not: a group's samples share one
    staleness (groups are consumed whole), so with few samples a group pass-rate bin fixes the pass rate of
    every sample in it; and a run whose trajectories nearly all share one staleness has nothing to compare."""
    cells = strat["naive"]["by_staleness"]
    n = sum(c["n"] for c in cells.values())
    top, top_n = max(cells.items(), key=lambda kv: kv[1]["n"])
    why = []
    if top_n["n"] >= 0.9 * n:
        why.append(f"{top_n['n'] / n:.0%} of the trajectories have staleness {top}")
    if group_size <= 4 and strat.get("difficulty_of", "group") == "group":
        why.append(f"groups of {group_size}: each difficulty bin holds one or two group pass rates, the same at "
                   "every staleness (a group's samples share it)")
    return "; ".join(why) or None


def table12(strat: dict, group_size: int) -> dict:
    """Tables 1 and 2: the naive pass rate at staleness 0 and 1, and the within-bin gaps (s=1 minus s=0)."""
    cells = strat["naive"]["by_staleness"]
    return {"naive": {s: cells[s] for s in ("0", "1") if s in cells}, "bins": within_bin_gaps(strat),
            "degenerate": degenerate(strat, group_size), "few": FEW}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation (no ties expected among a handful of bin means); None for fewer than 3 points."""
    if len(xs) < 3:
        return None
    rx, ry = ([sorted(v).index(x) for x in v] for v in (xs, ys))
    return statistics.correlation(rx, ry)


def table3(strat: dict) -> dict:
    """Table 3 in the paper's bins (k of 16 right) where the analysis gives them, and the paper's three claims:
    the variance peaks in a middle bin, responses shorten as problems get easier, staleness peaks in a middle
    bin (the paper's own rows: variance 1.001 at 8-11/16, length 3,755 -> 2,711 in order, staleness 1.01 at
    4-7/16). Shortening means a rank correlation of bin and length of -0.8 or below (over 3 bins: in order)."""
    paper_bins = "by_difficulty_paper_bins" in strat
    rows = [r for r in strat["by_difficulty_paper_bins" if paper_bins else "by_difficulty"] if r["groups"]]
    if not paper_bins:  # our bins hold the groups with none right too: the paper's leave them out
        rows = [r for r in rows if not r["bin"].startswith("[0.00")]
    peak = {k: max(rows, key=lambda r: r[k])["bin"] if rows else None
            for k in ("reward_variance", "mean_staleness")}
    rho = spearman(list(range(len(rows))), [r["mean_length"] for r in rows])
    claims = {"variance peaks in a middle bin": peak["reward_variance"].startswith(MIDDLE) if rows else None,
              "responses shorten as problems get easier": None if rho is None else rho <= -0.8,
              "staleness peaks in a middle bin": peak["mean_staleness"].startswith(MIDDLE) if rows else None}
    return {"binning": "paper (k of 16)" if paper_bins else "k of 4, as [lo, hi) pass-rate bins", "bins": rows,
            "peaks": peak, "length_rank_correlation": rho, "claims": claims}


def fig14b(strat: dict) -> dict:
    med = {int(s): v for s, v in strat["median_length_by_staleness"].items()}
    n = {int(s): c["n"] for s, c in strat["naive"]["by_staleness"].items()}
    return {"median_length_by_staleness": med, "n": n, "few": FEW}


def dora_tables(path: str, g: int) -> dict:
    """Tables 1 and 3 and Fig. 14b of one more DORA run (no partial-rollout run: no Table 2)."""
    strat = json.loads(Path(path).read_text())["stratified"]
    return {"table1": table12(strat, g), "table3": table3(strat), "fig14b": fig14b(strat), "source": path,
            "staleness": strat["naive"]["by_staleness"]}
