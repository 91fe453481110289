"""Before/after table for borrowed instances (cluster.elastic, issue 21): sync, DORA and DORA elastic on
three workloads at the same total accelerators and split, measured over two windows:

* "configured": each config's own window (14 steps, the first 2 excluded), where the figures issue 21
  quotes were taken; with K=3 it still holds the pipeline's fill (at step K the trainer first waits
  for every group admitted at t=0);
* "steady": 40 steps, the first 2K excluded, for three seeds (the base seed and the next two): median
  and range.

    .venv/bin/python results/sim/elastic/elastic.py     # ~15 min on 2 cores; writes summary.json, elastic.png
"""

from __future__ import annotations

import json
import statistics
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize, zero_bubble_limit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
HEAVY = ["workload.response_len.sigma=1.6", "workload.response_len.max=65536", "dora.k=6"]
SCENARIOS = {  # name: (config, overrides, base seed)
    "heavy tail (paper-64 split, sigma 1.6, cap 64k, K 6, seed 7)": ("configs/sim/paper-64.yaml", HEAVY, 7),
    "paper-64": ("configs/sim/paper-64.yaml", [], 0),
    "paper-128": ("configs/sim/paper-128.yaml", [], 0),
}
RUNS = {"sync": ("sync", []), "dora": ("dora", []), "dora elastic": ("dora", ["cluster.elastic=true"]),
        "dora elastic, rbs auto": ("dora", ["cluster.elastic=true", "batch.rbs=auto"])}
STEADY_RUNS = ("sync", "dora", "dora elastic")
SEEDS = 3
KEEP = ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "trainer_wait_fraction",
        "slot_utilization", "max_staleness", "lost_groups", "duplicate_groups", "mixed_version_trajectories",
        "reprefill_tokens", "borrowed_instances", "drain_wait_s", "drain_migrations", "drain_offloads")


def simulate(job: tuple[str, str, str, list[str]]) -> tuple[str, str, str, dict]:
    name, window, label, sets = job
    path, _, _ = SCENARIOS[name]
    mode, extra = RUNS[label]
    cfg = load_config(ROOT / path, sets + extra)
    s = summarize(Simulator(cfg, mode, timeline=False).run())
    limit = zero_bubble_limit(cfg, s["placement"], borrowed=s["borrowed_instances"])
    row = {**{k: s[k] for k in KEEP}, "limit_tokens_per_s": limit, "limit_share": s["throughput_tokens_per_s"] / limit,
           "seed": cfg.seed}
    print(name.split(" (")[0], window, label, cfg.seed, round(s["throughput_tokens_per_s"]), flush=True)
    return name, window, label, row


def jobs() -> list[tuple[str, str, str, list[str]]]:
    out = []
    for name, (_, sets, seed) in SCENARIOS.items():
        k = 6 if sets else 3
        out += [(name, "configured", label, [*sets, f"seed={seed}"]) for label in RUNS]
        steady = [*sets, "sim.steps=40", f"sim.warmup_steps={2 * k}"]
        out += [(name, "steady", label, [*steady, f"seed={seed + i}"]) for label in STEADY_RUNS for i in range(SEEDS)]
    return out


def main() -> None:
    with Pool(2) as pool:
        results = pool.map(simulate, jobs(), chunksize=1)
    out: dict = {}
    for name, window, label, row in results:
        out.setdefault(name, {}).setdefault(window, {}).setdefault(label, []).append(row)
    for windows in out.values():
        for window, rows in windows.items():
            sync = {r["seed"]: r["throughput_tokens_per_s"] for r in rows["sync"]}
            for label, runs in rows.items():
                for r in runs:
                    r["over_sync"] = r["throughput_tokens_per_s"] / sync[r["seed"]]
                rows[label] = runs[0] if window == "configured" else {
                    "median": {k: statistics.median(r[k] for r in runs)
                               for k in ("throughput_tokens_per_s", "over_sync", "limit_share")},
                    "min_over_sync": min(r["over_sync"] for r in runs),
                    "max_over_sync": max(r["over_sync"] for r in runs), "seeds": runs}
    (HERE / "summary.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, window in zip(axes, ("configured", "steady"), strict=True):
        labels = list(RUNS) if window == "configured" else list(STEADY_RUNS)
        width = 0.8 / len(labels)
        for j, label in enumerate(labels):
            xs = [i + j * width for i in range(len(out))]
            rows = [w[window][label] for w in out.values()]
            ys = [r["over_sync"] if window == "configured" else r["median"]["over_sync"] for r in rows]
            err = None if window == "configured" else [[y - r["min_over_sync"] for y, r in zip(ys, rows, strict=True)],
                                                       [r["max_over_sync"] - y for y, r in zip(ys, rows, strict=True)]]
            ax.bar(xs, ys, width, yerr=err, capsize=3, label=label)
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(out))])
        ax.set_xticklabels([n.split(" (")[0] for n in out], fontsize=9)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title("configured window (14 steps, 2 warm-up)" if window == "configured"
                     else f"steady state (40 steps, 2K warm-up; median of {SEEDS} seeds, range)", fontsize=9)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("tokens/s over sync (simulated)")
    fig.tight_layout()
    fig.savefig(HERE / "elastic.png", dpi=120)


if __name__ == "__main__":
    main()
