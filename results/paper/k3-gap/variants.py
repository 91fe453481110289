"""What closes the K=3 gap (issue 33): DORA K=3 at equal steps and seeds (3-8) under three changes, each
against the documented setting (decoupled+truncate, is_cap 2, lr 2e-3): AReaL's M2PO mask, a tighter
truncation cap (is_cap 1), and half the learning rate. Each benchmark ran its own sync beside it. Writes
variants.json here.

    B=".venv/bin/dora-hpc bench convergence configs/bench-convergence.yaml --cases sync,dora-k3 --seeds 3,4,5,6,7,8"
    $B --losses decoupled+m2po --set train.lr=0.002 --out runs/k3-m2po             # ~16 min each
    $B --losses decoupled+truncate --set train.lr=0.002 --set train.is_cap=1.0 --out runs/k3-cap1
    $B --losses decoupled+truncate --set train.lr=0.001 --out runs/k3-lr1e-3
    cp runs/k3-m2po/summary.json results/paper/k3-gap/bench-m2po-seeds3-8.json      # and likewise cap1, lr1e-3
    .venv/bin/python results/paper/k3-gap/variants.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from combine import final  # noqa: E402

BASE = "bench-seeds3-8.json"  # decoupled+truncate, is_cap 2, lr 2e-3
VARIANTS = {"m2po": "bench-m2po-seeds3-8.json", "is_cap 1": "bench-cap1-seeds3-8.json",
            "lr 1e-3": "bench-lr1e-3-seeds3-8.json"}


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float]:
    """Mean of a - b over the seeds, and its standard error."""
    d = [a[s] - b[s] for s in sorted(a)]
    return statistics.mean(d), statistics.stdev(d) / len(d) ** 0.5


if __name__ == "__main__":
    base = json.loads((HERE / BASE).read_text())
    sync0, dora0 = final(base, "sync"), final(base, "dora-k3")
    out: dict = {"seeds": sorted(dora0), "base": {"sync": sync0, "dora-k3": dora0,
                                                  "gap": paired(dora0, sync0)[0]}, "variants": {}}
    for name, file in VARIANTS.items():
        if not (HERE / file).exists():
            continue
        v = json.loads((HERE / file).read_text())
        sync, dora = final(v, "sync"), final(v, "dora-k3")
        gap, gap_se = paired(dora, sync)
        gain, gain_se = paired(dora, dora0)
        out["variants"][name] = {"sync": sync, "dora-k3": dora, "sync_mean": statistics.mean(sync.values()),
                                 "dora_k3_mean": statistics.mean(dora.values()), "gap_to_own_sync": gap,
                                 "gap_se": gap_se, "minus_base_dora_k3": gain, "minus_base_se": gain_se,
                                 "minus_base_sync": paired(sync, sync0)[0]}
    (HERE / "variants.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, r in out["variants"].items():
        print(f"{name}: DORA K=3 {r['dora_k3_mean']:.3f} (sync {r['sync_mean']:.3f}, gap {r['gap_to_own_sync']:+.3f} "
              f"se {r['gap_se']:.3f}); against the base DORA K=3 {r['minus_base_dora_k3']:+.3f} "
              f"se {r['minus_base_se']:.3f}; its sync against the base sync {r['minus_base_sync']:+.3f}")
