"""agentic-64 under the simulator that steps the environment after an episode's last turn (2026-12-03): sync,
partial, DORA and DORA elastic on seeds 0-2, with the planner A/B's runner and window (40 steps, the first 2K
left out). Seed 0's sync and DORA come from rerun-2026-12-03.json (the same code path: since then only the
start's byte counters changed, not a time).

    .venv/bin/python results/sim/agentic-64/seeds.py     # ~60 min on 2 cores; writes seeds.json
"""

import json
import statistics
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.sim.sweeps import run

HERE = Path(__file__).resolve().parent

LABELS = ("sync", "partial", "dora", "dora elastic")
SEEDS = (0, 1, 2)


def job(j: tuple[str, int]):
    label, seed = j
    return label, seed, run(("agentic-64", label, seed))[2]


if __name__ == "__main__":
    done = json.loads((HERE / "rerun-2026-12-03.json").read_text())
    rows = {(label, 0): done[label] for label in ("sync", "dora")}
    todo = [(label, s) for s in SEEDS for label in LABELS if (label, s) not in rows]
    todo.sort(key=lambda j: (j[0] not in ("dora elastic", "partial"), j[1]))  # the longest first
    with Pool(2) as p:
        for label, seed, row in p.imap_unordered(job, todo):
            rows[(label, seed)] = row
    out: dict = {}
    for label in LABELS:
        runs = [rows[(label, s)] | {"over_sync": rows[(label, s)]["throughput_tokens_per_s"]
                                    / rows[("sync", s)]["throughput_tokens_per_s"],
                                    "over_partial": rows[(label, s)]["throughput_tokens_per_s"]
                                    / rows[("partial", s)]["throughput_tokens_per_s"]} for s in SEEDS]
        out[label] = {"median": {k: statistics.median(r[k] for r in runs)
                                 for k in ("throughput_tokens_per_s", "over_sync", "over_partial", "limit_share")},
                      "seeds": runs}
    (HERE / "seeds.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
