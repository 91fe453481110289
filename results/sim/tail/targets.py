"""Issue 53's simulator targets at the defaults (dora.admission: lean since this issue), steady state, 3 seeds:
sync, DORA, DORA under eager admission, and DORA with borrowed instances (cluster.elastic, off by default), each
seed against its own sync run. Writes JSON on stdout.

    .venv/bin/python results/sim/tail/targets.py [SEEDS [WORKERS]] > results/sim/tail/targets.json   # ~60 min

Each run's figures are appended to targets.jsonl beside this file as it ends (a rerun skips the runs found there).

Rollout speed-up (the production rows, as results/sim/production-4096 reports it): sync's rollout-only seconds per
step over DORA's. Trainer waits: the window's and the tail's shares of the measured window, summed.
"""

import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

HEAVY = ["workload.response_len.sigma=1.6", "workload.response_len.max=65536", "dora.k=6", "sim.warmup_steps=12"]
WORKLOADS = {  # name -> (config, the workload's shape, its base seed)
    "paper-64": ("configs/sim/paper-64.yaml", [], 0),
    "paper-128": ("configs/sim/paper-128.yaml", [], 0),
    "heavy tail": ("configs/sim/paper-64.yaml", HEAVY, 7),  # results/sim/elastic's heavy tail and base seed
    "production reasoning": ("configs/sim/production-4096.yaml", [], 0),
    "production agentic": ("configs/sim/production-4096-agentic.yaml", [], 0),
}
POINTS = {"sync": ("sync", []), "dora": ("dora", []), "dora elastic": ("dora", ["cluster.elastic=true"])}
LOG = Path(__file__).resolve().parent / "targets.jsonl"
SEEDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
WORKERS = int(sys.argv[2]) if len(sys.argv) > 2 else 2


def job(key: tuple[str, str, int]) -> dict:
    w, p, seed = key
    path, shape, _ = WORKLOADS[w]
    mode, sets = POINTS[p]
    s = summarize(Simulator(load_config(path, [*shape, *sets, f"seed={seed}"]), mode, timeline=False).run())
    waits = s["trainer_wait_fraction"]
    return {"seed": seed, "throughput_tokens_per_s": s["throughput_tokens_per_s"],
            "mean_staleness": s["mean_staleness_steady"], "max_staleness": s["max_staleness"],
            "trainer_wait_fraction": waits, "window_and_tail": waits["window"] + waits["tail"],
            "rollout_only_s_per_step": s["rollout_only_fraction"] * s["mean_step_time_s"],
            "admission_cap_tbs": (s["admission_cap"] or {}).get("mean_tbs"),
            "invariants": {k: s[k] for k in ("lost_groups", "duplicate_groups", "mixed_version_trajectories")}}


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def main() -> None:
    keys = [(w, p, WORKLOADS[w][2] + i) for w in WORKLOADS for p in POINTS for i in range(SEEDS)]
    done = [json.loads(line) for line in LOG.read_text().splitlines()] if LOG.exists() else []
    runs = {tuple(d["key"]): d["figures"] for d in done}
    with ProcessPoolExecutor(max_workers=WORKERS) as pool, LOG.open("a") as log:
        futures = {pool.submit(job, k): k for k in keys if k not in runs}
        for f in as_completed(futures):
            runs[futures[f]] = f.result()
            log.write(json.dumps({"key": list(futures[f]), "figures": runs[futures[f]]}) + "\n")
            log.flush()
    out = {}
    for w in WORKLOADS:
        r = {p: [runs[(w, p, WORKLOADS[w][2] + i)] for i in range(SEEDS)] for p in POINTS}
        row = {"runs": r}
        for p in POINTS:
            if p == "sync":
                continue
            pairs = list(zip(r[p], r["sync"], strict=True))
            over = [ratio(a["throughput_tokens_per_s"], b["throughput_tokens_per_s"]) for a, b in pairs]
            speed = [ratio(b["rollout_only_s_per_step"], a["rollout_only_s_per_step"]) for a, b in pairs]
            row[p] = {"over_sync": _median(over), "over_sync_by_seed": over, "rollout_speedup": _median(speed),
                      "mean_staleness": statistics.median(x["mean_staleness"] for x in r[p]),
                      "window_and_tail": statistics.median(x["window_and_tail"] for x in r[p])}
        out[w] = row
    json.dump(out, sys.stdout, indent=2)
    print()


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


if __name__ == "__main__":
    main()
