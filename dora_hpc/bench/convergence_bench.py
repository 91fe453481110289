"""``dora-hpc bench convergence``: does DORA learn as fast as synchronous training? (paper Fig. 10)

sync, dora K=1 and dora K=3 train from the same initial checkpoint with the same seeds for the same
number of steps; the mean reward of every step's batch is read back from the trainer's HDF5 log.
Several seeds give the noise: a case is "within noise" of sync when the gap between their final
rewards (mean of the last ``tail`` steps, averaged over seeds) is no larger than the spread of sync's
own final reward across seeds (max - min).

Invariant: every curve is a real run's log (``run_case``); runs of one seed are back to back.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .modes_bench import _fresh, machine, run_case

CASES: dict[str, list[str]] = {
    "sync": ["mode=sync"],
    "dora-k1": ["mode=dora", "dora.k=1"],
    "dora-k3": ["mode=dora", "dora.k=3"],
}


def final(curve: list[float], tail: int) -> float:
    return statistics.fmean(curve[-tail:])


def summarize(out: Path, seeds: list[int], tail: int = 5) -> dict:
    """Reward curves (per step and against wall time) of the runs in OUT/runs, from their train logs."""
    from ..store.shards import read_table

    cases = {}
    for case in CASES:
        curves, times = {}, {}
        for seed in seeds:
            t = read_table(out / "runs" / f"{case}-s{seed}", "train", "steps", ["step", "t_end", "reward_mean"])
            order = t["step"].argsort()
            curves[str(seed)] = t["reward_mean"][order].tolist()
            times[str(seed)] = t["t_end"][order].tolist()
        n = min(len(c) for c in curves.values())
        mean = [statistics.fmean(c[i] for c in curves.values()) for i in range(n)]
        finals = [final(c, tail) for c in curves.values()]
        cases[case] = {"curves": curves, "times": times, "mean": mean, "first": mean[0],
                       "final": statistics.fmean(finals), "final_by_seed": finals,
                       "seconds_per_step": statistics.median(
                           (ts[-1] - ts[0]) / max(len(ts) - 1, 1) for ts in times.values())}
    noise = max(cases["sync"]["final_by_seed"]) - min(cases["sync"]["final_by_seed"])
    verdict = {c: {"gap_to_sync": cases[c]["final"] - cases["sync"]["final"],
                   "within_noise": abs(cases[c]["final"] - cases["sync"]["final"]) <= noise}
               for c in cases if c != "sync"}
    return {"seeds": seeds, "tail_steps": tail, "sync_seed_spread": noise, "verdict": verdict, "cases": cases}


def bench_convergence(config: str, out: Path, sets: list[str] | None = None, seeds: list[int] | None = None,
                      tail: int = 5, console=None) -> dict:
    from rich.progress import Progress

    sets, seeds = list(sets or []), list(seeds or [0, 1])
    _fresh(out)
    (out / "runs").mkdir()
    with Progress(console=console) as bar:
        task = bar.add_task("convergence", total=len(seeds) * len(CASES))
        for seed in seeds:
            for case, case_sets in CASES.items():
                bar.update(task, description=f"{case} (seed {seed})")
                run_case(config, [*sets, *case_sets, f"seed={seed}"], out / "runs" / f"{case}-s{seed}", timeout_s=3600)
                bar.advance(task)
    title = f"sync vs dora K=1 vs K=3, same initial model and seeds ({config} {' '.join(sets)})"
    summary = summarize(out, seeds, tail) | {"config": config, "sets": sets, "machine": machine(), "title": title}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from .plots import plot_convergence

    plot_convergence(summary, out / "convergence.png")
    return summary
