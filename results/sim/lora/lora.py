"""Full-weight DORA against LoRA DORA (train.lora, rank 32: a version is an adapter, every instance hosts each live
one, requests are placed by load alone, nothing migrates) on paper-64, the heavy tail and agentic-64, with sync
as the reference; 3 seeds, steady state (dora_hpc/sim/sweeps.py). LoRA's costs as the simulator prices them: a
publish moves the adapter's bytes (sim.model.adapter_bytes: rank x (in + out) of every linear), and each decode step
pays sim.hardware.lora_step_ms (2 ms, Punica, arXiv 2310.18547). Writes summary.json.

    .venv/bin/python results/sim/lora/lora.py [WORKLOAD ...]   # paper-64 and the heavy tail: ~20 min on 2 cores;
                                                               # agentic-64: over an hour
Given workloads (default all three) replace theirs in summary.json and keep the others.
"""

import json
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.sim.sweeps import SCENARIOS, SEEDS, grouped, run

NAMES = ("paper-64", "heavy tail", "agentic-64")
LABELS = ("sync", "dora", "dora lora")


def median(rows: list[dict], f) -> float:
    return statistics.median(f(r) for r in rows)


if __name__ == "__main__":
    names = sys.argv[1:] or NAMES
    jobs = [(n, label, SCENARIOS[n][2] + s) for n in names for label in LABELS for s in range(SEEDS)]
    with Pool(2) as p:
        runs = grouped(p.map(run, jobs))
    path = Path(__file__).parent / "summary.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    for n, by in runs.items():
        out[n] = {label: {
            "tokens_per_s": median(rows, lambda r: r["throughput_tokens_per_s"]),
            "over_sync": median(rows, lambda r: r["over_sync"]),
            "window_wait": median(rows, lambda r: r["trainer_wait_fraction"]["window"]),
            "tail_wait": median(rows, lambda r: r["trainer_wait_fraction"]["tail"]),
            "migrations": median(rows, lambda r: r["migrations"]),
            "publish_gb_per_step_per_trainer_rank": median(
                rows, lambda r: r["weights"]["publish_gb_per_step_per_trainer_rank"]),
            "weight_load_s_per_step": median(rows, lambda r: r["weights"]["weight_load_s_per_step"]),
            "max_staleness": max(r["max_staleness"] for r in rows),
            "invariants_broken": sum(r[k] for r in rows for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                                  "mixed_version_trajectories")),
            "seeds": rows} for label, rows in by.items()}
        d, lo = out[n]["dora"], out[n]["dora lora"]
        out[n]["lora_over_full"] = lo["tokens_per_s"] / d["tokens_per_s"]
    path.write_text(json.dumps(out, indent=1) + "\n")
