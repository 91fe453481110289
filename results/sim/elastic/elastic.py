"""Before/after table for borrowed instances (cluster.elastic, issue 21): sync, DORA and DORA elastic
(fixed RBS and rbs: auto) on three workloads at the same total accelerators and split.

    .venv/bin/python results/sim/elastic/elastic.py     # ~10 min on 2 cores; writes summary.json, elastic.png
"""

from __future__ import annotations

import json
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize, zero_bubble_limit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
HEAVY = ["workload.response_len.sigma=1.6", "workload.response_len.max=65536", "dora.k=6", "seed=7"]
SCENARIOS = {
    "heavy tail (paper-64 split, sigma 1.6, cap 64k, K 6, seed 7)": ("configs/sim/paper-64.yaml", HEAVY),
    "paper-64": ("configs/sim/paper-64.yaml", []),
    "paper-128": ("configs/sim/paper-128.yaml", []),
}
RUNS = {"sync": ("sync", []), "dora": ("dora", []), "dora elastic": ("dora", ["cluster.elastic=true"]),
        "dora elastic, rbs auto": ("dora", ["cluster.elastic=true", "batch.rbs=auto"])}
KEEP = ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "slot_utilization", "max_staleness",
        "lost_groups", "duplicate_groups", "mixed_version_trajectories", "reprefill_tokens", "borrowed_instances",
        "drain_wait_s", "drain_migrations", "drain_offloads")


def main() -> None:
    out: dict = {}
    for name, (path, sets) in SCENARIOS.items():
        rows = {}
        for label, (mode, extra) in RUNS.items():
            cfg = load_config(ROOT / path, sets + extra)
            s = summarize(Simulator(cfg, mode, timeline=False).run())
            limit = zero_bubble_limit(cfg, s["placement"], borrowed=s["borrowed_instances"])
            rows[label] = {**{k: s[k] for k in KEEP}, "limit_tokens_per_s": limit,
                           "limit_share": s["throughput_tokens_per_s"] / limit}
            print(name, label, round(s["throughput_tokens_per_s"]), flush=True)
        sync = rows["sync"]["throughput_tokens_per_s"]
        for r in rows.values():
            r["over_sync"] = r["throughput_tokens_per_s"] / sync
        out[name] = rows
    (HERE / "summary.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = list(RUNS)
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + j * width for i in range(len(out))]
        ax.bar(xs, [rows[label]["over_sync"] for rows in out.values()], width, label=label)
    ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(out))])
    ax.set_xticklabels([n.split(" (")[0] for n in out], fontsize=9)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tokens/s over sync (simulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "elastic.png", dpi=120)


if __name__ == "__main__":
    main()
