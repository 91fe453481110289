"""Timeline PNG of a simulation: one row per rollout instance, coloured by the version it serves."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .cluster import Simulator  # noqa: E402

STATE_STYLE = {"idle": "#f0f0f0", "loading": "#444444", "paused": "#b0b0b0"}


def timeline_png(sim: Simulator, path: Path, max_rows: int = 64) -> None:
    n = len(sim.inst)
    rows = list(range(n)) if n <= max_rows else [round(i * (n - 1) / (max_rows - 1)) for i in range(max_rows)]
    row_of = {inst: r for r, inst in enumerate(rows)}
    cmap = plt.get_cmap("viridis")
    n_versions = max(len(sim.steps), 1) + 1
    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.22 * len(rows)))
    for inst, t0, t1, state, version in sim.timeline:
        if inst not in row_of or t1 <= t0:
            continue
        if state == "busy":
            color = cmap((version or 0) / n_versions)
        else:
            color = STATE_STYLE.get(state, "#ffffff")
        ax.broken_barh([(t0, t1 - t0)], (row_of[inst] - 0.4, 0.8), facecolors=color, linewidth=0)
    for s in sim.steps:
        ax.axvline(s["t_start"], color="red", lw=0.4, alpha=0.5)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, sim.steps[-1]["t_end"])
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("rollout instance" + ("" if n <= max_rows else f" ({len(rows)} of {n} shown)"))
    ax.set_title(f"{sim.mode} ({'colocated' if sim.colocated else 'disaggregated'}): instance timeline, "
                 "coloured by policy version; red lines = train-step starts")
    handles = [Patch(color=cmap(v / n_versions), label=f"busy v{v}") for v in (0, n_versions // 2, n_versions - 1)]
    handles += [Patch(color=c, label=s) for s, c in STATE_STYLE.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 2.5 / (6 + len(rows))),
              fontsize=8, ncol=len(handles), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
