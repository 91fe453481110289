"""Which shape of configs/bench-long-context-smollm2.yaml migrates >= 20 times in a run, and how long such a
run takes on this machine: the simulator fitted to a real run of it (dora-hpc plan's fit: engine step,
train seconds a token, weight loads, the logged length distributions), 3 seeds a setting.

    .venv/bin/dora-hpc run configs/bench-long-context-smollm2.yaml --set cluster.max_num_seqs=2 --run-dir runs/2slots
    .venv/bin/python results/bench/ablation-long-context-smollm2/migrations_sweep.py runs/2slots \
        results/bench/ablation-long-context-smollm2
"""

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dora_hpc.config import with_overrides  # noqa: E402
from dora_hpc.sim.fit import fit_run, simulate  # noqa: E402

run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
fit = fit_run(run_dir)
grid = [(k, tbs, slots, steps) for k in (1, 3) for tbs in (2, 4) for slots in (1, 2, 4, 8) for steps in (12, 24)]
rows = []
for k, tbs, slots, steps in grid:
    sets = {"dora.k": k, "batch.tbs": tbs, "batch.rbs": (k + 1) * tbs, "cluster.max_num_seqs": slots,
            "sim.steps": steps}
    sims = []
    for seed in (0, 1, 2):
        cfg = with_overrides(fit.cfg, sets | {"seed": seed})
        sims.append(simulate(replace(fit, cfg=cfg), cfg))
    rows.append({"set": sets, "migrations": [s["migrations"] for s in sims],
                 "run_min": round(statistics.median(s["sim_time_s"] for s in sims) / 60, 1),
                 "step_s": round(statistics.median(s["mean_step_time_s"] for s in sims), 1)})
check = simulate(fit, fit.cfg)  # the run as it ran (plan's fit check)
summary = {"fit_from": "configs/bench-long-context-smollm2.yaml --set cluster.max_num_seqs=2 (12 steps)",
           "fitted": fit.fitted, "measured_step_s": fit.measured_step_s,
           "simulated_step_s_as_run": check["mean_step_time_s"], "simulated_migrations_as_run": check["migrations"],
           "rows": rows}
(out / "migrations_sweep.json").write_text(json.dumps(summary, indent=1) + "\n")

fig, ax = plt.subplots(figsize=(8, 5))
for r in rows:
    s = r["set"]
    ax.scatter(r["run_min"], statistics.median(r["migrations"]), c=f"C{s['cluster.max_num_seqs'].bit_length() - 1}",
               marker="o" if s["dora.k"] == 3 else "s", s=20 + 20 * s["batch.tbs"], alpha=0.8)
for slots in (1, 2, 4, 8):
    ax.scatter([], [], c=f"C{slots.bit_length() - 1}", label=f"{slots} slot{'s' if slots > 1 else ''} an instance")
ax.axhline(20, color="grey", ls="--", lw=1)
ax.set_xlabel("simulated run length on this machine (min)")
ax.set_ylabel("migrations a run (median of 3 seeds)")
ax.set_title("SmolLM2 long contexts, 4 instances: o K=3, s K=1; bigger = TBS 4 (else 2); 12 or 24 steps", fontsize=9)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out / "migrations_sweep.png", dpi=120)
print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
