"""Issue 43, item 4: the planner by pending work (``dora.planner: work``, core/work.py) against today's count of
pending requests (``proportional``), under both admissions, on every workload of targets.py plus the heavy
tail, steady state, DORA at the workload's K (3; long reasoning 4).

    .venv/bin/python results/sim/staleness/planner_ab.py [SEEDS [WORKERS]] > results/sim/staleness/planner_ab.json
    (SEEDS default 0; WORKERS default 2)
"""

import json
import statistics
import sys

from targets import LONG, run_all

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
    runs = run_all(WORKLOADS, POINTS, SEEDS, WORKERS)
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
