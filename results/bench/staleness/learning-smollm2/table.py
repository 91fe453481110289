"""Markdown table of the SmolLM2 K=3 learning bench (summary.json of dora-hpc bench convergence)."""

import json
import statistics
import sys

s = json.load(open(sys.argv[1]))
cases = list(s["cases"])
seeds = [str(x) for x in s["seeds"]]
init = s["heldout"]["initial_by_seed"]
print("| case | held-out by seed | mean | minus sync (paired se) | train reward, last 5 steps | mean staleness "
      "| s a step |")
print("|---|---|---:|---:|---:|---:|---:|")
sync = [s["cases"][cases[0]]["heldout_final_by_seed"][k] for k in seeds]
for c in cases:
    v = s["cases"][c]
    held = [v["heldout_final_by_seed"][k] for k in seeds]
    d = [a - b for a, b in zip(held, sync, strict=True)]
    se = statistics.stdev(d) / len(d) ** 0.5 if any(d) else 0.0
    st = statistics.fmean(v["rollout"][k]["mean_staleness"] for k in seeds)
    print(f"| {c} | {', '.join(f'{x:.3f}' for x in held)} | {statistics.fmean(held):.3f} | "
          f"{statistics.fmean(d):+.3f} ({se:.3f}) | {v['final']:.3f} | {st:.2f} | {v['seconds_per_step']:.1f} |")
print("\ninitial held-out by seed:", ", ".join(f"{init[k]:.3f}" for k in seeds))
for c in cases:
    h: dict[str, int] = {}
    for k in seeds:
        for st, n in s["cases"][c]["rollout"][k]["staleness_histogram"].items():
            h[st] = h.get(st, 0) + n
    print(c, "staleness", dict(sorted(h.items())))
