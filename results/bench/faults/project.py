"""Issue 47, item 4: the cost of node failures projected to the paper's production scale with the simulator.

The simulator gives the production point's throughput (configs/sim/production-4096.yaml: a 560B MoE on 4,096
accelerators, 48 rollout instances of 32, long reasoning, DORA K=3) with every instance and with one fewer,
and its step time. The rest are stated assumptions (ASSUME, each with its source); none is fitted to anything.

Per failure:
* requeue-and-resume (every failure today, and a trainer node's under fencing): the whole job stops for the
  restart, and the steps since the last checkpoint are trained again (half an interval on average);
* fenced-and-continue (a rollout node's, ``slurm.fence_rollout``): the run waits at most the hang timeout on
  what the lost instance held, then runs one instance short until a replacement joins;
* a trainer node's under fault-tolerant replicas (``train.replicas``, issue 56): the survivors' collective
  gives up after ``train.replica_timeout_s`` (a dead node closes no socket), they take the step again (half a
  step lost on average), then the trainer runs one replica group short until a replacement joins. The
  orchestrator's node still requeues the job.

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
    # issue 56: the trainer's 2,560 accelerators as 8 replica groups of 320 (40 nodes each; a guess: the
    # production point's trainer sharding is not modelled); a lost node takes its whole group
    "trainer_replicas": 8,
    "replica_timeout_s": 60,              # train.replica_timeout_s's default: a dead node's collective
    "orchestrator_nodes": 1,              # rank 0 (and the lighthouse): its node's loss still requeues
    # measured on the namespaced cluster (results/bench/faults/README.md): with trajectories over MPI a
    # replica's death took rollout ranks on other nodes along (MPICH OFI) and requeued the job in 4 of 9
    # kills; over gloo (runtime/trajectory_channel.py) in 0 of 8
    "replica_death_requeues": {"as measured": 4 / 9, "trajectories outside MPI": 0.0},
}


def simulate(instances: int, seed: int, accelerators: int | None = None) -> dict:
    sets = [f"seed={seed}", f"cluster.rollout_instances={instances}"]
    cfg = load_config(CONFIG, sets + ([f"cluster.accelerators={accelerators}"] if accelerators else []))
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
    out |= replicas(cfg, full, step_s, requeue_s, one_short, rollout_share)
    json.dump(out, sys.stdout, indent=1)
    print()


def replicas(cfg, full: float, step_s: float, requeue_s: float, one_short: float, rollout_share: float) -> dict:
    """Issue 56: the same day with trainer nodes' failures fenced too (fault-tolerant trainer replicas)."""
    r, nodes = ASSUME["trainer_replicas"], cfg.cluster.accelerators / ASSUME["accelerators_per_node"]
    trainer_accels = cfg.cluster.accelerators - cfg.cluster.rollout_instances * cfg.cluster.accelerators_per_instance
    short_accels = cfg.cluster.accelerators - trainer_accels // r  # one replica group fewer
    runs = [simulate(cfg.cluster.rollout_instances, s, short_accels) for s in SEEDS]
    short = statistics.median(x["throughput_tokens_per_s"] for x in runs)
    replica_short = 1 - short / full
    orchestrator_share = ASSUME["orchestrator_nodes"] / nodes
    trainer_share = 1 - rollout_share - orchestrator_share
    f, day, lost = ASSUME["failures_per_day"], 86400, {}
    for name, after in ASSUME["replacement_after_s"].items():
        rollout_s = ASSUME["hang_timeout_s"] + one_short * after
        fenced_s = ASSUME["replica_timeout_s"] + step_s / 2 + replica_short * after
        for how, p in ASSUME["replica_death_requeues"].items():
            trainer_s = p * requeue_s + (1 - p) * fenced_s
            lost[f"fence rollout and trainer nodes ({how}), replacement: {name}"] = f * (
                rollout_share * rollout_s + trainer_share * trainer_s + orchestrator_share * requeue_s) / day
    return {"simulated_one_replica_group_fewer": runs, "throughput_one_replica_group_fewer": short,
            "share_lost_one_replica_group_fewer": replica_short, "trainer_share_of_nodes": trainer_share,
            "orchestrator_share_of_nodes": orchestrator_share, "goodput_lost_per_day_with_trainer_replicas": lost}


if __name__ == "__main__":
    main()
