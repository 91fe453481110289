"""faults.png from faults.json (measure.py): trained tokens/s around the kill, fenced against requeued;
``plot.py trainer`` draws trainer.png from trainer.json (measure.py --trainer) likewise.

    .venv/bin/python results/bench/faults/plot.py [trainer]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
BIN_S = 5.0


def rate(timeline: list[dict]) -> tuple[list[float], list[float]]:
    """Trained tokens per second (steps trained again after a requeue included) in BIN_S-second bins of
    time since the kill."""
    t0 = min(r["since_kill"] for r in timeline)
    n = int((max(r["since_kill"] for r in timeline) - t0) // BIN_S) + 1
    tokens = [0.0] * n
    for r in timeline:
        tokens[int((r["since_kill"] - t0) // BIN_S)] += r["tokens"]
    return [t0 + (i + 0.5) * BIN_S for i in range(n)], [x / BIN_S for x in tokens]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "faults"
    data = json.loads((HERE / f"{name}.json").read_text())
    rank = data["kill"]["rank"]
    what = "one trainer replica of 2" if name == "trainer" else "one rollout instance of 3"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    colors = {"fenced": "tab:blue", "requeued": "tab:red"}
    for case, runs in data["runs"].items():
        for i, run in enumerate(runs):
            x, y = rate(run["timeline"])
            axes[0].plot(x, y, color=colors[case], alpha=0.8, label=case if i == 0 else None)
            kept = sorted(r["since_kill"] for r in run["timeline"] if r["kept"])
            axes[1].step(kept, range(1, len(kept) + 1), where="post", color=colors[case], alpha=0.8,
                         label=case if i == 0 else None)
    for ax in axes:
        ax.axvline(0, color="k", lw=0.8, ls="--")
    axes[0].set(xlabel=f"seconds since rank {rank} was killed", ylabel=f"trained tokens/s ({BIN_S:g} s bins)",
                title="throughput around the kill")
    axes[1].set(xlabel=f"seconds since rank {rank} was killed", ylabel="steps kept",
                title="progress: steps the run kept, as they were trained")
    med = data["medians"]
    fig.suptitle(f"{what} lost (SIGKILL) at step {data['kill']['at_step']}: time lost "
                 f"fenced {med['fenced']['lost_s']:.0f} s, requeued {med['requeued']['lost_s']:.0f} s (medians)")
    axes[0].legend()
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(HERE / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
