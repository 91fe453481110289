"""DORA's rollout speed-up over sync against K on production-4096 (seed 0): where the trainer waits for the
window's oldest groups, a step lasts at least the longest trajectory's time / (K + 1), so sync / DORA stays
under K + 1. Sync does not depend on K: its seed-0 figures come from summary.json. Writes ksweep.json.

    .venv/bin/python results/sim/production-4096/ksweep.py     # ~15 min on 2 cores
"""

import json
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

HERE = Path(__file__).resolve().parent
CONFIGS = {"reasoning": "configs/sim/production-4096.yaml", "agentic": "configs/sim/production-4096-agentic.yaml"}
KS = {"reasoning": (1, 6), "agentic": (6,)}


def job(j: tuple[str, int]) -> tuple[str, int, dict]:
    workload, k = j
    s = summarize(Simulator(load_config(CONFIGS[workload], [f"dora.k={k}"]), "dora", timeline=False).run())
    return workload, k, {"throughput_tokens_per_s": s["throughput_tokens_per_s"],
                         "mean_step_time_s": s["mean_step_time_s"],
                         "rollout_only_s_per_step": s["rollout_only_fraction"] * s["mean_step_time_s"],
                         "window_wait": s["trainer_wait_fraction"]["window"], "max_staleness": s["max_staleness"]}


if __name__ == "__main__":
    base = json.loads((HERE / "summary.json").read_text())
    out: dict = {}
    with Pool(2) as p:
        for workload, k, row in p.imap_unordered(job, [(w, k) for w in CONFIGS for k in KS[w]]):
            out.setdefault(workload, {})[k] = row
    for w in CONFIGS:
        sync, dora3 = (base[w][c]["seeds"][0] for c in ("sync", "dora"))
        out[w][3] = {k: dora3[k] for k in ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_s_per_step",
                                           "max_staleness")} | {"window_wait": dora3["trainer_wait_fraction"]["window"]}
        for row in out[w].values():
            row["rollout_speedup"] = sync["rollout_only_s_per_step"] / row["rollout_only_s_per_step"]
        out[w] = dict(sorted(out[w].items()))
    (HERE / "ksweep.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
