"""What crossing nodes costs: the same tiny DORA job under Slurm with its ranks on four namespaced nodes
(every weight load and KV migration crosses the bridge) and with all of them on one node (shared memory),
interleaved A B A B; per run, the median seconds per MB of weight loads and of KV migrations (their
receiving side), from the HDF5 ops; the ratios across / one node, medians over the pairs.

It is a virtual link (veth pairs on a bridge, under gVisor here): the ratios say how much slower a byte
moves between these nodes than within one, not what a real network's bandwidth is.

    NETNS=1 NNODES=5 CPUS=6 bash slurm/start_local_slurm.sh      # 6 CPUs a node: one node holds all 5 ranks
    .venv/bin/python results/bench/multinode/measure.py [REPEATS]  # writes summary.json and multinode.png here
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BASE = ["train.max_steps=12", "batch.tbs=4", "batch.rbs=6", "train.checkpoint_every=0", "seed=0"]
CASES = {"across": ["slurm.rollout.nodes=3"],                                     # 1 + 3 nodes
         "one_node": ["slurm.heterogeneous=false", "slurm.trainer.nodes=1"]}   # all 5 ranks on one node


def run(case: str, out: Path) -> Path:
    sets = [x for kv in (*BASE, *CASES[case]) for x in ("--set", kv)]
    p = subprocess.run([sys.executable, "-m", "dora_hpc.cli", "submit", "configs/tiny-cpu.yaml", "--run-dir",
                        str(out), *sets], cwd=REPO, capture_output=True, text=True, check=True)
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        time.sleep(1)
    return out


def per_mb(run_dir: Path) -> dict:
    from dora_hpc.analysis.basic import analyze
    from dora_hpc.store.shards import read_table

    a = analyze(run_dir)
    bad = {k: v for k, v in a["invariants"].items() if k != "offenders" and v}
    assert a["steps"] == 12 and not bad, (run_dir, a["steps"], bad)
    ops = read_table(run_dir, "events", "ops", ["kind", "t_start", "t_end", "bytes"])
    out = {}
    for kind in ("weight_load", "migration_in"):
        m = (ops["kind"] == kind) & (ops["bytes"] > 0)
        s = (ops["t_end"][m] - ops["t_start"][m]) / (ops["bytes"][m] / 2**20)
        out[kind] = {"n": int(m.sum()), "median_s_per_mb": float(np.median(s)) if m.any() else None,
                     "median_s": float(np.median(ops["t_end"][m] - ops["t_start"][m])) if m.any() else None,
                     "median_mb": float(np.median(ops["bytes"][m]) / 2**20) if m.any() else None}
    log = "".join(f.read_text() for f in (run_dir / "slurm").glob("*_0_log.out"))
    out["hosts"] = re.search(r"one MPI world of \d+ ranks: (.*)", log).group(1)
    return out


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    runs = HERE / "runs"
    subprocess.run(["rm", "-rf", str(runs)], check=True)
    rows = []
    for r in range(repeats):
        rows.append({case: per_mb(run(case, runs / f"{case}-r{r}")) for case in CASES})
        print(json.dumps(rows[-1]), flush=True)
    ratios = {}
    for kind in ("weight_load", "migration_in"):
        for fig in ("median_s_per_mb", "median_s"):
            pairs = [row["across"][kind][fig] / row["one_node"][kind][fig] for row in rows
                     if row["across"][kind][fig] and row["one_node"][kind][fig]]
            ratios[f"{kind} {fig}: across / one node"] = statistics.median(pairs) if pairs else None
            ratios[f"{kind} {fig}: pairs"] = pairs
    summary = {"repeats": repeats, "config": "configs/tiny-cpu.yaml", "sets": BASE, "cases": CASES, "runs": rows,
               "ratios": ratios}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, kind in zip(axes, ("weight_load", "migration_in"), strict=True):
        for i, case in enumerate(CASES):
            vals = [row[case][kind]["median_s_per_mb"] * 1e3 for row in rows if row[case][kind]["median_s_per_mb"]]
            ax.scatter([i] * len(vals), vals, label=case)
        ax.set_xticks(range(len(CASES)), list(CASES))
        ax.set_title(f"{kind}: ms per MB (median of each run)")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(HERE / "multinode.png", dpi=110)
    subprocess.run(["rm", "-rf", str(runs)], check=True)
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
