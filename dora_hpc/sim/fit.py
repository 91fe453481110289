"""Fit the simulator to a run's own logs, check the fit, and sweep what the next submission could change.

Invariants:
* everything fitted comes from the run's HDF5 logs (its newest launch: a resume's restart is no step
  interval) and its saved config, nothing else: response and
  prompt lengths (log-normal, by maximum likelihood on the logs), the engine's step time (its median,
  and its growth with the batch's KV, by least squares), weight-load and KV-transfer times from the ops,
  and the trainer's seconds per trained token;
* a multi-turn run (``env.name``) also fits its episodes from the trajectory rows: turns, model tokens per
  turn and environment tokens per step (log-normal, as above), and the environment's latency per step
  (``episode_fit``), queued on the run's ``env.workers`` per rank;
* a single-turn run's own prompt and response lengths are replayed (``Logged``) for the groups and
  trajectories it logged, the fitted distributions drawn beyond them: a re-simulation of the run then
  differs from it by the cost model alone, not by another draw of a long tail (a 12-step run measured at
  0.75 s a step re-simulated at 0.78-1.00 s over six seeds' draws, at 0.74 s on its own lengths);
* the fit is checked before anything is recommended: the logged run re-simulated with the fitted model
  must give its measured train-step interval (the mean after the first step, as the simulator
  measures it) within FIT_TOLERANCE; the relative error is reported either way;
* a recommendation is a list of ``--set`` lines of the run's own config keys, each with its predicted
  trained tokens/s under the same fitted model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..config import RunConfig, validate, with_overrides
from ..core.admission import ADMISSIONS
from ..core.events import FOLDER
from ..core.policies import traits_of
from ..measure.utilization import op_seconds, trained_tokens, trained_tokens_per_s
from ..store.shards import read_table
from .cluster import Simulator
from .costs import CostModel
from .metrics import summarize
from .workload import Logged

FIT_TOLERANCE = 0.15
RECOMMEND_WITHIN = 0.98  # plan recommends the least stale candidate this close to the fastest


@dataclass(frozen=True)
class Fit:
    cfg: RunConfig            # the run's config with the fitted workload, for the simulator
    cost: CostModel           # the fitted per-instance costs
    measured_step_s: float    # mean train-step interval after the first step (the simulator's definition)
    measured_tokens_per_s: float
    fitted: dict              # the fitted figures, for the report
    measured_waits: dict | None = None  # the trainer's logged waits over that window (None: not logged)
    logged: Logged | None = None  # the run's own lengths, replayed (a single-turn run)


def _lognormal(x: np.ndarray) -> dict:
    x = np.maximum(np.asarray(x, dtype=float), 1.0)
    logs = np.log(x)
    lo, hi = int(x.min()), int(x.max())
    return {"median": float(np.clip(np.exp(logs.mean()), lo, hi)),  # a constant length: exp(log) may round off
            "sigma": float(max(logs.std(), 1e-3)), "min": lo, "max": hi}


def _durations(ops: dict, kind: str) -> np.ndarray:
    sel = ops["kind"] == kind
    return (ops["t_end"][sel] - ops["t_start"][sel]).astype(float)


def fit_run(run_dir: Path) -> Fit:
    from ..launch.local import saved_config

    run = validate(saved_config(run_dir), saved=True)
    episode_cols = ["turns", "env_spans", "env_s"] if run.env.multi_turn else []
    tables = {"trajs": ("traj", "trajectories", ["traj_id", "group_id", "prompt_len", "response_len", *episode_cols]),
              "steps": ("events", "steps", ["t_start", "t_end", "batch_size", "kv_blocks_used"]),
              "ops": ("events", "ops", ["t_start", "t_end", "kind", "bytes", "detail", "peer"]),
              "train": ("train", "steps", ["step", "t_start", "t_end"]),
              "consumed": ("train", "consumed", ["traj_id", "traj_attempt", "consume_step"])}
    got = {name: read_table(run_dir, kind, table, [*cols, "attempt"]) for name, (kind, table, cols) in tables.items()}
    newest = int(got["train"]["attempt"].max()) if len(got["train"]["attempt"]) else 0  # one launch's own timing
    trajs, steps, ops, train, consumed = ({c: v[t["attempt"] == newest] for c, v in t.items()} for t in got.values())
    if len(train["step"]) < 3 or not len(trajs["traj_id"]) or not len(steps["t_start"]):
        raise ValueError(f"{run_dir}: too few logged train steps, trajectories or engine steps to fit (need 3 steps)")
    prompt = _lognormal(trajs["prompt_len"])
    response = _lognormal(trajs["response_len"])
    episodes = _episodes(trajs, run) if run.env.multi_turn else {}
    response = episodes.pop("response_len", response)

    a, b = _engine_step(steps, run.engine.block_size)
    tokens_by_step = _trained_tokens(got["trajs"], consumed)  # a step may consume an earlier launch's rows
    order = np.argsort(train["step"])
    t0, t1, step_ids = train["t_start"][order], train["t_end"][order], train["step"][order]
    s_per_token = _train_s_per_token(step_ids, t0, t1, tokens_by_step)
    sent = {c: v[ops["peer"] != FOLDER] for c, v in ops.items()}  # v0 from the model folder moves nothing
    load, sleeps = _durations(sent, "weight_load"), _durations(ops, "sleep")
    migr = ops["kind"] == "migration_in"
    kv_s = (ops["t_end"][migr] - ops["t_start"][migr]).astype(float)
    kv_link = float(ops["bytes"][migr].sum() / kv_s.sum()) if migr.any() and kv_s.sum() > 0 else 1e12
    kv_bytes_per_token = 1.0
    cost = CostModel(a=a, b=b, prefill_per_token=run.engine.prefill_s_per_token if run.engine.pacing else 0.0,
                     prefill_per_token2=0.0, train_flops_per_token=s_per_token * run.cluster.trainer_ranks,
                     train_flops_per_accel=1.0, kv_bytes_per_token=kv_bytes_per_token, kv_link=kv_link,
                     host_link=1e12, weight_load_s=float(np.median(load)) if len(load) else 0.0,
                     colocated_switch_s=0.0,
                     kv_capacity_tokens=float(run.engine.kv_blocks * run.engine.block_size))
    n = len(train["step"])
    trainer_start = _trainer_start(ops, float(t0[0]), float(steps["t_start"].min()), run.runtime.tick_s)
    sim_cfg = with_overrides(run, {
        "workload.prompt_len": prompt, "workload.response_len": response,
        **{f"workload.{k}": v for k, v in episodes.items()},
        "cluster.accelerators": run.cluster.trainer_ranks + run.cluster.rollout_instances,
        "cluster.accelerators_per_instance": 1, "sim.steps": n, "sim.warmup_steps": 1,
        "sim.tick_s": run.runtime.tick_s, f"cluster.placement.{run.mode}": "disaggregated",  # ranks never share
        # borrowed instances as logged: a sleep's own time; a wake is the weight load, already in the cost
        "sim.hardware.engine_sleep_s": float(np.median(sleeps)) if len(sleeps) else 0.0,
        "sim.hardware.engine_wake_s": 0.0, "sim.hardware.trainer_start_s": trainer_start,
        **_model_spec(run_dir, run)})
    span = float(t1[-1] - t1[0]) or 1.0  # the simulator's measured window: from the end of the first step
    rate = trained_tokens_per_s(t1.tolist(), [tokens_by_step.get(k, 0) for k in step_ids.tolist()]) or 0.0
    fitted = {"prompt_len": prompt, "response_len": response, "engine_step_s": a, "engine_step_s_per_kv_token": b,
              "train_s_per_token": s_per_token, "weight_load_s": cost.weight_load_s, "kv_link_bytes_per_s": kv_link,
              "response_len_trend_per_step": _trend(trajs, consumed), "trainer_start_s": trainer_start} | episodes
    waits = None
    if (ops["kind"] == "trainer_wait").any():  # logged by rank 0 (runs from before it: not)
        waits = {k: v / span for k, v in op_seconds(ops, float(t1[0]), float(t1[-1]))[1].items()}
    logged = None if run.env.multi_turn else _logged(got["trajs"])
    return Fit(sim_cfg, cost, span / (n - 1), rate, fitted, waits, logged)


def _logged(trajs: dict) -> Logged:
    """The run's whole prompt by group and response length by trajectory (every launch's rows: a
    trajectory's budget is a function of its id, so a retried one logs the same lengths)."""
    return Logged(dict(zip(trajs["group_id"].tolist(), trajs["prompt_len"].tolist(), strict=True)),
                  dict(zip(trajs["traj_id"].tolist(), trajs["response_len"].tolist(), strict=True)))


def _trainer_start(ops: dict, first_step: float, origin: float, tick_s: float) -> float:
    """Seconds from the first engine step until the trainer could run its first step, where the trainer was
    what kept it waiting: it builds its model while rollout loads version 0 from the model folder, and its
    first step began after rank 0's logged waits for groups had ended. Where groups were what it waited for,
    its own readiness is not observable and was earlier: 0, so the re-simulated groups set the start."""
    waits = ops["kind"] == "trainer_wait"
    ended = ops["t_end"][waits & (ops["t_end"] <= first_step + tick_s)]
    if not len(ended) or first_step - float(ended.max()) <= tick_s:
        return 0.0
    return max(0.0, first_step - origin)


def _train_s_per_token(step_ids: np.ndarray, t0: np.ndarray, t1: np.ndarray, tokens_by_step: dict[int, int]) -> float:
    """The trainer's seconds per trained token: total time over total tokens (a step's time varies several-fold
    on a shared CPU, and the run's interval is made of the total: a median understates it)."""
    timed = [(e - s, tokens_by_step[k]) for k, s, e in zip(step_ids.tolist(), t0, t1, strict=True)
             if tokens_by_step.get(k)]
    return float(sum(d for d, _ in timed) / sum(n for _, n in timed)) if timed else 0.0


def _model_spec(run_dir: Path, run: RunConfig) -> dict:
    """The run's model as the memory model sees it: its parameters (from the safetensors headers of the
    model folder the run loaded) and the publish dtype's bytes per parameter; nothing if the folder is gone."""
    import json

    from safetensors import safe_open

    from ..train.publish import publish_dtype

    model_dir = Path(json.loads((run_dir / "launch.json").read_text()).get("model_dir", ""))
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return {}
    params = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            params += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())  # noqa: SIM118
    return {"sim.model.params_b": params / 1e9,
            "sim.model.bytes_per_param": publish_dtype(run.train.publish_dtype, run.engine.dtype).itemsize}


def _episodes(trajs: dict, run: RunConfig) -> dict:
    """A multi-turn run's workload keys from its trajectory rows (``episode_fit``), its episode cap and its
    environment workers per rank (steps beyond them queue: the logged ``env_s`` is a step's own time)."""
    out = episode_fit(*(trajs[c] for c in ("turns", "env_spans", "env_s", "response_len")), run.env.timeout_s)
    return out | {"max_episode_tokens": run.env.max_episode_tokens, "env_workers": run.env.workers}


def episode_fit(turns: np.ndarray, spans: np.ndarray, env_s: np.ndarray, response_len: np.ndarray,
                timeout_s: float) -> dict:
    """The workload keys of a multi-turn run's episodes: ``turns``; ``response_len``, the model's tokens per
    turn (the response cut at its environment spans); ``env_tokens`` per environment span; ``env_latency_s``
    per step. Only each episode's total environment seconds is logged, so the step latency is fitted by
    moments: for n independent log-normal steps the total has mean n m and variance n v, which give m and v,
    then sigma^2 = ln(1 + v / m^2) and median = m exp(-sigma^2 / 2). An episode of n turns has n steps: the
    environment steps after the last turn too (it says done), in the runtime as in the simulator."""
    model, env = [], []
    for n_resp, flat in zip(response_len.tolist(), spans, strict=True):
        cuts = [int(x) for x in flat]
        prev = 0
        for start, end in zip(cuts[::2], cuts[1::2], strict=True):
            model.append(start - prev)
            env.append(end - start)
            prev = end
        model.append(int(n_resp) - prev)
    steps = turns.astype(float)
    keep = steps > 0
    n, total = steps[keep], env_s.astype(float)[keep]
    out = {"turns": _lognormal(turns), "response_len": _lognormal(np.array(model, dtype=float))}
    out["env_tokens"] = (_lognormal(np.array(env, dtype=float)) if env
                         else {"median": 1, "sigma": 0.0, "min": 1, "max": 1})
    if keep.any() and total.sum() > 0:
        m = float(total.sum() / n.sum())
        v = float(((total - n * m) ** 2).sum() / n.sum())
        sigma2 = float(np.log1p(v / (m * m)))
        out["env_latency_s"] = {"median": m * float(np.exp(-sigma2 / 2)), "sigma": float(np.sqrt(sigma2)),
                                "max": float(min(total.max(), timeout_s))}
    else:
        out["env_latency_s"] = {"median": 0.0, "sigma": 0.0, "max": 1.0}
    return out


def _engine_step(steps: dict, block_size: int) -> tuple[float, float]:
    """An engine step's duration as a + b * KV tokens in the batch (the simulator's decode form), by least
    squares; the mean alone where the slope is not positive (a paced engine): the run's time is the sum."""
    dur = (steps["t_end"] - steps["t_start"]).astype(float)
    kv = steps["kv_blocks_used"].astype(float) * block_size
    keep = dur > 0
    a, b = float(np.mean(dur[keep])), 0.0
    if keep.sum() > 10 and np.ptp(kv[keep]) > 0:
        b_fit, a_fit = np.polyfit(kv[keep], dur[keep], 1)
        if b_fit > 0 and a_fit > 0:
            a, b = float(a_fit), float(b_fit)
    return a, b


def _trained_tokens(trajs: dict, consumed: dict) -> dict[int, int]:
    """Each train step's trained tokens (measure/utilization.py ``trained_tokens``): a consumed row joins the
    trajectory row of its (traj_id, attempt), the last one read, as analyze joins them; 0 where none was logged."""
    total = (trajs["prompt_len"] + trajs["response_len"]).tolist()
    length = dict(zip(zip(trajs["traj_id"].tolist(), trajs["attempt"].tolist(), strict=True), total, strict=True))
    per_row = np.array([length.get(k, 0) for k in zip(consumed["traj_id"].tolist(), consumed["traj_attempt"].tolist(),
                                                       strict=True)], np.int64)
    steps = np.unique(consumed["consume_step"])
    return dict(zip(steps.tolist(), trained_tokens(steps, consumed["consume_step"], per_row).tolist(), strict=True))


def _trend(trajs: dict, consumed: dict) -> float:
    """Least-squares slope of the response length over the train step that consumed it (tokens per step)."""
    length = dict(zip(trajs["traj_id"].tolist(), trajs["response_len"].tolist(), strict=True))
    x = [s for t, s in zip(consumed["traj_id"].tolist(), consumed["consume_step"].tolist(), strict=True) if t in length]
    y = [length[t] for t in consumed["traj_id"].tolist() if t in length]
    return float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else 0.0


def simulate(fit: Fit, cfg: RunConfig) -> dict:
    return summarize(Simulator(cfg, cfg.mode, timeline=False, cost=fit.cost, logged=fit.logged).run())


def plan(run_dir: Path, accelerators: int | None = None, progress=None, vary_k: bool = False) -> dict:
    """The fit check, then a sweep of splits and, where the mode has them, elastic on/off, rbs as set or
    auto and admission eager or lean; the fastest first. The recommendation is the least stale of those
    within RECOMMEND_WITHIN of the fastest (staleness can cost reward; a few percent of tokens/s is
    within the fit's error). K stays the run's: a larger K buys tokens/s with staleness, which can cost reward
    (docs/training.md), so it is swept (K-1, K, K+1, 2K) only with ``vary_k``."""
    fit = fit_run(run_dir)
    again = simulate(fit, fit.cfg)
    error = float(again["mean_step_time_s"] / fit.measured_step_s - 1.0)
    total = accelerators or fit.cfg.cluster.accelerators
    base = with_overrides(fit.cfg, {"cluster.accelerators": total, "sim.steps": max(fit.cfg.sim.steps, 8)})
    candidates = []
    k0, mode = fit.cfg.dora.k, fit.cfg.mode
    traits = traits_of(mode, k0)
    sweep_k = traits.uses_k and vary_k
    for n in sorted({max(1, round((total - 1) * f)) for f in (0.25, 0.5, 0.75)} | {fit.cfg.cluster.rollout_instances}):
        if n >= total:
            continue
        for k in sorted({max(0, k0 - 1), k0, k0 + 1, 2 * k0}) if sweep_k else [k0]:
            for elastic in (False, True) if traits.elastic else (False,):
                for rbs in sorted({fit.cfg.batch.rbs, "auto"}, key=str) if traits.auto_rbs else [fit.cfg.batch.rbs]:
                    for admission in ADMISSIONS if traits.uses_k else (None,):
                        candidates.append({"cluster.rollout_instances": n, "cluster.trainer_ranks": total - n,
                                           "cluster.elastic": elastic, "batch.rbs": rbs}
                                          | ({"dora.admission": admission} if admission else {})
                                          | ({"dora.k": k} if sweep_k else {}))
    rows = []
    for sets in candidates:
        c = with_overrides(base, {k: v for k, v in sets.items() if k != "cluster.trainer_ranks"})
        s = simulate(replace(fit, cfg=c), c)
        rows.append({"set": sets, "predicted_tokens_per_s": s["throughput_tokens_per_s"],
                     "predicted_step_s": s["mean_step_time_s"], "max_staleness": s["max_staleness"],
                     "mean_staleness": s["mean_staleness_steady"],
                     "predicted_trainer_wait": s["trainer_wait_fraction"], "weights": s["weights"]})
        if progress:
            progress()
    rows.sort(key=lambda r: -r["predicted_tokens_per_s"])
    near = [r for r in rows if r["predicted_tokens_per_s"] >= RECOMMEND_WITHIN * rows[0]["predicted_tokens_per_s"]]
    recommended = min(near, key=lambda r: (r["mean_staleness"], -r["predicted_tokens_per_s"]))
    return {"run_dir": str(run_dir), "fit_check": {"measured_step_s": fit.measured_step_s,
                                                   "simulated_step_s": again["mean_step_time_s"],
                                                   "relative_error": error, "within": bool(abs(error) <= FIT_TOLERANCE),
                                                   "replayed_lengths": fit.logged is not None,
                                                   "tolerance": FIT_TOLERANCE,
                                                   "simulated_tokens_per_s": again["throughput_tokens_per_s"],
                                                   "simulated_trainer_wait": again["trainer_wait_fraction"],
                                                   "measured_trainer_wait": fit.measured_waits},
            "measured_tokens_per_s": fit.measured_tokens_per_s, "fitted": fit.fitted, "accelerators": total,
            "candidates": rows, "n_candidates": len(candidates), "recommended": recommended["set"],
            "recommend_within": RECOMMEND_WITHIN,
            "k": {"run": k0, "varied": bool(sweep_k), "uses_k": traits.uses_k}}
