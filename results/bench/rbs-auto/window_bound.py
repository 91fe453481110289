"""How far admission can lift slot utilization on the bench-modes workload: the simulator fitted to one of
this folder's logged `rbs: auto` runs (`dora_hpc.sim.fit`, the model `dora-hpc plan` uses), re-simulated
with `batch.rbs: auto` at several K, with the fitted trainer and with a trainer 100x faster. Simulated
time only; each run is 30 steps after a warm-up of 2K.

    .venv/bin/python results/bench/rbs-auto/window_bound.py [RUN_DIR]    # ~5 min; writes window_bound.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from dora_hpc.config import with_overrides
from dora_hpc.sim.fit import fit_run, simulate

HERE = Path(__file__).resolve().parent
KS = (2, 3, 4, 6, 8, 12, 16)
TRAINERS = {"fitted": 1.0, "100x faster": 100.0}


def main() -> None:
    run = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "runs" / "dora-k2-auto-r0"
    fit = fit_run(run)
    again = simulate(fit, fit.cfg)
    rows = []
    for label, speedup in TRAINERS.items():
        cost = replace(fit.cost, train_flops_per_accel=fit.cost.train_flops_per_accel * speedup)
        for k in KS:
            c = with_overrides(fit.cfg, {"dora.k": k, "batch.rbs": "auto", "sim.steps": 30 + 2 * k,
                                         "sim.warmup_steps": 2 * k})
            s = simulate(replace(fit, cfg=c, cost=cost), c)
            rows.append({"trainer": label, "k": k, "slot_utilization": s["slot_utilization"],
                         "tokens_per_s": s["throughput_tokens_per_s"], "trainer_wait": s["trainer_wait_fraction"]})
            print(f"trainer {label:12s} K={k:2d}  slot utilization {s['slot_utilization']:.3f}  "
                  f"window wait {s['trainer_wait_fraction']['window']:.2f}", flush=True)
    out = {"run_dir": str(run.relative_to(HERE)) if run.is_relative_to(HERE) else str(run),
           "fitted": fit.fitted, "refit_slot_utilization": again["slot_utilization"],
           "refit_step_s": again["mean_step_time_s"], "measured_step_s": fit.measured_step_s, "rows": rows}
    (HERE / "window_bound.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
