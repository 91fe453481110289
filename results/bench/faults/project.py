"""Issue 47, item 4: the cost of node failures projected to the paper's production scale with the simulator.

The simulator gives the production point's throughput (configs/sim/production-4096.yaml: a 560B MoE on 4,096
accelerators, 48 rollout instances of 32, long reasoning, DORA K=3) with every instance and with one fewer,
and its step time. The rest are stated assumptions (ASSUME, each with its source); none is fitted to anything.

Per failure:
* requeue-and-resume (every failure today, and a trainer node's under fencing): the whole job stops for the
  restart, and the steps since the last checkpoint are trained again (half an interval on average);
* fenced-and-continue (a rollout node's, ``slurm.fence_rollout``): the run waits at most the hang timeout on
  what the lost instance held, then runs one instance short until a replacement joins.

    .venv/bin/python results/bench/faults/project.py > results/bench/faults/projection.json   # ~2 min
"""

import json
import statistics
import sys

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

CONFIG = "configs/sim/production-4096.yaml"
SEEDS = (0, 1, 2)
ASSUME = {
    # Llama 3 (arXiv 2407.21783, Table 5): 419 unexpected interruptions in a 54-day snapshot on up to 16,384
    # H100s, 78% of them hardware; scaled to 4,096 accelerators
    "failures_per_day": 419 / 54 * 4096 / 16384,
    "accelerators_per_node": 8,
    # a requeued start of 4,096 ranks: scheduling, MPI_Init, 1.12 TB of weights loaded by every instance and
    # trainer, the pipeline refilling (our 6-rank start on the local cluster takes ~10 s; this is a guess)
    "restart_s": 15 * 60,
    "checkpoint_every_steps": 10,          # train.checkpoint_every's default
    "hang_timeout_s": 120,                 # runtime.hang_timeout_s's default: the longest wait on a dead node
    "replacement_after_s": {"spare node": 600, "node repaired": 4 * 3600, "none (rest of a day)": 12 * 3600},
}


def simulate(instances: int, seed: int) -> dict:
    cfg = load_config(CONFIG, [f"seed={seed}", f"cluster.rollout_instances={instances}"])
    s = summarize(Simulator(cfg, "dora", timeline=False).run())
    return {"throughput_tokens_per_s": s["throughput_tokens_per_s"], "mean_step_time_s": s["mean_step_time_s"]}


def main() -> None:
    full_n = load_config(CONFIG).cluster.rollout_instances
    runs = {n: [simulate(n, s) for s in SEEDS] for n in (full_n, full_n - 1)}
    full = statistics.median(r["throughput_tokens_per_s"] for r in runs[full_n])
    short = statistics.median(r["throughput_tokens_per_s"] for r in runs[full_n - 1])
    step_s = statistics.median(r["mean_step_time_s"] for r in runs[full_n])
    cfg = load_config(CONFIG)
    rollout_share = cfg.cluster.rollout_instances * cfg.cluster.accelerators_per_instance / cfg.cluster.accelerators
    requeue_s = ASSUME["restart_s"] + ASSUME["checkpoint_every_steps"] * step_s / 2  # full-rate seconds lost
    one_short = 1 - short / full  # the share of throughput an instance fewer costs
    day = 86400
    out = {"what": __doc__.split("\n\n")[0], "assumptions": ASSUME, "simulated": runs,
           "throughput_full": full, "throughput_one_instance_fewer": short, "share_lost_one_instance_fewer": one_short,
           "step_s": step_s, "rollout_share_of_nodes": rollout_share, "requeue_cost_s": requeue_s,
           "goodput_lost_per_day": {}}
    f = ASSUME["failures_per_day"]
    out["goodput_lost_per_day"]["requeue every failure"] = f * requeue_s / day
    for name, after in ASSUME["replacement_after_s"].items():
        fenced_s = ASSUME["hang_timeout_s"] + one_short * after
        out["goodput_lost_per_day"][f"fence rollout nodes, replacement: {name}"] = (
            f * (rollout_share * fenced_s + (1 - rollout_share) * requeue_s) / day)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
