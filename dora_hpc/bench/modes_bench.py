"""``dora-hpc bench modes|ablation``: the real runtime's modes side by side, from their HDF5 logs.

Every case is a real ``dora-hpc run`` (its own mpiexec job: orchestrator, trainer, rollout ranks,
GRPO steps) followed by ``analyze`` of its run dir. Cases run interleaved -- repeat 0 of every case,
then repeat 1, ... -- so each sees the same machine conditions; per case the median over repeats is
reported, and ratios are medians of the per-repeat ratios of cases run back to back.

Invariant: every figure comes from the run's own logs (``analysis.basic.analyze``); a run that fails
or breaks an invariant fails the benchmark (its log is named) rather than being left out.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from ..config import ConfigError, load_config, parse_overrides

CASES: dict[str, list[str]] = {
    "sync": ["mode=sync"], "one_step": ["mode=one_step"], "partial": ["mode=partial"],
    "oversample": ["mode=oversample"],
    "dora-k1": ["mode=dora", "dora.k=1"], "dora-k2": ["mode=dora", "dora.k=2"], "dora-k3": ["mode=dora", "dora.k=3"],
    "dora-k2-auto": ["mode=dora", "dora.k=2", "batch.rbs=auto"],  # in flight: what the slots and the window allow
    "dora-elastic": ["mode=dora", "dora.k=2", "cluster.elastic=true"],  # trainer ranks host borrowed instances
    "dora-k2-lean": ["mode=dora", "dora.k=2", "dora.admission=lean"],  # hold what keeps slots and trainer busy
    "dora-k2-eager": ["mode=dora", "dora.k=2", "dora.admission=eager"],  # fill the window, whatever the default
    "dora-k2-work": ["mode=dora", "dora.k=2", "dora.planner=work"],  # the planner weighs decode tokens left
}
SERVE, BETWEEN = "runtime.serve_weights_while_training=true", "runtime.serve_weights_while_training=false"
ABLATIONS: dict[str, dict] = {  # name -> its cases and the (with, without) pairs whose ratios are reported
    "kv-migration": {
        "title": "DORA: migrate with KV vs by re-prefill",
        "cases": {"kv-migration": ["mode=dora", "dora.kv_migration=true"],
                  "reprefill": ["mode=dora", "dora.kv_migration=false"]},
        "pairs": [("kv-migration", "reprefill")],
        "panels": [("instance_busy_s", "rollout time: busy seconds per instance"),
                   ("mean_step_time_s", "mean train-step interval (s)"),
                   ("reprefill_tokens", "re-prefilled tokens")]},
    "weight-serving": {
        "title": "trainer serves weights while its step computes vs only between steps",
        "cases": {"one_step-serve": ["mode=one_step", SERVE], "one_step-between": ["mode=one_step", BETWEEN],
                  "dora-k2-serve": ["mode=dora", "dora.k=2", SERVE],
                  "dora-k2-between": ["mode=dora", "dora.k=2", BETWEEN]},
        "pairs": [("one_step-serve", "one_step-between"), ("dora-k2-serve", "dora-k2-between")],
        "panels": [("throughput_tokens_per_s", "trained tokens / s"),
                   ("weight_load_share", "weight loads: share of instance time"),
                   ("mean_step_time_s", "mean train-step interval (s)")]},
    "prefix-caching": {
        "title": "a prompt shared by a group (or every request) prefilled and held once vs per sequence",
        "cases": {"shared": ["engine.prefix_caching=true"], "unshared": ["engine.prefix_caching=false"]},
        "pairs": [("shared", "unshared")],
        "panels": [("prefill_tokens_per_trajectory", "prefill tokens per trajectory"),
                   ("kv_blocks_per_group_at_peak", "KV blocks per group at peak"),
                   ("peak_running", "peak sequences running on an instance")]},
}
FIGURES = ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "slot_utilization",
           "bubble_fraction", "inter_instance_bubble", "max_staleness", "mean_staleness", "reprefill_tokens",
           "migrations", "engine_steps_per_trained_token", "instance_busy_s", "limit_tokens_per_s", "limit_share",
           "slot_utilization_limit", "weight_load_share", "engine_s_per_trained_token", "prefill_tokens_per_trajectory",
           "prefix_hit_tokens", "peak_running", "kv_blocks_per_group_at_peak")


RUN_TIMEOUT_S = 1800.0  # a run still going after this fails the benchmark (--run-timeout)


class BenchError(RuntimeError):
    """A benchmark run that failed or broke an invariant; the message names its log."""


# the paced pass of bench modes and ablation: (its KEY=VALUEs, what to do instead of a --set)
PACED = (["engine.pacing=true"], "bench modes runs an unpaced pass too (unless --no-unpaced)")


def refuse_overridden(sets: list[str], setters: dict[str, tuple[list[str], str]]) -> None:
    """A ``--set`` whose key a benchmark's case sets too would silently lose (the case's comes last): refuse
    it, naming both. ``setters``: who sets keys (``"--losses ppo_clip"``) -> (its KEY=VALUEs, the way to
    choose that key instead)."""
    for s, (key, _) in zip(sets, parse_overrides(sets), strict=True):
        for who, (theirs, instead) in setters.items():
            if key in dict(parse_overrides(theirs)):
                raise ConfigError(f"--set {s}: {who} sets {key} in its runs and would override it; {instead}")


def run_case(config: str, sets: list[str], run_dir: Path, timeout_s: float) -> dict:
    """One real run (``dora-hpc run`` in a subprocess, output to RUN_DIR.log), analysed."""
    from ..analysis.basic import analyze

    log = run_dir.with_suffix(".log")
    cmd = [sys.executable, "-m", "dora_hpc.cli", "run", config, "--run-dir", str(run_dir)]
    cmd += [a for s in sets for a in ("--set", s)]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _end(proc)
            raise BenchError(f"{run_dir.name}: still running after {timeout_s:g} s (--run-timeout); "
                             f"see {log}") from None
    if code != 0:
        raise BenchError(f"{run_dir.name}: dora-hpc run exited {code}; see {log}")
    a = analyze(run_dir)
    bad = {k: v for k, v in a["invariants"].items() if k != "offenders" and v}
    if bad:
        raise BenchError(f"{run_dir.name}: invariants broken {bad}; see {log}")
    return a


def _end(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """End a ``dora-hpc run`` and its ranks: its launcher takes a first SIGTERM as "checkpoint and stop"
    (resumable with ``--resume``) and, ``grace_s`` later, a second as "end every rank now"."""
    for wait_s in (grace_s, 30):
        proc.terminate()
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()  # the launcher itself: mpiexec and every rank die with it (PR_SET_PDEATHSIG)
    proc.wait()


def figures(a: dict, cfg) -> dict:
    """The per-run figures of the summary (``a`` is analyze's output)."""
    from ..store.shards import read_table

    steps = read_table(Path(a["run_dir"]), "train", "steps", ["t_start", "t_end", "tokens"])
    dur = steps["t_end"] - steps["t_start"]
    train_rate = statistics.median((steps["tokens"] / dur.clip(min=1e-9)).tolist())
    n_inst = cfg.cluster.rollout_instances
    # zero-bubble limit: every instance decodes a full batch every (paced) step, bounded by the trainer
    full_rate = n_inst * cfg.cluster.max_num_seqs / cfg.engine.step_time_s if cfg.engine.pacing else float("inf")
    limit = min(full_rate, train_rate)
    return {
        "throughput_tokens_per_s": a["throughput_tokens_per_s"],
        "mean_step_time_s": a["window_s"] / max(a["steps"] - 1, 1),  # analyze's window leaves step 0 out
        "rollout_only_fraction": a["rollout_only_fraction"],
        "slot_utilization": a["slot_utilization"],
        "bubble_fraction": a["bubble_fraction"],
        "inter_instance_bubble": a["inter_instance_bubble"],
        "max_staleness": a["staleness"]["max"],
        "mean_staleness": a["staleness"]["mean"],
        "reprefill_tokens": a["reprefill_tokens"],
        "migrations": a["migrations"],
        "engine_steps_per_trained_token": a["engine_steps_per_trained_token"],
        "instance_busy_s": a["instance_busy_s"],
        # rollout's seconds per trained token: every instance's busy seconds in the window over its trained tokens
        "engine_s_per_trained_token": a["instance_busy_s"] * n_inst / trained if (
            trained := a["throughput_tokens_per_s"] * a["window_s"]) else 0.0,
        "limit_tokens_per_s": limit,
        "limit_share": a["throughput_tokens_per_s"] / limit if limit else 0.0,
        "slot_utilization_limit": min(1.0, limit / full_rate) if full_rate != float("inf") else 1.0,
        "weight_load_share": a["overheads"].get("weight_load", 0.0),
        **{k: a["kv"][k] for k in ("prefill_tokens_per_trajectory", "prefix_hit_tokens", "peak_running",
                                   "kv_blocks_per_group_at_peak")},
        "overheads": a["overheads"],
        "trainer_wait_fraction": a["trainer_wait_fraction"],
        "reward_first_last": [a["reward_by_step"][0], a["reward_by_step"][-1]] if a["reward_by_step"] else [],
    }


def _median(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    kinds = sorted({k for r in runs for k in r["overheads"]})
    out["overheads"] = {k: statistics.median(r["overheads"].get(k, 0.0) for r in runs) for k in kinds}
    out["runs"] = runs
    return out


def run_matrix(config: str, sets: list[str], cases: dict[str, list[str]], out: Path, repeats: int,
               tag: str = "", timeout_s: float = RUN_TIMEOUT_S, console=None) -> tuple[dict, list[dict]]:
    """Every case ``repeats`` times, interleaved; returns ({case: median figures}, per-repeat rows)."""
    from rich.progress import Progress

    runs: dict[str, list[dict]] = {c: [] for c in cases}
    rows: list[dict] = []
    (out / "runs").mkdir(parents=True, exist_ok=True)
    total = repeats * len(cases)
    with Progress(console=console, transient=False) as bar:
        task = bar.add_task(f"bench {tag or 'runs'}", total=total)
        for r in range(repeats):
            row = {}
            for case, case_sets in cases.items():
                bar.update(task, description=f"{case} (repeat {r + 1}/{repeats}{', ' + tag if tag else ''})")
                all_sets = [*sets, *case_sets]
                cfg = load_config(config, all_sets)
                run_dir = out / "runs" / f"{case}{'-' + tag if tag else ''}-r{r}"
                a = run_case(config, all_sets, run_dir, timeout_s)
                runs[case].append(figures(a, cfg) | {"run_dir": str(run_dir)})
                row[case] = runs[case][-1]
                bar.advance(task)
            rows.append(row)
    return {c: _median(v) for c, v in runs.items()}, rows


def ratios(rows: list[dict], a: str, b: str, key: str = "throughput_tokens_per_s") -> list[float]:
    """row[a][key] / row[b][key] in each repeat (cases of one repeat ran back to back)."""
    return [r[a][key] / r[b][key] for r in rows if a in r and b in r and r[b][key]]


def ratio(rows: list[dict], a: str, b: str, key: str = "throughput_tokens_per_s") -> float | None:
    """The median over repeats of ``ratios``."""
    vals = ratios(rows, a, b, key)
    return statistics.median(vals) if vals else None


def _fresh(out: Path) -> None:
    runs = out / "runs"
    if runs.exists() and any(runs.iterdir()):
        raise BenchError(f"{runs} holds runs of an earlier benchmark: remove it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)


def machine() -> dict:
    import os

    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.date.today().isoformat()}


def bench_modes(config: str, out: Path, sets: list[str] | None = None, repeats: int = 3,
                modes: list[str] | None = None, unpaced: bool = True, console=None,
                timeout_s: float = RUN_TIMEOUT_S) -> dict:
    sets = list(sets or [])
    cases = {m: CASES[m] for m in (modes or CASES)}
    refuse_overridden(sets, {f"--modes {m}": (s, "choose the cases with --modes") for m, s in cases.items()}
                      | {"the paced pass": PACED})
    _fresh(out)
    paced, rows = run_matrix(config, [*sets, "engine.pacing=true"], cases, out, repeats, timeout_s=timeout_s,
                             console=console)
    summary: dict = {"config": config, "sets": sets, "repeats": repeats, "machine": machine(), "modes": paced,
                     "ratios": _mode_ratios(rows)}
    if unpaced:
        raw, raw_rows = run_matrix(config, [*sets, "engine.pacing=false"], cases, out, 1, tag="unpaced",
                                   timeout_s=timeout_s, console=console)
        summary["unpaced"] = {"modes": raw, "ratios": _mode_ratios(raw_rows)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from .plots import plot_modes

    plot_modes(summary, out / "modes.png")
    return summary


def _mode_ratios(rows: list[dict]) -> dict:
    out = {}
    for dora in ("dora-k1", "dora-k2", "dora-k3", "dora-k2-auto", "dora-elastic", "dora-k2-lean", "dora-k2-work"):
        for base in ("sync", "one_step", "partial", "oversample", "dora-k2", "dora-k2-eager"):
            v = ratio(rows, dora, base)
            if v is not None:
                out[f"{dora}/{base}"] = v
    return out


def bench_ablation(config: str, out: Path, sets: list[str] | None = None, repeats: int = 3, console=None,
                   which: str = "kv-migration", timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """One mechanism on and off, the same runs otherwise. kv-migration: DORA migrating with KV vs by
    re-prefill (paper §4: 183 s -> 166 s); weight-serving: the trainer answering weight requests during
    its step vs only between steps (one_step and DORA K=2)."""
    if which not in ABLATIONS:
        raise BenchError(f"unknown ablation {which!r}; one of {', '.join(ABLATIONS)}")
    spec = ABLATIONS[which]
    sets = list(sets or [])
    refuse_overridden(sets, {f"--ablation {which} (its case {case})": (s, "the ablation's cases choose it")
                             for case, s in spec["cases"].items()} | {"the paced pass": PACED})
    _fresh(out)
    med, rows = run_matrix(config, [*sets, "engine.pacing=true"], spec["cases"], out, repeats,
                           timeout_s=timeout_s, console=console)
    keys = {"throughput": "throughput_tokens_per_s", "mean_step_time_s": "mean_step_time_s",
            "engine_steps_per_trained_token": "engine_steps_per_trained_token",
            "engine_s_per_trained_token": "engine_s_per_trained_token",
            "prefill_tokens_per_trajectory": "prefill_tokens_per_trajectory", "peak_running": "peak_running",
            "kv_blocks_per_group_at_peak": "kv_blocks_per_group_at_peak"}
    by_repeat = {f"{on}/{off} {name}": ratios(rows, on, off, key)
                 for on, off in spec["pairs"] for name, key in keys.items()}
    summary = {"ablation": which, "title": spec["title"], "config": config, "sets": sets, "repeats": repeats,
               "machine": machine(), "variants": med,
               "ratios": {k: statistics.median(v) if v else None for k, v in by_repeat.items()},
               "ratios_by_repeat": by_repeat}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from .plots import plot_ablation

    plot_ablation(summary, out / "ablation.png", spec["panels"])
    return summary
