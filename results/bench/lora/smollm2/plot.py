"""Reward per step of SmolLM2 on addition under DORA K=2: LoRA at ranks 1, 8 and 32 (this folder's runs, every
seed kept here) against full fine-tuning (results/bench/convergence-smollm2, seeds 0-3), with each one's held-out
greedy score, one dot per seed and the bar at their mean. Writes smollm2.png and prints the README's table.

    .venv/bin/python results/bench/lora/smollm2/plot.py
"""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
FULL = HERE.parents[1] / "convergence-smollm2"
RANKS = (1, 8, 32)


def greedy(path: Path) -> float:
    return json.loads(path.read_text())["greedy"]["mean_reward"]


def lora_seeds(rank: int) -> list[int]:
    return sorted(int(p.name.split("-s")[1].split(".")[0]) for p in HERE.glob(f"r{rank}-s*.eval.json"))


if __name__ == "__main__":
    summaries = [json.loads(p.read_text())["cases"] for p in (FULL / "summary.json", FULL / "s23" / "summary.json")]
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2.2, 1]})
    names = ["initial"]
    scores = [[greedy(p) for p in sorted(FULL.rglob("heldout/initial-s*.eval.json"))]]
    for i, case in enumerate(("sync", "dora-k2")):
        curves = [c for full in summaries for c in full[case]["curves"].values()]
        ax.plot([statistics.mean(c) for c in zip(*curves, strict=True)], label=f"{case} (full)", lw=2, color=f"C{i}")
        names.append(f"{case}\n(full)")
        scores.append([greedy(p) for p in sorted(FULL.rglob(f"heldout/{case}-s*.eval.json"))])
    print("| | seeds | held-out greedy, mean (per seed) | batch reward, last 5 steps (per seed) | engine steps with 2+ "
          "versions | logprob gap |")
    print("|---|---|---:|---|---:|---:|")
    for i, r in enumerate(RANKS):
        seeds = lora_seeds(r)
        runs = [json.loads((HERE / f"r{r}-s{s}.run.json").read_text()) for s in seeds]
        curves = [run["reward_by_step"] for run in runs]
        ax.plot([statistics.mean(c) for c in zip(*curves, strict=True)], label=f"dora-k2 LoRA r={r}", color=f"C{i + 2}")
        names.append(f"LoRA\nr={r}")
        got = [greedy(HERE / f"r{r}-s{s}.eval.json") for s in seeds]
        scores.append(got)
        tails = [statistics.mean(c[-5:]) for c in curves]
        gaps = [run["logprob_gap"]["max"] for run in runs]
        print(f"| DORA K=2, LoRA r={r} | {','.join(map(str, seeds))} | {statistics.mean(got):.3f} "
              f"({', '.join(f'{x:.3f}' for x in got)}) | {', '.join(f'{x:.3f}' for x in tails)} | "
              f"{', '.join(str(run['multi_version_batches']) for run in runs)} | "
              f"{', '.join(f'{g:.1e}' for g in gaps)} |")
    ax.set(xlabel="train step", ylabel="mean reward of the step's batch", title="per train step (mean of seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bars.bar(names, [statistics.mean(s) for s in scores], color=["grey"] + [f"C{i}" for i in range(5)], alpha=0.6)
    for x, s in enumerate(scores):
        bars.scatter([x] * len(s), s, color="black", s=8, zorder=3)
    bars.set(ylim=(0, 1), title="held-out greedy (dots: seeds)")
    bars.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "smollm2.png", dpi=120)
