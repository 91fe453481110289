"""Sweeps over simulated runs: the named scenarios the results compare on, and DORA's sensitivity.

* **Scenarios** (``SCENARIOS``): the workloads results/sim/ measures on -- paper-64, paper-128, the heavy tail,
  long reasoning and agentic-64 -- each at its base seed and K, in steady state (``steady``: 40 steps, the
  first 2K left out). ``run`` simulates one labelled variant (``LABELS``: sync, partial, DORA, and DORA with a
  planner or borrowed instances) of one at one seed and keeps ``KEEP`` of its summary; ``grouped`` puts runs
  side by side, each over its own seed's sync run. The result scripts under results/sim/ call these.
* **Sensitivity** (``sensitivity``): one knob at a time around a base config, plus a few joint changes. Each
  variant runs sync, partial and dora on the same seed and workload (the modes compared in the paper's Fig.
  10); the table reports DORA / sync, DORA / partial and DORA's share of the zero-bubble limit.

The scenarios read configs/ from the source checkout this package sits in (the repository's root).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from ..config import RunConfig, load_config, with_overrides
from .cluster import Simulator
from .metrics import summarize, zero_bubble_limit

ROOT = Path(__file__).resolve().parents[2]
HEAVY_TAIL = ["workload.response_len.sigma=1.6", "workload.response_len.max=65536", "dora.k=6"]
SCENARIOS = {  # name: (config, overrides, base seed, K)
    "paper-64": ("configs/sim/paper-64.yaml", [], 0, 3),
    "paper-128": ("configs/sim/paper-128.yaml", [], 0, 3),
    "heavy tail": ("configs/sim/paper-64.yaml", HEAVY_TAIL, 7, 6),
    "long reasoning": ("configs/sim/paper-64.yaml", ["workload.response_len.median=2000",
                                                     "workload.response_len.sigma=1.2",
                                                     "workload.response_len.max=32768", "dora.k=4"], 0, 4),
    "agentic-64": ("configs/sim/agentic-64.yaml", [], 0, 3),
}
SEEDS = 3  # the base seed and the next two
LABELS = {"sync": ("sync", []), "partial": ("partial", []), "dora": ("dora", []),
          "dora straggler": ("dora", ["dora.planner=straggler"]), "dora elastic": ("dora", ["cluster.elastic=true"]),
          "dora lora": ("dora", ["train.lora={rank: 32}"])}  # versions as rank-32 adapters on shared instances
KEEP = ("throughput_tokens_per_s", "mean_step_time_s", "trainer_wait_fraction", "slot_utilization", "max_staleness",
        "lost_groups", "duplicate_groups", "split_groups", "mixed_version_trajectories", "reprefill_tokens",
        "migrations", "kv_peak_fraction", "placement", "borrowed_instances", "weights")


def steady(name: str, extra: list[str], seed: int) -> RunConfig:
    """Scenario ``name`` with ``extra`` overrides at ``seed``, in steady state (40 steps, the first 2K left out)."""
    path, sets, _, k = SCENARIOS[name]
    return load_config(ROOT / path, [*sets, *extra, f"seed={seed}", "sim.steps=40", f"sim.warmup_steps={2 * k}"])


def run(job: tuple[str, str, int]) -> tuple[str, str, dict]:
    """``(scenario, label, seed)``: the run's ``KEEP`` figures, its zero-bubble limit and its share of it."""
    name, label, seed = job
    mode, extra = LABELS[label]
    cfg = steady(name, extra, seed)
    s = summarize(Simulator(cfg, mode, timeline=False).run())
    limit = zero_bubble_limit(cfg, s["placement"], borrowed=s["borrowed_instances"])
    row = {**{key: s.get(key) for key in KEEP}, "limit_tokens_per_s": limit,
           "limit_share": s["throughput_tokens_per_s"] / limit, "seed": seed, "episodes": s.get("episodes", {})}
    print(name, label, seed, round(s["throughput_tokens_per_s"]), flush=True)
    return name, label, row


def grouped(results: list[tuple[str, str, dict]]) -> dict:
    """Runs by scenario and label, each with ``over_sync``: its throughput over its seed's sync run."""
    out: dict = {}
    for name, label, row in results:
        out.setdefault(name, {}).setdefault(label, []).append(row)
    for rows in out.values():
        sync = {r["seed"]: r["throughput_tokens_per_s"] for r in rows["sync"]}
        for runs in rows.values():
            for r in runs:
                r["over_sync"] = r["throughput_tokens_per_s"] / sync[r["seed"]]
    return out

KNOBS: dict[str, list] = {
    "workload.response_len.sigma": [0.6, 0.8, 1.0, 1.2, 1.5],
    "workload.response_len.max": [8192, 20480, 32768, 65536],
    "dora.k": [0, 1, 2, 3, 4],
    "batch.rbs": [512, 640, 768, 1024],
    "sim.hardware.train_mfu": [0.15, 0.3, 0.45],
    "sim.hardware.prefill_mfu": [0.5, 0.2, 0.1],
}
JOINT: dict[str, dict] = {
    "agentic tail: sigma 1.5, cap 64k, K 3": {
        "workload.response_len.sigma": 1.5, "workload.response_len.max": 65536, "dora.k": 3},
    "agentic tail: sigma 1.5, cap 64k, K 1": {
        "workload.response_len.sigma": 1.5, "workload.response_len.max": 65536, "dora.k": 1},
    "agentic tail, re-split: sigma 1.5, cap 64k, K 3, 10 rollout instances": {
        "workload.response_len.sigma": 1.5, "workload.response_len.max": 65536, "dora.k": 3,
        "cluster.rollout_instances": 10},
    "agentic tail, re-split: sigma 1.5, cap 64k, K 6, 10 rollout instances": {
        "workload.response_len.sigma": 1.5, "workload.response_len.max": 65536, "dora.k": 6,
        "cluster.rollout_instances": 10},
    "heavier tail, re-split: sigma 1.5, K 3, 10 rollout instances": {
        "workload.response_len.sigma": 1.5, "dora.k": 3, "cluster.rollout_instances": 10},
    "long cap, K 6: cap 64k, K 6": {"workload.response_len.max": 65536, "dora.k": 6},
    "light tail: sigma 0.6, cap 8k, K 3": {
        "workload.response_len.sigma": 0.6, "workload.response_len.max": 8192, "dora.k": 3},
}
SWEPT_MODES = ("sync", "partial", "dora")


def _variant(cfg: RunConfig, label: str, changes: dict) -> dict:
    c = with_overrides(cfg, changes)
    rows = {m: summarize(Simulator(c, m, timeline=False).run()) for m in SWEPT_MODES}
    tput = {m: r["throughput_tokens_per_s"] for m, r in rows.items()}
    limit = zero_bubble_limit(c, rows["dora"]["placement"])
    return {"variant": label, "changes": changes, "throughput_tokens_per_s": tput,
            "dora_over_sync": tput["dora"] / tput["sync"], "dora_over_partial": tput["dora"] / tput["partial"],
            "dora_limit_share": tput["dora"] / limit,
            "sync_rollout_only_fraction": rows["sync"]["rollout_only_fraction"],
            "dora_rollout_only_fraction": rows["dora"]["rollout_only_fraction"],
            "dora_max_staleness": rows["dora"]["max_staleness"],
            "partial_reprefill_share": rows["partial"]["overheads"].get("reprefill", 0.0)}


def sensitivity(cfg: RunConfig, console: Console | None = None) -> list[dict]:
    variants = [("base", {})]
    for key, values in KNOBS.items():
        base_value = cfg.model_dump()
        for part in key.split("."):
            base_value = base_value[part]
        variants += [(f"{key}={v}", {key: v}) for v in values if v != base_value]
    variants += list(JOINT.items())
    out = []
    with Progress(console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task("sensitivity", total=len(variants))
        for label, changes in variants:
            progress.update(task, description=f"sensitivity: {label}")
            out.append(_variant(cfg, label, changes))
            progress.advance(task)
    return out


def markdown_table(rows: list[dict]) -> str:
    lines = ["| variant | DORA / sync | DORA / partial | DORA share of limit | sync rollout-only | "
             "DORA rollout-only | DORA max staleness | partial re-prefill share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['dora_over_sync']:.2f}x | {r['dora_over_partial']:.2f}x | "
                     f"{r['dora_limit_share']:.0%} | {r['sync_rollout_only_fraction']:.0%} | "
                     f"{r['dora_rollout_only_fraction']:.0%} | {r['dora_max_staleness']} | "
                     f"{r['partial_reprefill_share']:.1%} |")
    return "\n".join(lines) + "\n"
