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

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize, zero_bubble_limit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SCENARIOS = {  # name: (config, overrides, base seed, K)
    "paper-64": ("configs/sim/paper-64.yaml", [], 0, 3),
    "paper-128": ("configs/sim/paper-128.yaml", [], 0, 3),
    "heavy tail": ("configs/sim/paper-64.yaml", ["workload.response_len.sigma=1.6", "workload.response_len.max=65536",
                                                 "dora.k=6"], 7, 6),
    "long reasoning": ("configs/sim/paper-64.yaml", ["workload.response_len.median=2000",
                                                     "workload.response_len.sigma=1.2",
                                                     "workload.response_len.max=32768", "dora.k=4"], 0, 4),
    "agentic-64": ("configs/sim/agentic-64.yaml", [], 0, 3),
}
RUNS = {"sync": ("sync", []), "partial": ("partial", []), "dora": ("dora", []),
        "dora straggler": ("dora", ["dora.planner=straggler"]), "dora elastic": ("dora", ["cluster.elastic=true"])}
PLAIN = ("sync", "dora", "dora straggler")            # every scenario, SEEDS seeds
AGENTIC_ONLY = ("partial", "dora elastic")            # agentic-64 only
SEEDS, AGENTIC_SEEDS = 3, 1
KEEP = ("throughput_tokens_per_s", "mean_step_time_s", "trainer_wait_fraction", "slot_utilization", "max_staleness",
        "lost_groups", "duplicate_groups", "split_groups", "mixed_version_trajectories", "reprefill_tokens",
        "migrations", "kv_peak_fraction", "placement", "borrowed_instances")


def simulate(job: tuple[str, str, int]) -> tuple[str, str, dict]:
    name, label, seed = job
    path, sets, _, k = SCENARIOS[name]
    mode, extra = RUNS[label]
    cfg = load_config(ROOT / path, [*sets, *extra, f"seed={seed}", "sim.steps=40", f"sim.warmup_steps={2 * k}"])
    s = summarize(Simulator(cfg, mode, timeline=False).run())
    limit = zero_bubble_limit(cfg, s["placement"], borrowed=s["borrowed_instances"])
    row = {**{key: s.get(key) for key in KEEP}, "limit_tokens_per_s": limit,
           "limit_share": s["throughput_tokens_per_s"] / limit, "seed": seed, "episodes": s.get("episodes", {})}
    print(name, label, seed, round(s["throughput_tokens_per_s"]), flush=True)
    return name, label, row


def jobs() -> list[tuple[str, str, int]]:
    out = []
    for name, (_, _, seed, _) in SCENARIOS.items():
        seeds = AGENTIC_SEEDS if name == "agentic-64" else SEEDS
        labels = PLAIN + (AGENTIC_ONLY if name == "agentic-64" else ())
        out += [(name, label, seed + i) for i in range(seeds) for label in labels]
    return sorted(out, key=lambda j: j[0] != "agentic-64")  # the longest first


def grouped(results: list[tuple[str, str, dict]]) -> dict:
    """Runs by scenario and label, each with ``over_sync``: its throughput over its seed's sync run."""
    out: dict = {}
    for name, label, row in results:
        out.setdefault(name, {}).setdefault(label, []).append(row)
    for rows in out.values():
        sync = {r["seed"]: r["throughput_tokens_per_s"] for r in rows["sync"]}
        for runs in rows.values():
            for r in runs:
                r["over_sync"] = r["throughput_tokens_per_s"] / sync[r["seed"]]
    return out


def main() -> None:
    with Pool(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as pool:
        results = pool.map(simulate, jobs(), chunksize=1)
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

    labels = [lb for lb in RUNS if any(lb in rows for rows in out.values())]
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
