"""The planner A/B (issue 31): DORA with the paper's proportional planner against the straggler-aware one
(``dora.planner: straggler``, oldest version first), each beside sync on the same seed, on five workloads:
paper-64, paper-128, the heavy tail, long reasoning and agentic-64. Steady state: 40 steps, the first 2K
left out. Agentic-64 also runs partial rollout and DORA elastic (its 8-minute runs on 2 cores limit it to
``AGENTIC_SEEDS`` seeds here).

    .venv/bin/python results/sim/planner/planner.py     # ~50 min on 2 cores; writes summary.json, planner.png
"""

from __future__ import annotations

import json
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.sim.sweeps import LABELS, SCENARIOS, SEEDS, grouped, run

HERE = Path(__file__).resolve().parent
PLAIN = ("sync", "dora", "dora straggler")            # every scenario, SEEDS seeds
AGENTIC_ONLY = ("partial", "dora elastic")            # agentic-64 only
AGENTIC_SEEDS = 1


def jobs() -> list[tuple[str, str, int]]:
    out = []
    for name, (_, _, seed, _) in SCENARIOS.items():
        seeds = AGENTIC_SEEDS if name == "agentic-64" else SEEDS
        labels = PLAIN + (AGENTIC_ONLY if name == "agentic-64" else ())
        out += [(name, label, seed + i) for i in range(seeds) for label in labels]
    return sorted(out, key=lambda j: j[0] != "agentic-64")  # the longest first


def main() -> None:
    with Pool(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as pool:
        results = pool.map(run, jobs(), chunksize=1)
    out = grouped(results)
    for rows in out.values():
        for label, runs in rows.items():
            rows[label] = {"median": {k: statistics.median(r[k] for r in runs)
                                      for k in ("throughput_tokens_per_s", "over_sync", "limit_share")},
                           "min_over_sync": min(r["over_sync"] for r in runs),
                           "max_over_sync": max(r["over_sync"] for r in runs), "seeds": runs}
    (HERE / "summary.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [lb for lb in LABELS if any(lb in rows for rows in out.values())]
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + j * width for i, rows in enumerate(out.values()) if label in rows]
        rows = [w[label] for w in out.values() if label in w]
        ys = [r["median"]["over_sync"] for r in rows]
        err = [[y - r["min_over_sync"] for y, r in zip(ys, rows, strict=True)],
               [r["max_over_sync"] - y for y, r in zip(ys, rows, strict=True)]]
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=label)
    ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(out))])
    ax.set_xticklabels(list(out), fontsize=9)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tokens/s over sync (simulated)")
    ax.set_title("steady state (40 steps, 2K warm-up); median over seeds and range", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "planner.png", dpi=120)


if __name__ == "__main__":
    main()
