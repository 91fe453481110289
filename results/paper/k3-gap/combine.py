"""The K=3 gap with the correction on 9 seeds (issue 33): seeds 0-2 from results/bench/convergence-offpolicy/lr0.002
and seeds 3-8 from a new `bench convergence` run, both sync and DORA K=3 under decoupled+truncate, toy task,
lr 2e-3, 30 steps. Writes summary.json here (tools/paper_report.py reads it).

    .venv/bin/python results/paper/k3-gap/combine.py results/paper/k3-gap/bench-seeds3-8.json  # the new run
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
OLD = ROOT / "results/bench/convergence-offpolicy/lr0.002/summary.json"
COMMAND = (".venv/bin/dora-hpc bench convergence configs/bench-convergence.yaml --losses decoupled+truncate "
           "--cases sync,dora-k3 --seeds 3,4,5,6,7,8 --set train.lr=0.002")
CASES = ("sync decoupled+truncate", "dora-k3 decoupled+truncate")


def final(summary: dict, case: str) -> dict[int, float]:
    """A case's final reward by seed in a bench summary; a one-loss run names its cases without the loss."""
    c = summary["cases"].get(case) or summary["cases"][case.split()[0]]
    return dict(zip(summary["seeds"], c["final_by_seed"], strict=True))


def main(new_path: str) -> None:
    old, new = json.loads(OLD.read_text()), json.loads(Path(new_path).read_text())
    by_case = {c: {**final(old, c), **final(new, c)} for c in CASES}
    sync, dora = (by_case[c] for c in CASES)
    seeds = sorted(sync)
    paired = [dora[s] - sync[s] for s in seeds]
    out = {"seeds": seeds, "tail_steps": new["tail_steps"], "sync_final_by_seed": [sync[s] for s in seeds],
           "dora_k3_final_by_seed": [dora[s] for s in seeds],
           "sync_mean": statistics.mean(sync.values()), "dora_k3_mean": statistics.mean(dora.values()),
           "gap": statistics.mean(dora.values()) - statistics.mean(sync.values()),
           "sync_spread": max(sync.values()) - min(sync.values()),
           "sync_sd": statistics.stdev(sync.values()), "dora_k3_sd": statistics.stdev(dora.values()),
           "gap_se": (statistics.variance(sync.values()) / len(sync)
                      + statistics.variance(dora.values()) / len(dora)) ** 0.5,
           "paired_gap_median": statistics.median(paired), "paired_gap_by_seed": paired,
           "new_seeds_only_gap": statistics.mean(dora[s] for s in new["seeds"]) - statistics.mean(
               sync[s] for s in new["seeds"]),
           "seconds_per_step": {c.split()[0]: new["cases"][c.split()[0]]["seconds_per_step"] for c in CASES},
           "command": COMMAND}
    (HERE / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
