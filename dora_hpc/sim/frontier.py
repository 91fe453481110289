"""The staleness frontier: tokens/s against mean staleness for DORA's admission levels, at each K, with
sync, one-step off-policy and partial rollout as reference points (``dora-hpc simulate --frontier``).

Each point is one simulation over the config's steady-state window, seeds run apart (the table gives each
seed's figures and their median). Admission levels: ``eager`` (the window fills), ``lean`` with the cap
learned from the run, and ``lean`` at a fixed ``dora.depth`` (the pipeline's depth: groups whose update
is not yet published -- the batch in training plus those admitted -- in units of TBS). Legacy top-up is run on and
off for eager and for learned lean at the config's K.

A run resumes: each finished simulation is kept under the output folder's ``points/`` (named by a digest of
the config, the point and the seed), and a later run with the same config, point and seed takes it from there.
The digest does not cover the simulator's code: a change that moves a simulation's figures must delete the
kept points it makes stale.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from ..config import RunConfig, with_overrides
from .cluster import Simulator
from .metrics import summarize

DEPTHS = (1.25, 1.5, 2.0, 2.5, 3.0)
REFERENCES = ("sync", "one_step", "partial")


def points(cfg: RunConfig, ks: tuple[int, ...] = (1, 2, 3)) -> list[dict]:
    """The (label, mode, changes) of every point of ``cfg``'s frontier."""
    out = [{"label": m, "mode": m, "k": None, "changes": {}} for m in REFERENCES]
    for k in sorted({*ks, cfg.dora.k}):
        own = k == cfg.dora.k
        variants: list[tuple[str, dict]] = [("eager", {"dora.admission": "eager"}),
                                            ("lean", {"dora.admission": "lean"})]
        if own:
            variants += [("eager, no legacy top-up", {"dora.admission": "eager", "dora.legacy_topup": False}),
                         ("lean, legacy top-up", {"dora.admission": "lean", "dora.legacy_topup": True})]
        variants += [(f"lean depth {h:g}", {"dora.admission": "lean", "dora.depth": h})
                     for h in DEPTHS if h <= k + 2 and (own or h in (1.5, 2.0))]
        out += [{"label": f"K={k} {name}", "mode": "dora", "k": k, "changes": {"dora.k": k, **ch}}
                for name, ch in variants]
    return out


def run_point(cfg: RunConfig, point: dict, seed: int) -> dict:
    c = with_overrides(cfg, {**point["changes"], "seed": seed})
    sim = Simulator(c, point["mode"], timeline=False).run()
    r = summarize(sim)
    lean = getattr(sim.policy, "lean", None)
    return {"seed": seed, "throughput_tokens_per_s": r["throughput_tokens_per_s"],
            "mean_staleness": r["mean_staleness_steady"], "mean_staleness_all_steps": r["mean_staleness"],
            "max_staleness": r["max_staleness"],
            "trainer_wait_fraction": r["trainer_wait_fraction"], "slot_utilization": r["slot_utilization"],
            "staleness_histogram": _histogram(sim), "learned_depth": lean.depth / c.batch.tbs if lean else None}


def _histogram(sim: Simulator) -> dict[str, int]:
    counts: dict[int, int] = {}
    for s in sim.steps[sim.cfg.sim.warmup_steps:]:
        for x in s["staleness"]:
            counts[x] = counts.get(x, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


def run_file(cache: Path, cfg: RunConfig, point: dict, seed: int) -> Path:
    """Where one simulation of the frontier is kept: named by a digest of the config, the point and the seed."""
    key = json.dumps([cfg.model_dump(mode="json"), point, seed], sort_keys=True)
    return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def frontier(cfg: RunConfig, seeds: tuple[int, ...] = (0,), ks: tuple[int, ...] = (1, 2, 3), workers: int = 2,
             console: Console | None = None, cache: Path | None = None) -> list[dict]:
    """Every point of the frontier, each with its runs (one a seed) and their medians. ``cache``: a folder where
    each finished simulation is kept, and from which one already run is taken."""
    pts = points(cfg, ks)
    jobs = [(i, p, s) for i, p in enumerate(pts) for s in seeds]
    runs: dict[int, list[dict]] = {i: [] for i in range(len(pts))}
    todo = []
    for i, p, s in jobs:
        kept = run_file(cache, cfg, p, s) if cache is not None else None
        if kept is not None and kept.exists():
            runs[i].append(json.loads(kept.read_text()))
        else:
            todo.append((i, p, s, kept))
    with ProcessPoolExecutor(max_workers=workers) as pool, \
            Progress(console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task("frontier", total=len(jobs), completed=len(jobs) - len(todo))
        futures = {pool.submit(run_point, cfg, p, s): (i, kept) for i, p, s, kept in todo}
        for fut in as_completed(futures):
            i, kept = futures[fut]
            runs[i].append(fut.result())
            if kept is not None:  # whole or not at all: a run stopped mid-write leaves no half point
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.with_suffix(".tmp").write_text(json.dumps(runs[i][-1]) + "\n")
                kept.with_suffix(".tmp").rename(kept)
            progress.advance(task)
    out = []
    for i, p in enumerate(pts):
        rs = sorted(runs[i], key=lambda r: r["seed"])
        out.append({**p, "runs": rs,
                    "throughput_tokens_per_s": statistics.median(r["throughput_tokens_per_s"] for r in rs),
                    "mean_staleness": statistics.median(r["mean_staleness"] for r in rs)})
    return out


def markdown_table(rows: list[dict]) -> str:
    eager = {r["k"]: r["throughput_tokens_per_s"] for r in rows if r["label"].endswith(" eager")}
    lines = ["| point | tokens/s | of eager at its K | mean staleness | max | trainer waits (capacity / tail / window) "
             "| depth (learned) |", "|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        share = f"{r['throughput_tokens_per_s'] / eager[r['k']]:.1%}" if r["k"] in eager else ""
        w = r["runs"][0]["trainer_wait_fraction"]
        waits = " / ".join(f"{w[x]:.0%}" for x in ("capacity", "tail", "window"))
        depths = [x["learned_depth"] for x in r["runs"] if x["learned_depth"] is not None]
        depth = f"{statistics.median(depths):.2f}" if depths else ""
        lines.append(f"| {r['label']} | {r['throughput_tokens_per_s']:,.0f} | {share} | {r['mean_staleness']:.2f} | "
                     f"{max(x['max_staleness'] for x in r['runs'])} | {waits} | {depth} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green", 4: "tab:red"}
    for k in sorted({r["k"] for r in rows if r["k"] is not None}):
        fixed = sorted((r for r in rows if r["k"] == k and "depth" in r["label"]), key=lambda r: r["mean_staleness"])
        ax.plot([r["mean_staleness"] for r in fixed], [r["throughput_tokens_per_s"] for r in fixed], "-o",
                color=colors.get(k, "grey"), ms=4, label=f"K={k}: lean at a fixed depth")
        for r in rows:
            if r["k"] == k and "depth" not in r["label"]:
                marker = {"eager": "s", "lean": "*", "eager, no legacy top-up": "D", "lean, legacy top-up": "P"}[
                    r["label"].split(" ", 1)[1]]
                ax.plot(r["mean_staleness"], r["throughput_tokens_per_s"], marker, color=colors.get(k, "grey"),
                        ms=11 if marker == "*" else 7, mfc="none" if marker in "DP" else None,
                        label=f"K={k}: {r['label'].split(' ', 1)[1]}")
    for r in rows:
        if r["k"] is None:
            ax.plot(r["mean_staleness"], r["throughput_tokens_per_s"], "x", color="black", ms=8)
            ax.annotate(r["label"], (r["mean_staleness"], r["throughput_tokens_per_s"]), textcoords="offset points",
                        xytext=(5, -10), fontsize=8)
    ax.set_xlabel("mean staleness of trained groups (steps)")
    ax.set_ylabel("trained tokens/s (simulated)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_frontier(cfg: RunConfig, out: Path, seeds: tuple[int, ...], ks: tuple[int, ...], title: str,
                   console: Console, workers: int = 2) -> list[dict]:
    """Run the frontier (taking the simulations kept under ``out/points`` from an earlier run) and write
    frontier.json, .md and .png under ``out``."""
    rows = frontier(cfg, seeds, ks, workers=workers, console=console, cache=out / "points")
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps({"config": title, "seeds": list(seeds), "points": rows},
                                                  indent=2) + "\n")
    (out / "frontier.md").write_text(markdown_table(rows))
    plot(rows, f"{title}: seeds {','.join(map(str, seeds))}", out / "frontier.png")
    console.print(markdown_table(rows))
    console.print(f"wrote {out / 'frontier.json'}, {out / 'frontier.md'}, {out / 'frontier.png'}")
    return rows
