"""The paper's production point (§4.5, Fig. 13) in the simulator: LongCat-Flash (560B MoE, 27B active) on 4,096
accelerators, long reasoning and agentic episodes, sync against DORA and DORA with cluster.elastic, on seeds
0-2, and long reasoning again at 4x the batch (the paper gives no production batch). Writes summary.json.

    .venv/bin/python results/sim/production-4096/production.py     # ~50 min on 2 cores

Rollout speed-up: the rollout-only time of a step (the trainer idle while instances generate, as the
paper's Fig. 10 measures it), sync's over DORA's; throughput: consumed tokens per second, DORA's over sync's.
"""

import json
import statistics
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

HERE = Path(__file__).resolve().parent
CONFIGS = {"reasoning": "configs/sim/production-4096.yaml", "agentic": "configs/sim/production-4096-agentic.yaml",
           "reasoning, 4x batch": "configs/sim/production-4096.yaml"}
EXTRA = {"reasoning, 4x batch": ["batch.tbs=2048", "batch.rbs=3072"]}
CASES = {"sync": ("sync", []), "dora": ("dora", []), "dora elastic": ("dora", ["cluster.elastic=true"])}
SEEDS = (0, 1, 2)
KEEP = ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "trainer_wait_fraction",
        "slot_utilization", "max_staleness", "lost_groups", "duplicate_groups", "mixed_version_trajectories",
        "split_groups", "migrations", "borrowed_instances")


def job(j: tuple[str, str, int]) -> tuple[str, str, int, dict]:
    workload, case, seed = j
    mode, sets = CASES[case]
    cfg = load_config(CONFIGS[workload], [f"seed={seed}", *EXTRA.get(workload, []), *sets])
    s = summarize(Simulator(cfg, mode, timeline=False).run())
    row = {k: s[k] for k in KEEP}
    row["rollout_only_s_per_step"] = s["rollout_only_fraction"] * s["mean_step_time_s"]
    return workload, case, seed, row


def seeds_of(workload: str) -> tuple[int, ...]:
    return (0,) if workload == "reasoning, 4x batch" else SEEDS


if __name__ == "__main__":
    todo = [(w, c, s) for w in CONFIGS for s in seeds_of(w) for c in CASES]
    todo.sort(key=lambda j: j[0] != "agentic")  # the longest first
    rows: dict = {}
    with Pool(2) as p:
        for w, c, s, row in p.imap_unordered(job, todo):
            rows[(w, c, s)] = row
            print(w, c, s, round(row["throughput_tokens_per_s"]), flush=True)
    out: dict = {"paper": {"reasoning": 3.6, "agentic": 6.2}}
    for w in CONFIGS:
        out[w] = {}
        for c in CASES:
            runs = []
            for s in seeds_of(w):
                mine, sync = rows[(w, c, s)], rows[(w, "sync", s)]
                runs.append(mine | {
                    "over_sync": mine["throughput_tokens_per_s"] / sync["throughput_tokens_per_s"],
                    "rollout_speedup": sync["rollout_only_s_per_step"] / mine["rollout_only_s_per_step"]})
            out[w][c] = {"median": {k: statistics.median(r[k] for r in runs) for k in ("over_sync", "rollout_speedup")},
                         "seeds": runs}
    (HERE / "summary.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
