"""Reward per step of SmolLM2 on addition under DORA K=2, seed 0: LoRA at ranks 1, 8 and 32 (this folder's runs)
against full fine-tuning (results/bench/convergence-smollm2, seed 0), with each one's held-out greedy score.
Writes smollm2.png.

    .venv/bin/python results/bench/lora/smollm2/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
FULL = HERE.parents[1] / "convergence-smollm2"

if __name__ == "__main__":
    full = json.loads((FULL / "summary.json").read_text())["cases"]
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2.2, 1]})
    names, scores = ["initial"], [json.loads((FULL / "heldout" / "initial-s0.eval.json").read_text())["greedy"]
                                  ["mean_reward"]]
    for case in ("sync", "dora-k2"):
        ax.plot(full[case]["curves"]["0"], label=f"{case} (full)", lw=2)
        names.append(f"{case}\n(full)")
        scores.append(json.loads((FULL / "heldout" / f"{case}-s0.eval.json").read_text())["greedy"]["mean_reward"])
    for r in (1, 8, 32):
        run = json.loads((HERE / f"r{r}-s0.run.json").read_text())
        ax.plot(run["reward_by_step"], label=f"dora-k2 LoRA r={r}")
        names.append(f"LoRA\nr={r}")
        scores.append(json.loads((HERE / f"r{r}-s0.eval.json").read_text())["greedy"]["mean_reward"])
    ax.set(xlabel="train step", ylabel="mean reward of the step's batch", title="per train step (seed 0)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bars.bar(names, scores, color=["grey", "C0", "C1", "C2", "C3", "C4"])
    bars.set(ylim=(0, 1), title="held-out greedy (82 additions)")
    bars.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "smollm2.png", dpi=120)
