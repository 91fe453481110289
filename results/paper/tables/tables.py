"""Appendix C's Tables 1-3 and Fig. 14b from real-model runs (issue 33): reads ``dora-hpc analyze --json`` of a
DORA K=3 run and of a partial-rollout run (analysis/staleness.py's ``stratified``) and writes summary.json
here, which tools/paper_report.py puts in results/paper/README.md.

    .venv/bin/python results/paper/tables/tables.py results/paper/tables/analyze-dora-k3.json \
        results/paper/tables/analyze-partial.json 4 \
        results/paper/tables/rollout-bound/analyze-dora-k3-paced.json  # 4: the runs' group size

A verdict weighs each difference against its sampling error: a stratum's pass-rate gap counts as a
measured degradation only past two standard errors of the difference of two proportions.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FEW = 30  # responses: fewer at staleness 0 or 1 (a handful of groups) and a median gap is not a finding


def _gaps(strat: dict) -> list[dict]:
    """Per difficulty bin: fresh (staleness 0) against stale (>= 1) pass rates, the gap and its standard error."""
    out = []
    for row in strat["rows"]:
        cells = row["by_staleness"]
        fresh = cells.get("0")
        stale = [c for s, c in cells.items() if s != "0"]
        n1 = sum(c["n"] for c in stale)
        if not fresh or not n1:
            out.append({"bin": row["bin"], "n0": fresh["n"] if fresh else 0, "n1": n1, "gap": None, "se": None})
            continue
        p0, p1 = fresh["pass_rate"], sum(c["n"] * c["pass_rate"] for c in stale) / n1
        p = (fresh["n"] * p0 + n1 * p1) / (fresh["n"] + n1)
        se = math.sqrt(max(p * (1 - p), 1e-12) * (1 / fresh["n"] + 1 / n1))
        out.append({"bin": row["bin"], "n0": fresh["n"], "p0": p0, "n1": n1, "p1": p1, "gap": p1 - p0, "se": se})
    return out


def _degenerate(strat: dict, group_size: int) -> str | None:
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


def _table(strat: dict, paper: str, group_size: int) -> dict:
    gaps = _gaps(strat)
    measured = [g for g in gaps if g["gap"] is not None]
    worst = max(measured, key=lambda g: abs(g["gap"]) / g["se"]) if measured else None
    naive = strat["naive"]["delta"]
    ours = (f"naive {naive * 100:+.1f} pt; within bins " + ", ".join(
        f"{g['bin']} {g['gap'] * 100:+.1f} (se {g['se'] * 100:.1f}, n {g['n0']}/{g['n1']})" for g in measured)
        if measured and naive is not None else "no bin has both fresh and stale responses")
    if not measured:
        verdict = "not measurable: no bin holds both fresh and stale responses"
    elif why := _degenerate(strat, group_size):
        verdict = f"not measurable on this run: {why}"
    elif all(abs(g["gap"]) <= 2 * g["se"] for g in measured):
        n = sum(g["n0"] + g["n1"] for g in measured)
        verdict = (f"consistent at this size, not a reproduction: no stratum's gap exceeds two standard errors "
                   f"(largest {abs(worst['gap']) * 100:.1f} pt, se {worst['se'] * 100:.1f}) over {n} responses; "
                   f"{paper}, on thousands")
    else:
        verdict = (f"differs: the {worst['bin']} stratum's gap {worst['gap'] * 100:+.1f} pt is "
                   f"{abs(worst['gap']) / worst['se']:.1f} standard errors")
    return {"ours": ours, "verdict": verdict, "bins": gaps}


def _table3(strat: dict) -> dict:
    rows = [r for r in strat["by_difficulty"] if r["groups"]]
    text = ", ".join(f"{r['bin']}: var {r['reward_variance']:.3f}, len {r['mean_length']:.0f}, "
                     f"staleness {r['mean_staleness']:.2f} ({r['groups']} groups)" for r in rows)
    middle = [r for r in rows if r["bin"].startswith(("[0.25", "[0.50"))]
    longest = max(rows, key=lambda r: r["mean_length"]) if rows else None
    stalest = max(rows, key=lambda r: r["mean_staleness"]) if rows else None
    if not middle:
        verdict = "not measurable: no group of middle difficulty"
    else:
        said = [f"the longest responses are in {longest['bin']}", f"the stalest in {stalest['bin']}"]
        agree = longest in middle and stalest in middle
        verdict = ("reproduced: " if agree else "differs: ") + "; ".join(said) + (
            " (the paper: the middle bins are the longest and stalest; with binary rewards the variance "
            "p(1-p) peaks in the middle by construction)")
    return {"ours": text, "verdict": verdict, "bins": rows}


def _fig14b(strat: dict) -> dict:
    med = {int(s): v for s, v in strat["median_length_by_staleness"].items()}
    if 0 not in med or 1 not in med:
        return {"ours": json.dumps(med), "verdict": "not measurable: no staleness-0 or staleness-1 responses"}
    more = med[1] / med[0] - 1
    n = {int(s): c["n"] for s, c in strat["naive"]["by_staleness"].items()}
    text = " / ".join(f"s={s}: {v:.0f}" for s, v in sorted(med.items())) + f" tokens (s=1 vs 0: {more:+.0%})"
    longer = more > 0.10
    label = "too few to tell" if min(n.get(0, 0), n.get(1, 0)) < FEW else "reproduced" if longer else "differs"
    finding = "stale responses are longer" if longer else "stale responses are not markedly longer"
    return {"ours": text, "verdict": f"{label}: {finding} (paper +47%), on {n.get(0, 0)} / {n.get(1, 0)} responses "
            "at staleness 0 / 1", "median_length_by_staleness": med}


def main(dora_json: str, partial_json: str, group_size: str, rollout_bound_json: str | None = None) -> None:
    """``rollout_bound_json``: the same DORA run with rollout paced to be the bottleneck (README); its tables go
    under ``rollout_bound``, beside the main run's."""
    dora = json.loads(Path(dora_json).read_text())["stratified"]
    partial = json.loads(Path(partial_json).read_text())["stratified"]
    g = int(group_size)
    summary = {"table1": _table(dora, "paper: |gap| < 0.6 pt", g),
               "table2": _table(partial, "paper: |gap| <= 0.33 pt", g),
               "table3": _table3(dora), "fig14b": _fig14b(dora), "sources": [dora_json, partial_json],
               "staleness": {"dora": dora["naive"]["by_staleness"], "partial": partial["naive"]["by_staleness"]}}
    if rollout_bound_json:
        paced = json.loads(Path(rollout_bound_json).read_text())["stratified"]
        summary["rollout_bound"] = {"table1": _table(paced, "paper: |gap| < 0.6 pt", g), "table3": _table3(paced),
                                    "fig14b": _fig14b(paced), "source": rollout_bound_json,
                                    "staleness": paced["naive"]["by_staleness"]}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, tables in (("", summary), ("rollout-bound ", summary.get("rollout_bound", {}))):
        for k in ("table1", "table2", "table3", "fig14b"):
            if k in tables:
                print(name + k, tables[k]["ours"], "->", tables[k]["verdict"])


if __name__ == "__main__":
    main(*sys.argv[1:5])
