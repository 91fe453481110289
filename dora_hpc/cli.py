"""The one entry point: ``dora-hpc <command>``.

Exit codes: 0 success, 1 a failure while running, 2 bad usage or a bad config (the message names
the key), 3 stopped by a signal (SIGTERM/SIGINT/SIGUSR1) after committing a checkpoint of the current
step (continue with ``run --resume``), 75 stopped by a full disk (free space, then ``run --resume``),
128 + N stopped at once by a second signal N.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from rich.console import Console

from . import __version__
from .config import ConfigError, load_config
from .core.policies import MODES, traits_of
from .errors import fail


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set dora.k=3 (repeatable)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _print_waits(summary: dict, console: Console) -> None:
    """What each simulated mode's trainer waited for, and its borrowed instances' drains."""
    for mode, row in summary["modes"].items():
        w = row["trainer_wait_fraction"]
        console.print(f"{mode}: the trainer waited {sum(w.values()):.0%} of the time: {w['capacity']:.0%} for rollout "
                      f"capacity, {w['tail']:.0%} for a batch's tail, {w['window']:.0%} for the window's oldest groups",
                      soft_wrap=True, highlight=False)
        if row["borrowed_instances"]:
            console.print(f"{mode}: {row['borrowed_instances']} borrowed instances on the trainer's accelerators; "
                          f"the trainer waited {row['drain_wait_s']:.1f} s a step for their drain "
                          f"({row['drain_migrations']:,} requests migrated, {row['drain_offloads']:,} offloaded); "
                          f"{row['limit_share']:.0%} of the limit counting them ({row['limit_tokens_per_s']:,.0f})")


def cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    from .sim.report import render_table, simulate_modes, suggest_split, write_outputs

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    if args.suggest_split:
        result = suggest_split(cfg, console)
        out.mkdir(parents=True, exist_ok=True)
        (out / "split.json").write_text(json.dumps(result, indent=2) + "\n")
        b = result["best"]
        console.print(f"best split for DORA: {b['rollout_instances']} rollout instances "
                      f"({b['rollout_accelerators']} accelerators) + {b['train_accelerators']} for training "
                      f"-> {b['throughput_tokens_per_s']:,.0f} tokens/s;  "
                      f"set cluster.rollout_instances={b['rollout_instances']}")
        return 0
    if args.sensitivity:
        from .sim.sweeps import markdown_table, sensitivity

        rows = sensitivity(cfg, console)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sensitivity.json").write_text(json.dumps(rows, indent=2) + "\n")
        (out / "sensitivity.md").write_text(markdown_table(rows))
        console.print(markdown_table(rows))
        console.print(f"wrote {out / 'sensitivity.json'}, {out / 'sensitivity.md'}")
        return 0
    if args.frontier:
        from .sim.frontier import write_frontier

        write_frontier(cfg, out, _ints(args.seeds, "--seeds"), _ints(args.ks, "--ks"),
                       f"{args.config} {' '.join(args.overrides)}", console, args.workers)
        return 0
    modes = tuple(args.modes.split(",")) if args.modes else MODES
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if any(traits_of(m, cfg.dora.k).uses_k for m in modes) and cfg.sim.warmup_steps <= cfg.dora.k:
        console.print(f"note: sim.warmup_steps ({cfg.sim.warmup_steps}) <= dora.k ({cfg.dora.k}): DORA's measured "
                      "window holds the pipeline's fill (at step K the trainer first waits for every group admitted "
                      f"at the start); its steady state: --set sim.warmup_steps={2 * cfg.dora.k} and more sim.steps",
                      soft_wrap=True, highlight=False)
    if args.run_dir and any(any(Path(args.run_dir, m).glob("*.h5")) for m in modes):
        raise ConfigError(f"--run-dir {args.run_dir}: a mode's directory already holds a run's logs; choose an "
                          "empty one")
    summary, sims = simulate_modes(cfg, modes, timeline=not args.no_plots, console=console,
                                   run_dir=Path(args.run_dir) if args.run_dir else None)
    console.print(render_table(summary, f"{args.config}: {cfg.cluster.accelerators} accelerators"))
    if "dora_over_sync" in summary:
        console.print(f"DORA / sync throughput: {summary['dora_over_sync']:.2f}x; zero-bubble limit "
                      f"{summary['limit_tokens_per_s']:,.0f} tokens/s")
    _print_waits(summary, console)
    paths = write_outputs(summary, sims, out, plots=not args.no_plots)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    if args.run_dir:
        console.print(f"wrote each mode's HDF5 logs under {args.run_dir}/<mode>/: dora-hpc analyze opens them "
                      "like a real run's", soft_wrap=True)
    return 0


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from .config import parse_overrides, validate, with_overrides
    from .launch.local import PREEMPTED, RESUMABLE, LaunchError, launch, saved_config

    run_dir = Path(args.run_dir)
    if args.allow_fresh and not args.resume:
        raise ConfigError("--allow-fresh only goes with --resume")
    try:
        if args.config is None:
            if not args.resume:
                raise ConfigError("CONFIG is required (only --resume may omit it: the run's own config is used)")
            cfg = with_overrides(validate(saved_config(run_dir), saved=True), dict(parse_overrides(args.overrides)))
        else:
            cfg = load_config(args.config, args.overrides)
        resume = ("if_any" if args.allow_fresh else "required") if args.resume else "no"
        console.print(f"dora-hpc run: mode={cfg.mode} K={cfg.dora.k} ranks=1+{cfg.cluster.trainer_ranks}+"
                      f"{cfg.cluster.rollout_instances} steps={cfg.train.max_steps} -> {run_dir}"
                      + (" (resume)" if args.resume else ""))
        code = launch(cfg, run_dir, resume)
    except LaunchError as e:
        return fail("cannot launch", e)
    if code in (PREEMPTED, RESUMABLE) or code > 128:  # said why: a signal (3: at a checkpoint; 128 + N: at
        return code                                     # once) or a full disk (75)
    if code != 0:
        return fail("run failed", f"exit {code}; logs so far are in {run_dir}; continue with: "
                                  f"dora-hpc run --resume --run-dir {run_dir}", code=1)
    from .analysis.basic import analyze

    a = analyze(run_dir)
    rewards = a["reward_by_step"]
    inv = ", ".join(f"{k}={v}" for k, v in a["invariants"].items() if k != "offenders")
    console.print(f"run finished: {a['steps']} steps, {a['consumed']} trajectories trained on; mean reward "
                  f"{rewards[0]:.3f} (step 0) -> {rewards[-1]:.3f} (step {len(rewards) - 1}); staleness "
                  f"{a['staleness']['histogram']} (mean {a['staleness']['mean']:.2f}); {a['migrations']} migrations, "
                  f"{a['reprefill_tokens']} re-prefilled tokens; max {a['max_live_versions']} versions live at once; "
                  f"{a['throughput_tokens_per_s']:,.0f} trained tokens/s after step 0"
                  + (f"; logprob gap rollout vs trainer <= {a['logprob_gap']['max']:.1e}"
                     if a["logprob_gap"]["max"] is not None else ""))
    if a["turns"]["max"] > 1:  # multi-turn episodes (env.name)
        console.print(f"episodes: {a['turns']['mean']:.2f} turns on average (max {a['turns']['max']}); environment "
                      f"time {100 * a['env_time_fraction']:.0f}% of episode time; {a['env_errors']} environment "
                      f"errors; {a['multi_version_episodes']} episodes spanned versions")
    console.print(f"invariants: {inv}")
    console.print(f"HDF5 logs in {run_dir}; more: dora-hpc analyze {run_dir} --json out.json")
    return 0


def cmd_finish(args: argparse.Namespace, console: Console) -> int:
    from .launch.local import LaunchError, saved_config
    from .store.finish import ask_finish

    run_dir = Path(args.run_dir)
    try:
        max_steps = int(saved_config(run_dir)["train"]["max_steps"])
    except (LaunchError, KeyError, TypeError, ValueError) as e:
        return fail("not a run directory", e)
    if args.at < 1:
        return fail("bad --at", f"--at {args.at}: a step is 1 or more")
    if args.at > max_steps:
        return fail("bad --at", f"--at {args.at} is past train.max_steps={max_steps}: the run ends there anyway")
    ask_finish(run_dir, args.at)
    console.print(f"asked {run_dir} to finish at step {args.at}: it checkpoints and exits 0 there (at its next "
                  "step if that one is trained already; a stopped run, when it resumes)")
    return 0


def cmd_submit(args: argparse.Namespace, console: Console) -> int:
    import time

    import yaml

    from .launch.local import LaunchError
    from .launch.slurm import script, submit

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or f"runs/{cfg.slurm.job_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if args.dry_run:
        console.print("# resolved config", highlight=False)
        console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), highlight=False, markup=False)
        console.print(f"# sbatch script (run dir {run_dir})", highlight=False)
        console.print(script(cfg, run_dir), highlight=False, markup=False)
        return 0
    try:
        job = submit(cfg, run_dir, "required" if args.resume else "no")
    except LaunchError as e:
        return fail("cannot submit", e)
    console.print(f"submitted job {job.job_id}: {1 + cfg.cluster.trainer_ranks} orchestrator/trainer + "
                  f"{cfg.cluster.rollout_instances} rollout ranks, one MPI world -> {run_dir}", soft_wrap=True)
    console.print(f"follow: tail -f {job.paths.stdout}; afterwards: dora-hpc analyze {run_dir}", soft_wrap=True)
    return 0


def cmd_prepare(args: argparse.Namespace, console: Console) -> int:
    """For sbatch scripts: write RUN_DIR/launch.json once; a requeued start (or --resume) keeps the run."""
    import os

    from .launch.local import LaunchError, prepare

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir).resolve()
    again = (run_dir / "launch.json").exists() and (int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
                                                    or args.resume)
    try:
        prepare(cfg, run_dir, "if_any" if again else "no")
    except LaunchError as e:
        return fail("cannot prepare", e)
    console.print(f"{'kept' if again else 'prepared'} {run_dir / 'launch.json'}", soft_wrap=True)
    return 0


def cmd_join(args: argparse.Namespace, console: Console) -> int:
    """Become a rank of a running job in a fenced one's place (runtime/join.py), or (--submit) ask
    Slurm for a node to run one on."""
    import os

    from .launch.local import LaunchError

    run_dir = Path(args.run_dir).resolve()
    if args.submit:
        from .launch.slurm import submit_replacement

        try:
            job = submit_replacement(run_dir, args.overrides, args.nodelist, args.role)
        except LaunchError as e:
            return fail("cannot submit a replacement", e)
        console.print(f"submitted replacement job {job}: it joins {run_dir} once Slurm starts it", soft_wrap=True)
        return 0
    if not any(k in os.environ for k in ("PMI_RANK", "PMI_FD", "PMI_PORT", "PMIX_RANK")):
        # no process manager: MPICH would make this a singleton, and singletons started apart share the
        # name MPICH knows them by, so a second replacement could not be linked (slurm/NOTES.md)
        import shutil

        mpiexec = str(Path(sys.executable).with_name("mpiexec")) if Path(sys.executable).with_name(
            "mpiexec").exists() else shutil.which("mpiexec")
        if mpiexec is None:
            return fail("cannot join", "no mpiexec to start the replacement under (or run it under srun)")
        os.execv(mpiexec, [mpiexec, "-n", "1", sys.executable, "-m", "dora_hpc.cli", *sys.argv[1:]])
    from .runtime.replacement import main as join

    try:
        code = join(str(run_dir), args.overrides, args.role)
    except ConfigError:
        raise
    except BaseException as e:  # noqa: BLE001 - after MPI_Init: leave without MPI_Finalize (below)
        print(f"dora-hpc: join failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: its links (gloo) may still have a receive pending (runtime/link.py)


def cmd_analyze(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from .analysis.basic import analyze
    from .analysis.report import summary_rows, write_html
    from .store.shards import ShardError

    if args.trace and len(args.run_dirs) > 1:
        raise ConfigError("--trace: one run at a time (a trace is one run's timeline)")
    results = []
    figures = Path(args.plots) if args.plots else None
    tmp = None
    if args.html and figures is None:  # the page needs figures: drawn aside, then inlined
        import tempfile

        tmp = tempfile.TemporaryDirectory()
        figures = Path(tmp.name)
    for run_dir in args.run_dirs:
        plots = None
        if figures is not None:
            plots = figures / Path(run_dir).name if len(args.run_dirs) > 1 else figures
        try:
            with warnings.catch_warnings(), Console(stderr=True).status(f"analyze {run_dir}"):
                warnings.simplefilter("ignore")  # each skipped shard is named below, on one line
                results.append(analyze(run_dir, plots, args.trace))
        except ShardError as e:
            return fail("analyze", e)
    table = Table(title="runs side by side" if len(results) > 1 else "run")
    table.add_column("figure")
    for r in results:
        table.add_column(f"{r['run_dir']} ({r['mode']})", justify="right")
    for label, values in summary_rows(results):
        table.add_row(label, *values)
    console.print(table)
    for r in results:  # a run still going, or killed, has incomplete logs: say what was left out
        if r["missing"]:
            console.print(f"{r['run_dir']}: partial logs, analysed without: " + "; ".join(r["missing"]),
                          soft_wrap=True, highlight=False, markup=False)
    if args.json:
        out = results[0] if len(results) == 1 else {"runs": results}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    if args.html:
        write_html(Path(args.html), results)
        console.print(f"wrote {args.html} (one self-contained page: open it in any browser)")
    if args.trace:
        console.print(f"wrote {args.trace}: open it in https://ui.perfetto.dev (or chrome://tracing)")
    if tmp is not None:
        tmp.cleanup()
    return 0


def _add_join_parser(sub) -> None:
    j = sub.add_parser("join", help="a replacement: this process takes a fenced rollout rank's or trainer "
                                    "replica's place in a running job")
    j.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run directory")
    j.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key as this replacement has it (rank 0 refuses one whose config differs)")
    j.add_argument("--submit", action="store_true",
                   help="ask Slurm for a node and run the replacement there (a one-task job: it joins once it starts)")
    j.add_argument("--nodelist", help="--submit: the node(s) to ask for (sbatch --nodelist)")
    j.add_argument("--role", choices=("trainer", "rollout"),
                   help="take a lost rank of this role only (a trainer replica, train.replicas; or a rollout rank); "
                        "--submit asks for that component's resources (slurm.trainer or slurm.rollout)")
    j.set_defaults(func=cmd_join)


def _add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="run every policy through the cluster simulator")
    _add_config_args(p)
    p.add_argument("--out", required=True, help="output directory (summary.json, timelines)")
    p.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--suggest-split", action="store_true",
                   help="sweep the rollout/train split for DORA and print the best one")
    p.add_argument("--sensitivity", action="store_true",
                   help="sweep tail weight, length cap, K, RBS, train and prefill speed (sync, partial, dora)")
    p.add_argument("--frontier", action="store_true",
                   help="tokens/s against mean staleness: DORA's admission levels at each K, with sync, one-step and "
                   "partial (frontier.json, .md, .png)")
    p.add_argument("--seeds", default="0", help="--frontier: comma-separated seeds (default 0)")
    p.add_argument("--workers", type=int, default=2, help="--frontier: simulations run at once (default 2)")
    p.add_argument("--ks", default="1,2,3", help="--frontier: comma-separated K values (default 1,2,3; the config's "
                   "own K is always added)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG timelines")
    p.add_argument("--run-dir", help="also write each mode's run as the runtime's HDF5 logs into RUN_DIR/<mode>/ "
                   "(docs/hdf5-schema.md), for dora-hpc analyze")
    p.set_defaults(func=cmd_simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dora-hpc", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dora-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate_parser(sub)
    r = sub.add_parser("run", help="a real training run: orchestrator + trainer + rollout ranks under mpiexec")
    r.add_argument("config", nargs="?", help="YAML config (see configs/); optional with --resume")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set dora.k=3 (repeatable)")
    r.add_argument("--run-dir", required=True, help="where the HDF5 logs and checkpoints go")
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest checkpoint that verifies")
    r.add_argument("--allow-fresh", action="store_true",
                   help="with --resume: when there is no checkpoint, start the run again from step 0")
    r.set_defaults(func=cmd_run)
    sb = sub.add_parser("submit", help="submit a run to Slurm: one heterogeneous job, one MPI world (submitit)")
    _add_config_args(sb)
    sb.add_argument("--run-dir", help="where the HDF5 logs and checkpoints go (default runs/<job_name>-<time>)")
    sb.add_argument("--dry-run", action="store_true", help="print the resolved config and the sbatch script")
    sb.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    sb.set_defaults(func=cmd_submit)
    pr = sub.add_parser("prepare", help="write RUN_DIR/launch.json for an sbatch script (slurm/dora.sbatch)")
    _add_config_args(pr)
    pr.add_argument("--run-dir", required=True)
    pr.add_argument("--resume", action="store_true", help="the run exists: keep it (resume on the next start)")
    pr.set_defaults(func=cmd_prepare)
    _add_join_parser(sub)
    f = sub.add_parser("finish", help="end a run at a step, as at train.max_steps: it checkpoints and exits 0")
    f.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (running, or stopped to resume)")
    f.add_argument("--at", type=int, required=True, metavar="STEP", help="the last step to train (>= 1)")
    f.set_defaults(func=cmd_finish)
    a = sub.add_parser("analyze", help="staleness, invariants and mechanisms of a run, from its HDF5 logs")
    a.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one run, or several to compare side by side")
    a.add_argument("--json", help="write the figures as JSON here ({'runs': [...]} for several)")
    a.add_argument("--plots", help="write PNG figures here (timeline, allocation, staleness, stratified)")
    a.add_argument("--html", metavar="OUT.html", help="write one self-contained page: the table, every figure "
                   "inline, the invariants' offenders")
    a.add_argument("--trace", metavar="TRACE.json", help="write the run's timeline as a Perfetto/Chrome trace: "
                   "engine steps by version, ops, train steps, the trainer's waits and their gating requests")
    a.set_defaults(func=cmd_analyze)
    from .bench.cli import add_parser as add_bench
    from .evaluate import add_parser as add_eval
    from .export import add_parser as add_export
    from .sim.plan_cli import add_parser as add_plan

    add_eval(sub)
    add_export(sub)
    add_bench(sub)
    add_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        return args.func(args, console)
    except ConfigError as e:
        return fail("config error", e)


if __name__ == "__main__":
    sys.exit(main())
