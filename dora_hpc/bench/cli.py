"""``dora-hpc bench WHAT``: the benchmarks' command line, one function per benchmark (BENCHES).

Every benchmark validates its arguments (exit 2 naming the option) before it runs anything, and writes
OUT/summary.json plus its figures; a run that fails or breaks an invariant exits 1 naming its log.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..config import ConfigError, load_config
from ..errors import fail
from .modes_bench import CASES as MODE_CASES
from .modes_bench import RUN_TIMEOUT_S


def bench_engine_cmd(args: argparse.Namespace, console: Console) -> None:
    from ..engine.local_models import build_tiny_model, convert_smollm2
    from .engine_bench import bench_engine

    models = {"tiny-qwen2": build_tiny_model()}
    if not args.tiny_only:
        models["smollm2-135m"] = convert_smollm2()
    bench_engine(models, Path(args.out), repeats=args.repeats, console=console)
    console.print(f"wrote {args.out}/summary.json and {args.out}/engine.png")


def bench_analysis_cmd(args: argparse.Namespace, console: Console) -> None:
    import tempfile

    from .analysis_bench import bench_analysis

    with tempfile.TemporaryDirectory() as tmp, Console(stderr=True).status(
            f"bench analysis: writing and analysing {args.trajectories:,} trajectories"):
        s = bench_analysis(Path(args.out), args.trajectories, Path(tmp) / "run")
    console.print(f"analyze on {s['trajectories']:,} synthetic trajectories ({s['steps']:,} steps): "
                  f"{s['analyze_s']:.1f} s, peak RSS {s['peak_rss_mib']:.0f} MiB; invariants "
                  f"{s['invariants']}; wrote {args.out}/summary.json")


def bench_modes_cmd(args: argparse.Namespace, console: Console) -> None:
    from . import modes_bench as mb

    modes = args.modes.split(",") if args.modes else None
    unknown = sorted(set(modes or []) - set(mb.CASES))
    if unknown:
        raise ConfigError(f"--modes: unknown {unknown}; choose from {','.join(mb.CASES)}")
    s = mb.bench_modes(args.config, Path(args.out), args.overrides, args.repeats, modes,
                       unpaced=not args.no_unpaced, console=console, timeout_s=args.run_timeout)
    print_cases(console, s["modes"], s["ratios"])


def bench_ablation_cmd(args: argparse.Namespace, console: Console) -> None:
    from . import modes_bench as mb

    if args.ablation not in mb.ABLATIONS:
        raise ConfigError(f"--ablation: unknown {args.ablation!r}; choose from {','.join(mb.ABLATIONS)}")
    s = mb.bench_ablation(args.config, Path(args.out), args.overrides, args.repeats, console=console,
                          which=args.ablation, timeout_s=args.run_timeout)
    print_cases(console, s["variants"], s["ratios"])


def bench_convergence_cmd(args: argparse.Namespace, console: Console) -> None:
    from .convergence_bench import CASES, DEFAULT_CASES, LOSSES, bench_convergence

    seeds = [int(x) for x in args.seeds.split(",")]
    losses = args.losses.split(",")
    bad = [x for x in losses if x not in LOSSES]
    if bad:
        raise ConfigError(f"--losses: unknown {bad}; choose from {','.join(LOSSES)}")
    which = args.cases.split(",") if args.cases else DEFAULT_CASES
    bad = [x for x in which if x not in CASES]
    if bad or "sync" not in which:
        raise ConfigError(f"--cases: {'unknown ' + str(bad) if bad else 'sync (the baseline) is missing'}"
                          f"; choose from {','.join(CASES)}")
    if args.eval < 0:
        raise ConfigError(f"--eval: {args.eval} held-out prompts; give 0 (none) or more")
    s = bench_convergence(args.config, Path(args.out), args.overrides, seeds, console=console,
                          losses=losses, which=which, eval_n=args.eval)
    for case, c in s["cases"].items():
        v = s["verdict"].get(case)
        console.print(f"  {case}: mean reward {c['first']:.3f} (step 0) -> {c['final']:.3f} (last "
                      f"{s['tail_steps']} steps), clip_frac {c['clip_frac']:.3f}"
                      + (f"; gap to {s['baseline']} {v['gap_to_sync']:+.3f}, "
                         f"{'within' if v['within_noise'] else 'outside'} its seed spread "
                         f"{s['sync_seed_spread']:.3f}" if v else "")
                      + (f"; reaches {c['reach']['reward']:.3f} at step {c['reach']['median_step']:g}, "
                         f"{c['reach']['median_s']:.0f} s (median over seeds)" if c["reach"]["median_s"] is not None
                         else "; some seed never reaches the reward"))
    for case, v in s.get("heldout", {}).get("verdict", {}).items():
        console.print(f"  {case}: held-out greedy mean reward {s['cases'][case]['heldout_final']:.3f}"
                      " (over the initial model: " + ", ".join(
                          f"seed {k} {g:+.3f}" for k, g in v["gain_over_initial_by_seed"].items()) + ")"
                      + (f"; gap to {s['baseline']} {v['gap_to_sync']:+.3f}, sync's seed spread "
                         f"{s['heldout']['sync_seed_spread']:.3f}" if case != s["baseline"] else ""))


def bench_agent_gateway_cmd(args: argparse.Namespace, console: Console) -> None:
    from .agent_bench import bench_agent_gateway

    if args.episodes < 1 or args.turns < 2 or args.repeats < 1:
        raise ConfigError("--episodes and --repeats must be >= 1 and --turns >= 2")
    s = bench_agent_gateway(Path(args.out), args.episodes, args.turns, args.repeats, console=console)
    for case, m in s["medians"].items():
        console.print(f"{case}: {m['turns_per_s']:.1f} turns/s; turn end -> next turn p50 {m['gap_ms_p50']:.1f} ms, "
                      f"p99 {m['gap_ms_p99']:.1f} ms; first turn p50 {m['first_ms_p50']:.1f} ms")
    console.print(f"the endpoint adds {s['added_gap_ms_p50']:.1f} ms (p50), {s['added_gap_ms_p99']:.1f} ms (p99) "
                  f"a call; turns/s {s['turns_per_s_ratio']:.2f}x; wrote {args.out}/summary.json")


def bench_speculation_cmd(args: argparse.Namespace, console: Console) -> None:
    from .speculation_bench import CASES, bench_speculation

    cases = args.cases.split(",") if args.cases else list(CASES)
    if unknown := sorted(set(cases) - set(CASES)):
        raise ConfigError(f"--cases: unknown {unknown}; choose from {','.join(CASES)}")
    if args.repeats < 1 or args.prompts < 1:
        raise ConfigError("--repeats and --prompts must be >= 1")
    bench_speculation(Path(args.out), cases, prompts=args.prompts, repeats=args.repeats, console=console)
    console.print(f"wrote {args.out}/summary.json and {args.out}/speculation.png")


# what -> (its function, whether it runs a config: those write runs under OUT/runs)
BENCHES = {"engine": (bench_engine_cmd, False), "analysis": (bench_analysis_cmd, False),
           "modes": (bench_modes_cmd, True), "ablation": (bench_ablation_cmd, True),
           "convergence": (bench_convergence_cmd, True), "agent-gateway": (bench_agent_gateway_cmd, False),
           "speculation": (bench_speculation_cmd, False)}


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from .modes_bench import BenchError

    args.out = args.out or f"results/{args.what}"
    run, uses_config = BENCHES[args.what]
    if uses_config:
        if args.config is None:
            raise ConfigError(f"bench {args.what}: CONFIG is required (e.g. configs/bench-modes.yaml)")
        load_config(args.config, args.overrides)  # a bad config fails here, not in the first run
        if args.run_timeout <= 0:
            raise ConfigError(f"--run-timeout: must be > 0 seconds, got {args.run_timeout:g}")
    try:
        run(args, console)
    except BenchError as e:
        return fail(f"bench {args.what}", e, code=1)
    if uses_config:
        console.print(f"wrote {args.out}/summary.json (runs and their logs in {args.out}/runs)")
    return 0


def print_cases(console: Console, cases: dict, ratios: dict) -> None:
    from rich.table import Table

    table = Table(title="medians over interleaved repeats")
    table.add_column("figure")
    for c in cases:
        table.add_column(c, justify="right")
    for key in ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "slot_utilization",
                "slot_utilization_limit", "inter_instance_bubble", "max_staleness", "migrations",
                "reprefill_tokens", "engine_steps_per_trained_token", "instance_busy_s"):
        table.add_row(key, *[f"{v[key]:.4g}" for v in cases.values()])
    console.print(table)
    for k, v in ratios.items():
        console.print(f"  {k}: {v:.3f}" if v is not None else f"  {k}: -")


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (long-running; results/ holds committed outputs)")
    b.add_argument("what", choices=list(BENCHES),
                   help="engine: built-in engine vs transformers generate; analysis: analyze on a large log; "
                        "modes: the five modes on the real runtime; ablation: one mechanism on vs off (--ablation); "
                        "convergence: mean reward per step of sync and dora (--cases), held-out eval (--eval); "
                        "agent-gateway: an agent's calls through the endpoint against an environment's steps; "
                        "speculation: the built-in engine's speculative decoding by method and batch size")
    b.add_argument("config", nargs="?", help="modes/ablation/convergence: the run config (see configs/bench-*.yaml)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="modes/ablation/convergence: override a config key in every run (repeatable)")
    b.add_argument("--seeds", default="0,1", help="convergence: comma-separated seeds (their spread is the noise)")
    b.add_argument("--losses", default="ppo_clip", help="convergence: comma-separated objectives, each running "
                   "every case: ppo_clip, ppo_clip+truncate, decoupled, decoupled+truncate, decoupled+mask, gspo")
    b.add_argument("--cases", help="convergence: comma-separated subset of sync,dora-k1,dora-k2,dora-k3,"
                   "dora-k3-eager,dora-k3-lean,partial "
                   "with sync (default sync,dora-k1,dora-k3); speculation: of smollm2-addition,tiny (default both)")
    b.add_argument("--prompts", type=int, default=8, help="speculation: prompts per epoch (G samples each)")
    b.add_argument("--eval", type=int, default=0, metavar="N", help="convergence: score each run's final "
                   "checkpoint and each seed's initial model on N held-out prompts (dora-hpc eval; 0: none)")
    b.add_argument("--modes", help="modes: comma-separated subset of " + ",".join(MODE_CASES))
    b.add_argument("--no-unpaced", action="store_true", help="modes: skip the unpaced pass")
    b.add_argument("--ablation", default="kv-migration",
                   help="ablation: kv-migration (DORA migrating with KV vs by re-prefill) or weight-serving "
                        "(the trainer answering weight requests during its step vs between steps)")
    b.add_argument("--out", help="output directory (default results/<what>)")
    b.add_argument("--trajectories", type=int, default=1_000_000, help="analysis: size of the synthetic log")
    b.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT_S, metavar="S",
                   help="modes/ablation: fail a run (naming its log) that is still running after S seconds")
    b.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per case (median reported)")
    b.add_argument("--tiny-only", action="store_true", help="skip SmolLM2-135M")
    b.add_argument("--episodes", type=int, default=8, help="agent-gateway: episodes at once (one instance)")
    b.add_argument("--turns", type=int, default=8, help="agent-gateway: turns (calls) per episode")
    b.set_defaults(func=cmd_bench)
