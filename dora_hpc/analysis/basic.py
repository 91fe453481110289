"""``dora-hpc analyze RUN_DIR``: what a run did and whether it kept its invariants, from HDF5 alone.

Invariant: every figure here is computed from the run's complete shards (``*.h5``); nothing is
read from a live process or from the config beyond what the shards' attrs carry.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from ..core.policies import MODES, traits_of
from ..measure.admission import admission_caps
from ..measure.gate import gate_figures
from ..measure.history import history
from ..measure.invariants import check, fence_detail, joined
from ..measure.migration import migration_figures
from ..measure.speculation import speculation_figures
from ..measure.utilization import multi_version_batches, trained_tokens, utilization
from ..store.shards import ShardError, ShardScan, rank_of, read_table, scan
from .episodes import episode_figures
from .invariants import read_trajectories
from .staleness import stratified


def _config(run_dir: Path) -> dict:
    for p in sorted(Path(run_dir).glob("*.h5")):
        try:
            with h5py.File(p, "r") as f:
                return json.loads(f.attrs["config_json"])
        except (OSError, KeyError, ValueError):
            continue
    return {}


class NothingToAnalyse(ShardError):
    """A run directory without one readable train step; the message names the dir and what was skipped."""


def prompt_of(group_id: np.ndarray, cfg: dict) -> np.ndarray | None:
    """The prompt each group got, where the config says: a reasoning-gym task gives group g its item g % size
    (data/text_tasks.py); None for other tasks."""
    task = cfg.get("task", {})
    if task.get("name") == "reasoning_gym" and task.get("size"):
        return np.asarray(group_id) % int(task["size"])
    return None


def unclean_ranks(run_dir: Path) -> list[int]:
    """Ranks of the latest launch with no clean exit on record: each rank writes ``pids/rank-N`` at start
    and ``pids/rank-N.done`` (newer) when it ends cleanly, after its last shard. Such a rank is still
    running, or was killed, and what it buffered since its last shard is not in the logs."""
    pids = run_dir / "pids"
    started = sorted(int(p.name[5:]) for p in pids.glob("rank-*") if p.name[5:].isdigit()) if pids.is_dir() else []
    return [r for r in started if not (done := pids / f"rank-{r}.done").exists()
            or done.stat().st_mtime < (pids / f"rank-{r}").stat().st_mtime]  # a .done of an earlier launch


def missing_logs(scans: dict[str, ShardScan], cfg: dict, run_dir: Path | None = None) -> list[str]:
    """What the logs lack, one phrase each: unreadable shards, unfinished writes (``*.h5.tmp``: a writer
    stopped mid-write), rollout ranks that left no shard of a kind, and ranks with no clean exit on
    record (``unclean_ranks``). Empty for a complete run."""
    out = [f"skipped {Path(p).name} ({why})" for s in scans.values() for p, why in s.bad.items()]
    out += [f"{s.tmp_skipped} unfinished {kind}-*.h5.tmp skipped" for kind, s in scans.items() if s.tmp_skipped]
    cluster = cfg.get("cluster", {})
    first = 1 + cluster.get("trainer_ranks", 0)
    n = cluster.get("rollout_ranks", cluster.get("rollout_instances", 0))  # an older release's name first
    expected = [r for r in instance_ranks(run_dir, cfg) if r >= rank_layout(run_dir, cfg)[0]] \
        if run_dir is not None else list(range(first, first + n))
    for kind in ("traj", "events"):
        have = {rank_of(p) for p in scans[kind].files}
        absent = [r for r in expected if r not in have]
        if absent:
            out.append(f"no {kind} shard from rollout rank{'s' if len(absent) > 1 else ''} "
                       + ", ".join(map(str, absent)))
    if run_dir is not None and (unclean := unclean_ranks(run_dir)):
        many = len(unclean) > 1
        out.append(f"no clean exit on record for rank{'s' if many else ''} {', '.join(map(str, unclean))} (still "
                   f"running, or killed): what {'they' if many else 'it'} logged since the last shard is not here")
    return out


STEP_COLUMNS = ["t_start", "t_end", "batch_size", "capacity", "version", "prefill_tokens", "prefix_hit_tokens",
                "running", "kv_blocks_used", "new_tokens", "batch_versions", "decodes", "drafted",
                "accepted"]  # what analyze reads of the engine steps


def analyze(run_dir: str | Path, plots: str | Path | None = None, trace: str | Path | None = None) -> dict:
    """Every figure of a run (see the module docstring). Partial logs are analysed and what they lack is
    listed under ``missing``; a run dir without one readable train step raises NothingToAnalyse. ``trace``:
    also write the run's Perfetto trace there (analysis/trace.py)."""
    run_dir, cfg = Path(run_dir), _config(Path(run_dir))
    scans = {k: scan(run_dir, k) for k in ("traj", "events", "train")}
    mode, k, g_size = cfg.get("mode"), cfg.get("dora", {}).get("k"), cfg.get("batch", {}).get("group_size", 1)
    consumed, all_tsteps = (read_table(run_dir, "train", t, scan_result=scans["train"]) for t in ("consumed", "steps"))
    if not len(all_tsteps["step"]):
        raise NothingToAnalyse(_nothing(run_dir, scans, cfg))
    traj = read_trajectories(scans["traj"])
    ops = read_table(run_dir, "events", "ops", scan_result=scans["events"], with_rank=True)
    esteps = read_table(run_dir, "events", "steps", scan_result=scans["events"], with_rank=True, columns=STEP_COLUMNS)
    hist = history(ops)
    consumed, tsteps = effective(hist, consumed, all_tsteps)

    traits = traits_of(mode, k or 0) if mode in MODES else None  # a log of an unknown mode: nothing bound
    bound = traits.staleness_bound if traits else None
    chk = check(traj, consumed, ops, set(hist.owns), hist.chain[-1], bound, g_size)
    single_version = traits is None or traits.single_version
    mixed, stale = chk.mixed.tolist() if single_version else [], chk.stale

    trained, warm = with_trained_tokens(tsteps, consumed, traj, chk), warmup_steps(run_dir, cfg, len(tsteps["step"]))
    mig = migration_figures(ops)
    result = {
        "run_dir": str(run_dir), "mode": mode, "k": k,
        "steps": int(len(tsteps["step"])),
        "trajectories": int(len(traj["traj_id"])),
        "consumed": int(len(consumed["traj_id"])),
        "invariants": invariant_figures(chk, mixed),
        "staleness": {"max": int(stale.max(initial=0)), "mean": float(stale.mean()) if len(stale) else 0.0,
                      "histogram": _counts(stale), "by_version": _counts(consumed["version"])},
        "stratified": stratified(stale, consumed["reward"], consumed["group_id"],
                                 joined(traj["response_len"], chk.matched, 0),
                                 prompt=prompt_of(consumed["group_id"], cfg)),
        "partial_segments": {} if single_version else {"trajectories_with_switches": len(chk.mixed)},
        "migrations": mig["count"], "migration": mig, "speculation": speculation_figures(esteps),
        "reprefill_tokens": int(np.sum(traj["reprefill_tokens"])) if len(traj["traj_id"]) else 0,
        "dropped_groups": len(chk.dropped),
        "filtered_groups": len(chk.filtered),
        "reward_errors": int(traj["has_error"].sum()),
        **episode_figures(traj, chk.matched, stale),
        "malformed_rows": int(sum(1 for kind in ops["kind"] if kind == "malformed_row")),
        "weights": weight_figures(tsteps, all_tsteps, ops),
        "fenced": fenced(ops),
        "instances": instance_timeline(ops, cfg.get("cluster", {}).get("rollout_instances", 0)),
        "preemption": preemption_figures(hist, ops, chk), "kv": kv_figures(esteps, len(traj["traj_id"]), g_size),
        "max_live_versions": max_live_versions(esteps), "multi_version_batches": multi_version_batches(esteps),
        "admission_cap": admission_caps(logged_caps(ops), cfg.get("batch", {}).get("tbs", 1), warm),
        **gate_figures(ops, tsteps, consumed, traj, esteps),
        **utilization(esteps, trained, ops, warmup_steps=warm, ranks=instance_ranks(run_dir, cfg),
                      colocated=traits is not None and placement(cfg, mode, traits) == "colocated"),
        "reward_by_step": [float(x) for x in tsteps["reward_mean"]],
        "logprob_gap": logprob_gap(tsteps),
        **loss_stats(tsteps),
        "tokens_per_s_by_step": tokens_per_s_by_step(trained),
        "shards": {k: {"files": len(s.files), "tmp_skipped": s.tmp_skipped, "bad": s.bad} for k, s in scans.items()},
        "missing": missing_logs(scans, cfg, run_dir),
    }
    return views(result, plots, trace, esteps, tsteps, ops, trained, consumed, traj, cfg)


def views(result: dict, plots: str | Path | None, trace: str | Path | None, esteps: dict, tsteps: dict, ops: dict,
          trained: dict, consumed: dict, traj: dict, cfg: dict) -> dict:
    """The run's figures as PNGs (``plots``) and its Perfetto trace (``trace``), where asked; ``result`` names
    what was written."""
    if plots is not None:
        from .plots import write_plots

        result["plots"] = [str(p) for p in write_plots(Path(plots), esteps, tsteps, result)]
    if trace is not None:
        from .trace import write_trace

        first = rank_layout(Path(result["run_dir"]), cfg)[0]
        result["trace"] = {"path": str(trace), "events": write_trace(
            Path(trace), esteps, ops, trained, consumed, traj, first)}
    return result


def with_trained_tokens(tsteps: dict, consumed: dict, traj: dict, chk) -> dict:
    """The train steps with ``tokens`` as trained tokens (measure/utilization.py ``trained_tokens``: prompt +
    response of what each consumed); a consumed row whose trajectory row is not in the logs counts 0."""
    per_row = joined(traj["prompt_len"] + traj["response_len"], chk.matched, 0)
    return {**tsteps, "tokens": trained_tokens(tsteps["step"], consumed["consume_step"], per_row)}


def kv_figures(esteps: dict, trajectories: int, group_size: int) -> dict:
    """The engines' prefill and KV: prompt (environment, re-prefilled) tokens computed and those the prefix
    cache gave instead, per trajectory ended; the most sequences running at once on one instance; and the KV
    blocks a group holds -- G x blocks held per running sequence -- at each instance's step of most blocks
    held (the mean over instances; a group's blocks wherever its samples run). Logs before schema 9 (and
    vLLM's, which reports no blocks) read 0 for what they lack."""
    rank, used, running = esteps["rank"], esteps["kv_blocks_used"], esteps["running"]
    per_group = []
    for r in np.unique(rank):
        at = np.flatnonzero(rank == r)
        top = at[np.argmax(used[at])]
        if running[top] > 0 and used[top] >= 0:
            per_group.append(group_size * float(used[top]) / float(running[top]))
    prefill = int(np.sum(esteps["prefill_tokens"].clip(min=0)))
    hits = int(np.sum(esteps["prefix_hit_tokens"].clip(min=0)))
    return {"prefill_tokens": prefill, "prefix_hit_tokens": hits,
            "prefill_tokens_per_trajectory": prefill / trajectories if trajectories else 0.0,
            "peak_running": int(esteps["running"].max(initial=0)),
            "kv_blocks_per_group_at_peak": float(np.mean(per_group)) if per_group else 0.0}


def _nothing(run_dir: Path, scans: dict, cfg: dict) -> str:
    if not any(s.files or s.bad or s.tmp_skipped for s in scans.values()):
        return f"{run_dir}: nothing to analyse: no HDF5 shard in it (is it a run directory?)"
    read = ", ".join(f"{len(s.files)} {kind}" for kind, s in scans.items())
    why = "".join(f"; {m}" for m in missing_logs(scans, cfg, run_dir))
    return (f"{run_dir}: nothing to analyse: no train step logged (the run stopped before its first step, or no "
            f"train shard is readable); shards read: {read}{why}")


def effective(hist, consumed: dict, tsteps: dict) -> tuple[dict, dict]:
    """A preempted and resumed run: only the rows its final history is made of (measure/history.py);
    train steps in step order."""
    keep = hist.step_mask(consumed["attempt"], consumed["consume_step"])
    consumed = {c: v[keep] for c, v in consumed.items()}
    keep = hist.step_mask(tsteps["attempt"], tsteps["step"])
    tsteps = {c: v[keep] for c, v in tsteps.items()}
    order = np.argsort(tsteps["step"], kind="stable")
    return consumed, {c: v[order] for c, v in tsteps.items()}


def rank_layout(run_dir: Path, cfg: dict) -> tuple[int, list[int]]:
    """The rank of instance 0, and every rollout instance's rank: a simulated run's from its launch.json
    (instance i is rank ``first_instance_rank`` + i); a real run's dedicated ranks after the trainer ranks, and
    the trainer ranks when they host borrowed instances (``cluster.elastic``)."""
    launch = run_dir / "launch.json"
    meta = json.loads(launch.read_text()) if launch.is_file() else {}
    if meta.get("simulated"):
        first = meta["first_instance_rank"]
        return first, list(range(first, first + meta["instances"]))
    c = cfg.get("cluster", {})
    first = 1 + c.get("trainer_ranks", 1)
    dedicated = list(range(first, first + c.get("rollout_ranks", c.get("rollout_instances", 0))))
    return first, (list(range(1, first)) if c.get("elastic") else []) + dedicated


def instance_ranks(run_dir: Path, cfg: dict) -> list[int]:
    return rank_layout(run_dir, cfg)[1]


def placement(cfg: dict, mode: str, traits) -> str:
    """The run's placement: the config's ``cluster.placement`` for its mode, else the mode's own."""
    return cfg.get("cluster", {}).get("placement", {}).get(mode, traits.placement)


def warmup_steps(run_dir: Path, cfg: dict, steps: int) -> int:
    """The train steps the measured window leaves out: a simulated run's ``sim.warmup_steps`` (its launch.json
    says ``simulated``), as the simulator's own summary does; a real run's first step (its start-up: model loads,
    version 0 everywhere); none when the run has one step."""
    launch = run_dir / "launch.json"
    simulated = launch.is_file() and json.loads(launch.read_text()).get("simulated", False)
    w = int(cfg.get("sim", {}).get("warmup_steps", 1)) if simulated else 1
    return min(w, steps - 1) if steps > 1 else 0


def tokens_per_s_by_step(tsteps: dict) -> list[float]:
    """Step n's trained tokens over the time since step n-1 ended (from step 1; across a resume the interval
    includes the restart)."""
    return (tsteps["tokens"][1:] / np.maximum(np.diff(tsteps["t_end"]), 1e-9)).tolist()


def fenced(ops: dict) -> list[dict]:
    """Each rank rank 0 gave up on (runtime/orchestrator.py: fence): a rollout rank, or a trainer replica
    (``role``), with what it left undone."""
    return [{"rank": int(r), "attempt": int(a), "t": float(t), **fence_detail(d)}
            for kind, r, a, t, d in zip(ops["kind"], ops["peer"], ops["attempt"], ops["t_end"], ops["detail"],
                                        strict=True) if kind == "fence"]


def instance_timeline(ops: dict, dedicated: int) -> dict:
    """The rollout instances live over the run: each launch starts with all ``dedicated`` of them, a fence
    takes one away, a replacement joining (runtime/join.py) gives it back; the count after each, in time.
    A trainer replica's fence or join (``role=trainer``) is no instance's and is left out."""
    events = sorted((float(t), int(a), str(kind), int(r)) for kind, r, a, t, d in
                    zip(ops["kind"], ops["peer"], ops["attempt"], ops["t_end"], ops["detail"], strict=True)
                    if kind == "start" or kind in ("join", "fence") and fence_detail(d)["role"] != "trainer")
    count, timeline = dedicated, []
    for t, a, kind, r in events:
        count = dedicated if kind == "start" else count + (1 if kind == "join" else -1)
        timeline.append({"t": t, "attempt": a, "event": kind, "rank": r if kind != "start" else None,
                         "instances": count})
    return {"timeline": timeline, "joined": [e for e in timeline if e["event"] == "join"],
            "fewest": min((e["instances"] for e in timeline), default=dedicated)}


def _counts(values: np.ndarray) -> dict[str, int]:
    return {str(v): int(c) for v, c in zip(*np.unique(values, return_counts=True), strict=True)}


def invariant_figures(chk, mixed: list) -> dict:
    """The five run invariants (docs/invariants.md): how many rows break each, and the first 20."""
    broken = {"mixed_version_trajectories": mixed, "staleness_over_k": chk.over_k.tolist(),
              "lost_groups": chk.lost.tolist(), "duplicate_groups": chk.duplicate.tolist(),
              "split_groups": chk.split.tolist()}
    return {**{k: len(v) for k, v in broken.items()}, "offenders": {k: v[:20] for k, v in broken.items()}}


def logged_caps(ops: dict) -> dict[int, int]:
    """The ``admission_cap`` ops by train step, in groups (a later attempt's row for a step replaces an earlier
    one's)."""
    return {int(v): int(str(d).removeprefix("groups=")) for kind, v, d in
            zip(ops["kind"], ops["version"], ops["detail"], strict=True) if kind == "admission_cap"}


def same_layout(a: str, b: str) -> bool:
    """Whether two version checksums cover the same layout: the ``/tT`` (trainer ranks) train/publish.py ends
    them with. A run resumed on another number of trainer ranks publishes the same weights under another one."""
    return a.partition("/t")[2] == b.partition("/t")[2]


def weight_figures(tsteps: dict, all_tsteps: dict, ops: dict) -> dict:
    """Every weight load's checksum against the one its version was published with (by the same attempt
    when it published it, else by the run's effective history)."""
    published = {int(st) + 1: str(c) for st, c in zip(tsteps["step"], tsteps["weights_checksum"], strict=True)}
    by_attempt = {(int(a), int(st) + 1): str(c) for a, st, c in
                  zip(all_tsteps["attempt"], all_tsteps["step"], all_tsteps["weights_checksum"], strict=True)}
    loads = [(int(v), str(d).split()[0], by_attempt.get((int(a), int(v)), published.get(int(v))))
             for kind, v, d, a in zip(ops["kind"], ops["version"], ops["detail"], ops["attempt"], strict=True)
             if kind == "weight_load"]
    comparable = [(c, want) for _v, c, want in loads if want is not None and same_layout(c, want)]
    return {"published": len(published), "loads": len(loads),
            "mismatched_loads": sum(1 for c, want in comparable if c != want),
            # a load in a run resumed on another number of trainer ranks: its checksum covers another layout
            "loads_across_layouts": sum(1 for _v, c, want in loads if want is not None) - len(comparable),
            "v0_checksums": len({c for v, c, _w in loads if v == 0})}


def preemption_figures(hist, ops: dict, chk) -> dict:
    return {"attempts": len(hist.starts), "chain": hist.chain,
            "resumed_at_steps": [hist.starts[a] for a in hist.chain[1:]],
            "redispatched_groups": int(sum(1 for kind, a in zip(ops["kind"], ops["attempt"], strict=True)
                                           if kind == "discarded_by_preemption" and int(a) in hist.owns)),
            "discarded_trajectories": chk.discarded}


def logprob_gap(tsteps: dict[str, np.ndarray]) -> dict:
    """The rollout engine against the trainer: mean |log pi_trainer - log pi_rollout| over tokens sampled
    under the very weights the trainer held (train/grpo.py). Float noise when the engine is right; a
    large gap means rollouts sampled from other weights than they were tagged with."""
    n = np.maximum(tsteps["gap_tokens"], 0)
    has = (n > 0) & np.isfinite(tsteps["logprob_gap"])
    gap = tsteps["logprob_gap"][has]
    return {"max": float(gap.max()) if has.any() else None,
            "mean": float((gap * n[has]).sum() / n[has].sum()) if has.any() else None,
            "tokens": int(n[has].sum()), "steps": int(has.sum())}


def loss_stats(tsteps: dict[str, np.ndarray]) -> dict:
    """What the policy loss saw, per train step (train/losses.py): the importance weight pi_prox/pi_behaviour
    (mean of the steps' token means, max of their maxima), the sampled tokens' entropy at the first and
    last step, the clip and dual-clip fractions. None (NaN per step) where the shards predate these columns
    (schema < 4; schema < 7 for the dual clip)."""
    def finite(col: str) -> np.ndarray:
        return tsteps[col][np.isfinite(tsteps[col])]

    w, w_max, ent = finite("is_weight_mean"), finite("is_weight_max"), finite("entropy")
    has = len(w) > 0
    return {"is_weight": {"mean": float(w.mean()) if has else None, "max": float(w_max.max()) if has else None,
                          "truncated_frac": float(np.nanmean(tsteps["is_truncated_frac"])) if has else None,
                          "masked_frac": float(np.nanmean(tsteps["is_masked_frac"])) if has else None},
            "entropy": {"first": float(ent[0]) if len(ent) else None, "last": float(ent[-1]) if len(ent) else None},
            "clip_frac_by_step": [float(x) for x in tsteps["clip_frac"]],
            "dual_clip_frac_by_step": [float(x) for x in tsteps["dual_clip_frac"]],  # NaN before schema 7
            "entropy_by_step": [float(x) for x in tsteps["entropy"]]}


def max_live_versions(esteps: dict[str, np.ndarray], bucket_s: float = 0.25) -> int:
    """The most distinct versions generating within one time bucket, across all rollout ranks."""
    m = (esteps["batch_size"] > 0) & (esteps["version"] >= 0)
    if not m.any():
        return 0
    b0 = (esteps["t_start"][m] / bucket_s).astype(np.int64)
    span = (esteps["t_end"][m] / bucket_s).astype(np.int64) - b0 + 1  # buckets each step touches
    first = np.repeat(np.cumsum(span) - span, span)
    bucket = np.repeat(b0, span) + np.arange(int(span.sum())) - first
    pairs = np.unique(np.stack([bucket, np.repeat(esteps["version"][m].astype(np.int64), span)]), axis=1)
    return int(np.unique(pairs[0], return_counts=True)[1].max())
