"""Run policies through the simulator and report: summary.json, a rich table, timelines, sweeps.

Every mode of one call runs on the same RunConfig, seed and workload; only the policy and its
placement (cluster.placement) differ, at the same total number of accelerators.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..config import RunConfig, with_overrides
from ..core.policies import MODES
from .cluster import Simulator
from .metrics import summarize, zero_bubble_limit
from .workload import Workload

TABLE_COLUMNS = [
    ("throughput_tokens_per_s", "tokens/s", "{:,.0f}"),
    ("mean_step_time_s", "step s", "{:,.1f}"),
    ("rollout_only_fraction", "rollout-only", "{:.0%}"),
    ("trainer_wait_fraction.window", "window wait", "{:.0%}"),
    ("slot_utilization", "slot util", "{:.0%}"),
    ("bubble_fraction", "bubble", "{:.0%}"),
    ("max_staleness", "max stale", "{}"),
    ("reprefill_tokens", "re-prefill tok", "{:,}"),
    ("migrations", "migrations", "{:,}"),
    ("dropped_groups", "dropped", "{:,}"),
    ("lost_groups", "lost", "{}"),
    ("weights.kept_gb_per_trainer_rank", "kept GB/trainer", "{:,.1f}"),
    ("weights.weight_load_s_per_step", "load s/step", "{:,.1f}"),
]


def simulate_modes(cfg: RunConfig, modes: tuple[str, ...] = MODES, timeline: bool = True,
                   console: Console | None = None, run_dir: Path | None = None) -> tuple[dict, dict[str, Simulator]]:
    """Each mode's summary and simulator; with ``run_dir``, each mode's HDF5 logs in ``run_dir/<mode>/``."""
    moments = Workload(cfg.workload, cfg.seed).moments()
    limits = {p: zero_bubble_limit(cfg, p, moments) for p in ("colocated", "disaggregated")}
    summary: dict = {"modes": {}, "workload": {"response_p50": moments["p50"], "response_p99": moments["p99"],
                                                "response_mean": moments["L"], "prompt_mean": moments["P"]}}
    if "turns" in moments:  # a multi-turn workload: per episode
        summary["workload"] |= {k: moments[k] for k in ("turns", "model", "env_tokens", "env_s")}
    sims: dict[str, Simulator] = {}
    with Progress(console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task("simulating", total=len(modes))
        for mode in modes:
            progress.update(task, description=f"simulating {mode}")
            sim = Simulator(cfg, mode, timeline=timeline).run()
            row = summarize(sim)
            if run_dir is not None:
                sim.write_logs(run_dir / mode)
            limit = (zero_bubble_limit(cfg, row["placement"], moments, row["borrowed_instances"])
                     if row["borrowed_instances"] else limits[row["placement"]])
            row["limit_tokens_per_s"] = limit
            row["limit_share"] = row["throughput_tokens_per_s"] / limit
            summary["modes"][mode] = row
            sims[mode] = sim
            progress.advance(task)
    dora = summary["modes"].get("dora")  # its limit counts borrowed instances (cluster.elastic)
    summary["limit_tokens_per_s"] = dora["limit_tokens_per_s"] if dora else limits[cfg.cluster.placement_of("dora")]
    summary["limit_tokens_per_s_by_placement"] = limits
    modes_ = summary["modes"]
    if "dora" in modes_:
        for base in ("sync", "one_step", "partial", "oversample"):
            if base in modes_:
                summary[f"dora_over_{base}"] = (modes_["dora"]["throughput_tokens_per_s"]
                                                / modes_[base]["throughput_tokens_per_s"])
    return summary, sims


def render_table(summary: dict, title: str = "simulated policies") -> Table:
    table = Table(title=title)
    table.add_column("mode")
    for _, header, _ in TABLE_COLUMNS:
        table.add_column(header, justify="right")
    for mode, row in summary["modes"].items():
        table.add_row(f"{mode} ({row['placement'][:5]})",
                      *[fmt.format(_field(row, key)) for key, _, fmt in TABLE_COLUMNS])
    return table


def _field(row: dict, key: str):
    for part in key.split("."):
        row = row[part]
    return row


def write_outputs(summary: dict, sims: dict[str, Simulator], out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json"]
    paths[0].write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if plots:
        from .plots import timeline_png

        for mode, sim in sims.items():
            p = out / f"timeline-{mode}.png"
            timeline_png(sim, p)
            paths.append(p)
    return paths


def suggest_split(cfg: RunConfig, console: Console | None = None) -> dict:
    """Simulate DORA at every feasible rollout/train split; the best throughput wins."""
    tp = cfg.cluster.accelerators_per_instance
    n_max = cfg.cluster.accelerators // tp - 1
    candidates = sorted({max(1, round(n_max * f / 16)) for f in range(1, 16)} | {n_max})
    rows = []
    with Progress(console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task("sweeping splits", total=len(candidates))
        for n in candidates:
            c = with_overrides(cfg, {"cluster.rollout_instances": n})
            s = summarize(Simulator(c, "dora", timeline=False).run())
            rows.append({"rollout_instances": n, "rollout_accelerators": n * tp,
                         "train_accelerators": cfg.cluster.accelerators - n * tp,
                         "throughput_tokens_per_s": s["throughput_tokens_per_s"],
                         "rollout_only_fraction": s["rollout_only_fraction"],
                         "slot_utilization": s["slot_utilization"]})
            progress.advance(task)
    best = max(rows, key=lambda r: r["throughput_tokens_per_s"])
    return {"best": best, "sweep": rows}
