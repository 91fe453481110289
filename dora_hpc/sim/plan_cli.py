"""``dora-hpc plan RUN_DIR [--accelerators N] --out DIR``: fit the simulator to a run's logs (sim/fit.py),
say how well the fit reproduces the run, and print the ``--set`` lines of the best next submission."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..errors import fail


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from ..launch.local import LaunchError
    from ..store.shards import ShardError
    from .fit import plan

    try:
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task(f"plan {args.run_dir}", total=None)
            result = plan(Path(args.run_dir), args.accelerators, lambda: progress.advance(task),
                          vary_k="k" in args.vary)
    except (LaunchError, ShardError, ValueError, OSError) as e:
        return fail("plan", e)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    check = result["fit_check"]
    console.print(f"fit check: the logged run re-simulated gives a train-step interval of "
                  f"{check['simulated_step_s']:.2f} s against {check['measured_step_s']:.2f} s measured "
                  f"({check['relative_error']:+.1%}; {'within' if check['within'] else 'OUTSIDE'} "
                  f"{check['tolerance']:.0%})")
    measured = check["measured_trainer_wait"]
    console.print("the logged run's trainer waited: " + (_waits(measured) if measured is not None else "not logged")
                  + "; re-simulated: " + _waits(check["simulated_trainer_wait"]), soft_wrap=True, highlight=False)
    table = Table(title=f"predicted, {result['accelerators']} accelerators (measured "
                        f"{result['measured_tokens_per_s']:,.0f} trained tokens/s)")
    for col in ("rank", "--set", "tokens/s", "mean staleness", "max staleness", "step s", "trainer waits",
                "kept GB/trainer"):
        table.add_column(col, justify="right" if col != "--set" else "left", overflow="fold")
    for i, row in enumerate(result["candidates"][:8], 1):
        sets = " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in row["set"].items())
        mark = " (recommended)" if row["set"] == result["recommended"] else ""
        table.add_row(f"{i}{mark}", sets, f"{row['predicted_tokens_per_s']:,.0f}", f"{row['mean_staleness']:.2f}",
                      str(row["max_staleness"]),
                      f"{row['predicted_step_s']:.2f}", _waits(row["predicted_trainer_wait"]),
                      f"{row['weights']['kept_gb_per_trainer_rank']:.2f}")
    console.print(table)
    best = result["recommended"]
    within = f"{1 - result['recommend_within']:.0%}"
    console.print(f"recommended (the least stale within {within} of the fastest): " + " ".join(
        f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in best.items())
                  + _k_note(result["k"], best),
                  soft_wrap=True, highlight=False)  # one line, to copy whole
    console.print(f"wrote {out / 'plan.json'}")
    return 0


def _k_note(k: dict, best: dict) -> str:
    """What the recommendation does to K: kept (say so where K was not swept), or changed, and what it costs."""
    if not k["uses_k"]:
        return ""
    if not k["varied"]:
        return f" (keeps the run's dora.k={k['run']}; --vary k also weighs K, which trades reward for speed)"
    if best["dora.k"] == k["run"]:
        return f" (keeps the run's dora.k={k['run']})"
    return (f" (CHANGES K: dora.k {k['run']} -> {best['dora.k']}, so samples may be up to {best['dora.k']} steps "
            f"stale instead of {k['run']}; more staleness can cost reward: measure it with bench convergence)")


def _waits(w: dict[str, float]) -> str:
    """The trainer's idle share by what it waited for (core: Policy.train_wait), e.g. ``window 12%``."""
    return ", ".join(f"{k} {v:.0%}" for k, v in w.items() if v >= 0.005) or "none"


def _vary(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if bad := [x for x in names if x not in VARIABLE]:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(VARIABLE)}")
    return names


VARIABLE = ("k",)  # what --vary may name


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="fit the simulator to a run's logs and recommend the next split, K and elastic")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--accelerators", type=int, default=None,
                   help="plan for this many accelerators (default: the run's own ranks: trainers + rollout)")
    p.add_argument("--out", required=True, help="folder for plan.json")
    p.add_argument("--vary", type=_vary, default=[], metavar="k",
                   help="also sweep these settings the plan otherwise keeps as the run had them: k (dora.k, which "
                        "trades staleness, and so possibly reward, for tokens/s)")
    p.set_defaults(func=cmd_plan)
