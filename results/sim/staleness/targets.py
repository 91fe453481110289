"""The issue's simulator targets, 3 seeds, steady state, K=3 (K=4 for long reasoning, its own): lean admission
against eager (tokens/s share and mean staleness), and DORA against partial rollout at the config's split
(eager's ratio and lean's). Each workload's runs are the frontier's points (dora_hpc/sim/frontier.py).

    .venv/bin/python results/sim/staleness/targets.py [SEEDS [WORKERS]] > results/sim/staleness/targets.json
    (SEEDS default 0,1,2; WORKERS default 2)
"""

import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

from dora_hpc.config import load_config
from dora_hpc.sim.frontier import run_point

LONG = ["workload.response_len.median=2000", "workload.response_len.sigma=1.2",
        "workload.response_len.max=32768", "dora.k=4"]
WORKLOADS = {"paper-64": ("configs/sim/paper-64.yaml", []), "paper-128": ("configs/sim/paper-128.yaml", []),
             "long-reasoning-64": ("configs/sim/paper-64.yaml", LONG),
             "agentic-64": ("configs/sim/agentic-64.yaml", [])}
POINTS = {"partial": {"mode": "partial", "changes": {}},
          "eager": {"mode": "dora", "changes": {"dora.admission": "eager"}},
          "lean": {"mode": "dora", "changes": {"dora.admission": "lean"}}}
SEEDS = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (0, 1, 2)
WORKERS = int(sys.argv[2]) if len(sys.argv) > 2 else 2


def run_all(workloads: dict, points: dict, seeds: tuple[int, ...], workers: int) -> dict:
    """{(workload, point, seed): run_point's figures} for every combination, ``workers`` simulators at once."""
    jobs = {(w, p, s): (load_config(path, sets), points[p], s)
            for w, (path, sets) in workloads.items() for p in points for s in seeds}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(run_point, *args) for key, args in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def main() -> None:
    runs = run_all(WORKLOADS, POINTS, SEEDS, WORKERS)
    out = {}
    for w in WORKLOADS:
        r = {p: [runs[(w, p, s)] for s in SEEDS] for p in POINTS}
        tput = {p: [x["throughput_tokens_per_s"] for x in r[p]] for p in POINTS}
        share = [a / b for a, b in zip(tput["lean"], tput["eager"], strict=True)]
        out[w] = {"runs": r,
                  "lean_over_eager": {"by_seed": share, "median": statistics.median(share)},
                  "mean_staleness": {p: statistics.median(x["mean_staleness"] for x in r[p])
                                     for p in ("eager", "lean")},
                  "dora_over_partial": {p: statistics.median(a / b for a, b in zip(tput[p], tput["partial"],
                                                                                 strict=True))
                                        for p in ("eager", "lean")}}
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
