"""Issue 43, item 4: the planner by pending work (``dora.planner: work``, core/work.py) against today's count of
pending requests (``proportional``), under both admissions, on every workload of targets.py plus the heavy
tail, steady state, DORA at the workload's K (3; long reasoning 4).

    .venv/bin/python results/sim/staleness/planner_ab.py [SEEDS [WORKERS]] > results/sim/staleness/planner_ab.json
    (SEEDS default 0; WORKERS default 2)
"""

import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

from targets import LONG

from dora_hpc.config import load_config
from dora_hpc.sim.frontier import run_point

WORKLOADS = {"paper-64": ("configs/sim/paper-64.yaml", []), "paper-128": ("configs/sim/paper-128.yaml", []),
             "long-reasoning-64": ("configs/sim/paper-64.yaml", LONG),
             "agentic-64": ("configs/sim/agentic-64.yaml", []),
             "heavy-tail-64": ("configs/sim/paper-64.yaml", ["workload.response_len.sigma=1.5",
                                                            "workload.response_len.max=65536"])}
POINTS = {f"{adm}-{planner}": {"mode": "dora", "changes": {"dora.admission": adm, "dora.planner": planner}}
          for adm in ("eager", "lean") for planner in ("proportional", "work")}
SEEDS = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (0,)
WORKERS = int(sys.argv[2]) if len(sys.argv) > 2 else 2


def main() -> None:
    jobs = {(w, p, s): (load_config(path, sets), POINTS[p], s)
            for w, (path, sets) in WORKLOADS.items() for p in POINTS for s in SEEDS}
    with ProcessPoolExecutor(max_workers=WORKERS) as pool:
        futures = {key: pool.submit(run_point, *args) for key, args in jobs.items()}
        runs = {key: f.result() for key, f in futures.items()}
    out = {}
    for w in WORKLOADS:
        r = {p: [runs[(w, p, s)] for s in SEEDS] for p in POINTS}
        med = {p: {k: statistics.median(x[k] for x in r[p]) for k in ("throughput_tokens_per_s", "mean_staleness")}
               for p in POINTS}
        out[w] = {"runs": r, "medians": med,
                  "work_over_proportional": {adm: med[f"{adm}-work"]["throughput_tokens_per_s"]
                                             / med[f"{adm}-proportional"]["throughput_tokens_per_s"]
                                             for adm in ("eager", "lean")}}
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
