"""The M2PO A/B at K=3 (issue 33): DORA K=3 under decoupled+m2po against decoupled+truncate, seeds 3-8, equal
steps, each run's sync beside it. Writes m2po.json here.

    .venv/bin/dora-hpc bench convergence configs/bench-convergence.yaml --losses decoupled+m2po \\
        --cases sync,dora-k3 --seeds 3,4,5,6,7,8 --set train.lr=0.002 --out runs/k3-m2po
    cp runs/k3-m2po/summary.json results/paper/k3-gap/bench-m2po-seeds3-8.json
    .venv/bin/python results/paper/k3-gap/m2po.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from combine import final  # noqa: E402

if __name__ == "__main__":
    trunc, m2po = (json.loads((HERE / f).read_text()) for f in ("bench-seeds3-8.json", "bench-m2po-seeds3-8.json"))
    runs = {"sync (truncate run)": final(trunc, "sync"), "dora-k3 truncate": final(trunc, "dora-k3"),
            "sync (m2po run)": final(m2po, "sync"), "dora-k3 m2po": final(m2po, "dora-k3")}
    seeds = sorted(runs["dora-k3 m2po"])
    diff = [runs["dora-k3 m2po"][s] - runs["dora-k3 truncate"][s] for s in seeds]
    out = {"seeds": seeds, "final_by_seed": {k: [v[s] for s in seeds] for k, v in runs.items()},
           "mean": {k: statistics.mean(v.values()) for k, v in runs.items()},
           "m2po_minus_truncate": statistics.mean(diff),
           "m2po_minus_truncate_se": statistics.stdev(diff) / len(diff) ** 0.5}
    (HERE / "m2po.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "final_by_seed"}, indent=1))
