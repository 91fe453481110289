"""``dora-hpc analyze RUN_DIR --plots DIR``: the run's figures as PNGs (matplotlib, no display).

timeline.png (one row per rollout instance, coloured by the version it generates with, lighter =
fewer filled slots, red lines = train-step starts), allocation.png (instances per version over time,
like the paper's Fig. 6), staleness.png (histogram of consume step - version), stratified.png
(pass rate by staleness, naive and within difficulty bins: Table 1 as a figure) and steps.png
(trained tokens/s and mean reward per train step).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ..sim.plots import draw_rows, version_color  # noqa: E402


def write_plots(out: Path, esteps: dict, tsteps: dict, result: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    title = f"{result['run_dir']} ({result['mode']}, K={result['k']})"
    paths = [timeline(out / "timeline.png", esteps, tsteps, title),
             allocation(out / "allocation.png", esteps, title),
             staleness(out / "staleness.png", result, title),
             stratified_png(out / "stratified.png", result, title),
             steps_png(out / "steps.png", result, title)]
    return [p for p in paths if p is not None]


def timeline(path: Path, e: dict, t: dict, title: str) -> Path | None:
    if not len(e["t_start"]):
        return None
    ranks = sorted({int(r) for r in e["rank"]})
    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.45 * len(ranks)))
    versions = set()
    segments: dict[int, list] = {row: [] for row in range(len(ranks))}
    row_of = {r: row for row, r in enumerate(ranks)}
    for r, a, b, n, cap, v in zip(e["rank"], e["t_start"], e["t_end"], e["batch_size"], e["capacity"],
                                  e["version"], strict=True):
        if n > 0 and b > a:
            versions.add(int(v))
            color = (*version_color(int(v))[:3], 0.25 + 0.75 * min(1.0, n / max(cap, 1)))
            segments[row_of[int(r)]].append((a, b - a, color))
    draw_rows(ax, segments)
    for s in t["t_start"]:
        ax.axvline(s, color="red", lw=0.6, alpha=0.6)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("wall time since launch (s)")
    ax.set_title(f"{title}: rollout instances over time (colour = policy version, lighter = fewer "
                 "filled slots, red = train step starts)", fontsize=9)
    shown = sorted(versions)[-10:]
    ax.legend(handles=[Patch(color=version_color(v), label=f"v{v}") for v in shown], ncol=min(len(shown), 10),
              loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def allocation(path: Path, e: dict, title: str, buckets: int = 200) -> Path | None:
    if not len(e["t_start"]):
        return None
    lo, hi = float(e["t_start"].min()), float(e["t_end"].max())
    edges = np.linspace(lo, hi, buckets + 1)
    ranks = sorted({int(r) for r in e["rank"]})
    versions = sorted({int(v) for v in e["version"] if v >= 0})
    counts = np.zeros((len(versions), buckets))
    for r in ranks:  # an instance counts for the version of its latest engine step in each bucket
        m = e["rank"] == r
        starts, vers = e["t_start"][m], e["version"][m]
        order = np.argsort(starts)
        idx = np.searchsorted(starts[order], edges[1:], side="right") - 1
        for b, i in enumerate(idx):
            if i >= 0 and vers[order][i] >= 0:
                counts[versions.index(int(vers[order][i])), b] += 1
    fig, ax = plt.subplots(figsize=(12, 3.6))
    ax.stackplot(edges[1:], counts, colors=[version_color(v) for v in versions], labels=[f"v{v}" for v in versions])
    ax.set_ylim(0, len(ranks))
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("rollout instances")
    ax.set_title(f"{title}: instances per policy version", fontsize=9)
    ax.legend(ncol=min(len(versions), 12), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def staleness(path: Path, result: dict, title: str) -> Path:
    hist = result["staleness"]["histogram"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    xs = [int(s) for s in hist]
    ax.bar(xs, [hist[s] for s in hist], color="#4c72b0")
    ax.set_xticks(xs)
    ax.set_xlabel("staleness (consume step - version)")
    ax.set_ylabel("trajectories trained on")
    ax.set_title(f"staleness, K={result['k']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stratified_png(path: Path, result: dict, title: str) -> Path:
    s = result["stratified"]
    groups = [("all (naive)", s["naive"]["by_staleness"])] + [(r["bin"], r["by_staleness"]) for r in s["rows"]]
    levels = sorted({int(k) for _, cells in groups for k in cells})
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / max(len(levels), 1)
    for j, lvl in enumerate(levels):
        xs, ys, ns = [], [], []
        for i, (_, cells) in enumerate(groups):
            c = cells.get(str(lvl))
            if c:
                xs.append(i + (j - (len(levels) - 1) / 2) * width)
                ys.append(c["pass_rate"])
                ns.append(c["n"])
        bars = ax.bar(xs, ys, width, label=f"staleness {lvl}", color=plt.get_cmap("viridis")(j / max(len(levels), 2)))
        for bar, n in zip(bars, ns, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"n={n}", ha="center", va="bottom",
                    fontsize=6)
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    of = "its prompt over the run" if s.get("difficulty_of") == "prompt" else "its group"
    ax.set_xlabel(f"difficulty: pass rate of {of} (pass = reward >= {s['threshold']})")
    ax.set_ylabel("pass rate")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"{title}: pass rate by staleness, naive and at equal difficulty (Table 1)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def steps_png(path: Path, result: dict, title: str) -> Path | None:
    rate, reward = result["tokens_per_s_by_step"], result["reward_by_step"]
    if not reward:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    ax.plot(range(1, len(rate) + 1), rate, marker="o", ms=3, color="#4c72b0")
    if rate:
        ax.axhline(float(np.median(rate)), color="gray", ls="--", lw=0.8, label=f"median {np.median(rate):.0f}")
        ax.legend(fontsize=8)
    ax.set_xlabel("train step")
    ax.set_ylabel("trained tokens / s")
    ax.set_title("throughput per step (tokens of step n / time since step n-1 ended)", fontsize=9)
    ax2.plot(range(len(reward)), reward, marker="o", ms=3, color="#dd8452")
    ax2.set_xlabel("train step")
    ax2.set_ylabel("mean reward of the batch")
    ax2.set_title("reward per step", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
