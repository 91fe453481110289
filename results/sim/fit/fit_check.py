"""``dora-hpc plan``'s fit check, like for like (issue 54): fresh runs of the README's command
(configs/tiny-cpu.yaml, seeds 0..N-1), each fitted by ``dora-hpc plan``; per run the measured and re-simulated
step time, trained tokens/s and the trainer's waits by kind (both sides computed by measure/ from the same
tables: the run's HDF5 logs, the re-simulation's record). Writes JSON on stdout; ``--plot OUT.png`` draws it.

    .venv/bin/python results/sim/fit/fit_check.py 5 > results/sim/fit/fit_check.json     # ~8 min on 2 cores
    .venv/bin/python results/sim/fit/fit_check.py --plot results/sim/fit/fit_check.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "dora_hpc.cli"]


def one(seed: int, tmp: Path) -> dict:
    run, out = tmp / f"run{seed}", tmp / f"plan{seed}"
    subprocess.run([*CLI, "run", "configs/tiny-cpu.yaml", "--run-dir", str(run), "--set", f"seed={seed}"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([*CLI, "plan", str(run), "--out", str(out)], cwd=REPO, check=True, capture_output=True)
    plan = json.loads((out / "plan.json").read_text())
    c = plan["fit_check"]
    return {"seed": seed, "measured_step_s": c["measured_step_s"], "simulated_step_s": c["simulated_step_s"],
            "step_error": c["relative_error"], "measured_tokens_per_s": plan["measured_tokens_per_s"],
            "simulated_tokens_per_s": c["simulated_tokens_per_s"],
            "measured_trainer_wait": c["measured_trainer_wait"], "simulated_trainer_wait": c["simulated_trainer_wait"]}


def summary(runs: list[dict]) -> dict:
    kinds = sorted({k for r in runs for k in (*r["measured_trainer_wait"], *r["simulated_trainer_wait"])})
    waits = {k: {"measured": statistics.median(r["measured_trainer_wait"].get(k, 0.0) for r in runs),
                 "simulated": statistics.median(r["simulated_trainer_wait"].get(k, 0.0) for r in runs),
                 "gap_points": statistics.median(100 * (r["simulated_trainer_wait"].get(k, 0.0)
                                                        - r["measured_trainer_wait"].get(k, 0.0)) for r in runs)}
             for k in kinds}
    return {"runs": len(runs), "median_step_error": statistics.median(r["step_error"] for r in runs),
            "median_tokens_per_s_error": statistics.median(r["simulated_tokens_per_s"] / r["measured_tokens_per_s"] - 1
                                                           for r in runs),
            "trainer_wait_by_kind": waits}


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    runs = data["runs"]
    kinds = list(data["summary"]["trainer_wait_by_kind"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / (2 * len(runs))
    for i, r in enumerate(runs):
        for j, side in enumerate(("measured", "simulated")):
            x = [k + (2 * i + j) * width for k in range(len(kinds))]
            ax.bar(x, [100 * r[f"{side}_trainer_wait"].get(k, 0.0) for k in kinds], width,
                   color="tab:blue" if side == "measured" else "tab:orange",
                   label=side if i == 0 else None)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("% of the run the trainer waits")
    ax.set_title(f"plan's fit check: the trainer's waits, measured vs re-simulated ({len(runs)} runs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    if sys.argv[1] == "--plot":
        plot(Path(sys.argv[2]))
        sys.exit(0)
    with tempfile.TemporaryDirectory() as d:
        runs = [one(seed, Path(d)) for seed in range(int(sys.argv[1]))]
    print(json.dumps({"runs": runs, "summary": summary(runs)}, indent=2))
