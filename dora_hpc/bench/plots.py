"""Figures of ``bench modes`` / ``bench ablation`` / ``bench convergence`` (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_modes(summary: dict, path: Path) -> Path:
    modes = summary["modes"]
    names = list(modes)
    x = range(len(names))
    colors = ["#d62728" if n.startswith("dora") else "#7f7f7f" for n in names]
    panels = [("throughput_tokens_per_s", "trained tokens / s", "higher is better"),
              ("mean_step_time_s", "mean train-step interval (s)", "lower is better"),
              ("rollout_only_fraction", "rollout-only share of wall time", "rollout not overlapped with training"),
              ("slot_utilization", "slot utilization", "filled decode slots / capacity")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    for ax, (key, label, note) in zip(axes.flat, panels, strict=True):
        ax.bar(x, [modes[n][key] for n in names], color=colors, label="paced (median)")
        for i, n in enumerate(names):  # every repeat as a dot: the spread is the noise
            ax.scatter([i] * len(modes[n]["runs"]), [r[key] for r in modes[n]["runs"]], color="black", s=10, zorder=3)
        if "unpaced" in summary and key in ("throughput_tokens_per_s", "mean_step_time_s"):
            raw = summary["unpaced"]["modes"]
            ax.scatter(list(x), [raw[n][key] for n in names], marker="x", color="tab:blue", zorder=4,
                       label="unpaced (1 run)")
        if key == "slot_utilization":
            ax.plot(list(x), [modes[n]["slot_utilization_limit"] for n in names], "k--", lw=1,
                    label="zero-bubble limit")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_title(f"{label}\n({note})", fontsize=10)
        if key in ("throughput_tokens_per_s", "slot_utilization"):
            ax.legend(fontsize=8)
    r = summary.get("ratios", {})
    fig.suptitle(f"five modes on the real runtime ({summary['repeats']} interleaved repeats; "
                 f"dora-k2/sync {r.get('dora-k2/sync', float('nan')):.2f}x, "
                 f"dora-k2/partial {r.get('dora-k2/partial', float('nan')):.2f}x trained-token throughput)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ablation(summary: dict, path: Path, panels: list[tuple[str, str]]) -> Path:
    v = summary["variants"]
    names = list(v)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels) + max(0, len(names) - 2) * 1.5, 4))
    colors = ["#d62728", "#7f7f7f"] * len(names)
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.bar(names, [v[n][key] for n in names], color=colors[: len(names)])
        for i, n in enumerate(names):
            ax.scatter([i] * len(v[n]["runs"]), [r[key] for r in v[n]["runs"]], color="black", s=10, zorder=3)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20 if len(names) > 2 else 0, labelsize=8)
    fig.suptitle(f"{summary['title']} ({summary['repeats']} interleaved repeats, medians; dots: runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_convergence(summary: dict, path: Path) -> Path:
    held = summary.get("heldout")
    fig, axes = plt.subplots(1, 3 if held else 2, figsize=(18 if held else 13, 4.5))
    by_step, by_time = axes[0], axes[1]
    for i, (name, c) in enumerate(summary["cases"].items()):
        color = f"C{i}"
        for seed, curve in c["curves"].items():
            by_step.plot(range(len(curve)), curve, color=color, alpha=0.25, lw=1)
            by_time.plot(c["times"][seed], curve, color=color, alpha=0.6, lw=1.2,
                         label=name if seed == next(iter(c["curves"])) else None)
        by_step.plot(range(len(c["mean"])), c["mean"], color=color, lw=2,
                     label=f"{name} (mean of {len(c['curves'])} seeds)")
    by_step.set_xlabel("train step")
    by_time.set_xlabel("wall time since launch (s)")
    for ax in (by_step, by_time):
        ax.set_ylabel("mean reward of the step's batch")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    by_step.set_title("per train step (thin: each seed)")
    by_time.set_title("per second of wall time (each seed)")
    if held:
        _plot_heldout(axes[2], summary)
    fig.suptitle(summary.get("title", "mean reward"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_heldout(ax, summary: dict) -> None:
    """Held-out greedy mean reward: each seed's initial model, then each case's final checkpoint."""
    names = ["initial", *[c for c in summary["cases"] if "heldout_final_by_seed" in summary["cases"][c]]]
    by_seed = [summary["heldout"]["initial_by_seed"],
               *[summary["cases"][c]["heldout_final_by_seed"] for c in names[1:]]]
    for i, scores in enumerate(by_seed):
        vals = list(scores.values())
        ax.bar(i, sum(vals) / max(len(vals), 1), color="0.7" if i == 0 else f"C{i - 1}", alpha=0.6)
        ax.scatter([i] * len(vals), vals, color="k", s=12, zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("held-out greedy mean reward")
    ax.set_title("held-out eval (bars: mean; dots: seeds)")
    ax.grid(alpha=0.3, axis="y")
