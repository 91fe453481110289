"""The KV-reuse ablation at paper scale in the simulator (issue 33; the paper's Fig. 13: 183 s -> 166 s,
re-prefill / KV 1.10x): DORA migrating requests with their KV (``dora.kv_migration: true``, the default)
against migrating them by re-prefill, on paper-64, paper-128 and the long-reasoning workload of the planner
A/B, 3 seeds each, the same seed for both variants. Steady state: 40 steps, the first 2K left out.

    .venv/bin/python results/sim/kv-ablation/kv_ablation.py     # ~10 min on 2 cores; writes summary.json
"""

from __future__ import annotations

import json
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize
from dora_hpc.sim.sweeps import SCENARIOS as ALL
from dora_hpc.sim.sweeps import SEEDS, steady

HERE = Path(__file__).resolve().parent
SCENARIOS = {name: ALL[name] for name in ("paper-64", "paper-128", "long reasoning")}
VARIANTS = {"kv": "dora.kv_migration=true", "reprefill": "dora.kv_migration=false"}
KEYS = ("mean_step_time_s", "throughput_tokens_per_s", "migrations", "reprefill_tokens", "rollout_only_fraction",
        "trainer_wait_fraction", "overheads", "max_staleness", "lost_groups", "duplicate_groups",
        "mixed_version_trajectories")


def simulate(job: tuple[str, str, int]) -> tuple[str, str, int, dict]:
    name, variant, seed = job
    cfg = steady(name, [VARIANTS[variant]], seed)
    s = summarize(Simulator(cfg, "dora", timeline=False).run())
    print(name, variant, seed, round(s["mean_step_time_s"], 1), s["migrations"], s["reprefill_tokens"], flush=True)
    return name, variant, seed, {key: s[key] for key in KEYS}


def main() -> None:
    jobs = [(name, v, base + i) for name, (_, _, base, _) in SCENARIOS.items() for i in range(SEEDS)
            for v in VARIANTS]
    with Pool(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as pool:
        done = pool.map(simulate, jobs)
    runs: dict = {}
    for name, variant, seed, row in done:
        runs.setdefault(name, {}).setdefault(str(seed), {})[variant] = row
    out = {"what": __doc__.split("\n\n")[0], "seeds": sorted({seed for _, _, seed in jobs}), "scenarios": {}}
    for name, by_seed in runs.items():
        ratios = [r["reprefill"]["mean_step_time_s"] / r["kv"]["mean_step_time_s"] for r in by_seed.values()]
        out["scenarios"][name] = {
            "step_time_ratio_reprefill_over_kv": statistics.median(ratios),
            "step_time_ratio_by_seed": ratios,
            "median": {v: {k: statistics.median(r[v][k] for r in by_seed.values())
                           for k in ("mean_step_time_s", "migrations", "reprefill_tokens", "rollout_only_fraction")}
                       for v in VARIANTS},
            "runs": by_seed}
        print(name, "re-prefill / KV step time:", [round(x, 3) for x in ratios])
    (HERE / "summary.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
