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


def bench_convergence(config: str, out: Path, sets: list[str] | None = None, seeds: list[int] | None = None,
                      tail: int = 5, console=None) -> dict:
    from rich.progress import Progress

    sets, seeds = list(sets or []), list(seeds or [0, 1])
    _fresh(out)
    (out / "runs").mkdir()
    curves: dict[str, dict[str, list[float]]] = {c: {} for c in CASES}
    with Progress(console=console) as bar:
        task = bar.add_task("convergence", total=len(seeds) * len(CASES))
        for seed in seeds:
            for case, case_sets in CASES.items():
                bar.update(task, description=f"{case} (seed {seed})")
                a = run_case(config, [*sets, *case_sets, f"seed={seed}"], out / "runs" / f"{case}-s{seed}",
                             timeout_s=3600)
                curves[case][str(seed)] = a["reward_by_step"]
                bar.advance(task)
    cases = {}
    for case, by_seed in curves.items():
        n = min(len(c) for c in by_seed.values())
        mean = [statistics.fmean(c[i] for c in by_seed.values()) for i in range(n)]
        finals = [final(c, tail) for c in by_seed.values()]
        cases[case] = {"curves": by_seed, "mean": mean, "first": mean[0], "final": statistics.fmean(finals),
                       "final_by_seed": finals}
    noise = max(cases["sync"]["final_by_seed"]) - min(cases["sync"]["final_by_seed"])
    verdict = {c: {"gap_to_sync": cases[c]["final"] - cases["sync"]["final"],
                   "within_noise": abs(cases[c]["final"] - cases["sync"]["final"]) <= noise}
               for c in cases if c != "sync"}
    summary = {"config": config, "sets": sets, "seeds": seeds, "tail_steps": tail, "machine": machine(),
               "sync_seed_spread": noise, "verdict": verdict, "cases": cases,
               "title": f"mean reward per step ({config}, seeds {seeds})"}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from .plots import plot_convergence

    plot_convergence(summary, out / "convergence.png")
    return summary
