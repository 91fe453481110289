"""Timeline PNG of a simulation: one row per rollout instance, coloured by the version it serves."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .cluster import Simulator  # noqa: E402

STATE_STYLE = {"idle": "#f0f0f0", "loading": "#444444", "paused": "#b0b0b0"}


def version_color(version: int):
    return plt.get_cmap("tab10")(version % 10)


def draw_rows(ax, segments: dict[int, list[tuple[float, float, tuple]]]) -> None:
    """Each row's (start, width, colour) segments as one collection: a long run has millions of them,
    and an artist each would take matplotlib hours."""
    for row, segs in segments.items():
        ax.broken_barh([(a, w) for a, w, _ in segs], (row - 0.4, 0.8), facecolors=[c for *_, c in segs],
                       linewidth=0)


def timeline_png(sim: Simulator, path: Path, max_rows: int = 64) -> None:
    n = len(sim.inst)
    rows = list(range(n)) if n <= max_rows else [round(i * (n - 1) / (max_rows - 1)) for i in range(max_rows)]
    row_of = {inst: r for r, inst in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.25 * len(rows)))
    segments: dict[int, list] = {r: [] for r in range(len(rows))}
    for inst, t0, t1, state, version, fill in sim.timeline:
        if inst not in row_of or t1 <= t0:
            continue
        if state == "busy":  # lighter = fewer live sequences (the intra-instance bubble)
            color = (*version_color(version or 0)[:3], 0.25 + 0.75 * (fill - 1) / 3)
        else:
            color = STATE_STYLE.get(state, "#ffffff")
        segments[row_of[inst]].append((t0, t1 - t0, color))
    draw_rows(ax, segments)
    for s in sim.steps:
        ax.axvline(s["t_start"], color="red", lw=0.5, alpha=0.6)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, sim.steps[-1]["t_end"])
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("rollout instance" + ("" if n <= max_rows else f"\n({len(rows)} of {n} shown)"))
    ax.set_title(f"{sim.mode} ({'colocated' if sim.colocated else 'disaggregated'}): what each rollout instance "
                 "does over time\ncolour = policy version served, opacity = batch fill (quartiles of max_num_seqs), "
                 "red = train-step start", fontsize=10)
    versions = sorted({v for (_, _, _, st, v, _) in sim.timeline if st == "busy" and v is not None})
    shown = versions if len(versions) <= 12 else versions[:: max(1, len(versions) // 10)]
    handles = [Patch(color=version_color(v), label=f"v{v}") for v in shown]
    handles += [Patch(color=c, label=s) for s, c in STATE_STYLE.items()]
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=min(len(handles), 16), frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.3 / (2 + len(rows)), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
