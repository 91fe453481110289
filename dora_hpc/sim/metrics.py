"""Figures of a finished simulation, computed from the simulator's own record.

The figures a real run has too -- throughput_tokens_per_s (trained tokens/s), slot_utilization,
bubble_fraction, rollout_only_fraction, inter_instance_bubble, trainer_wait_fraction, the run invariants and
migrations -- are measure/'s, on the tables the simulator recorded (sim/logs.py), over the measured window (from
the end of train step ``sim.warmup_steps - 1`` to the end of the last step): ``dora-hpc analyze`` gives the
same numbers on the run's written logs. Defined here, for the simulator alone:
* admission_cap: lean admission's cap at each step's start (measure/admission.py, as analyze's);
* mean_staleness: over every step, the fill included; mean_staleness_steady: over the steps started in the
  measured window (what the frontier and plan report);
* limit_tokens_per_s: the zero-bubble limit for a placement -- every instance always decoding a
  full batch, and (disaggregated) bounded by the trainer's speed, (colocated) sharing the devices. With
  multi-turn episodes a slot is also held while its episode's environment step runs: an instance then
  finishes at most max_num_seqs / (decode seconds + environment seconds) episodes a second. It is also
  bounded by KV memory: an instance finishes at most as many trajectories a second as its KV pool holds
  their decoding KV token-seconds (kv_bound_rate; waiting episodes' KV may go to host memory).
"""

from __future__ import annotations

from collections import Counter

from ..config import RunConfig
from ..core.policies import traits_of
from ..measure.admission import admission_caps
from ..measure.invariants import check
from ..measure.migration import migration_figures
from ..measure.utilization import multi_version_batches, utilization
from .cluster import Simulator
from .costs import CostModel
from .logs import rank_of
from .workload import Workload


def total(sim: Simulator, what: str) -> Counter:
    """Simulator-level plus per-instance ``ops`` (seconds) or ``counts``."""
    out = Counter(getattr(sim, what))
    for inst in sim.inst:
        out.update(getattr(inst, what))
    return out


def stranded_groups(sim: Simulator) -> set[int]:
    """Open groups with a trajectory the simulator no longer holds anywhere: neither running, moving, parked
    nor finished (a check of the simulator's own bookkeeping, which no log can show)."""
    g_size, out = sim.cfg.batch.group_size, set()
    for g in sim.policy.ledger.open_groups():
        for t in range(g * g_size, (g + 1) * g_size):
            rec = sim.trajs.get(t)
            alive = t in sim.policy.view.trajs or t in sim.in_transit or t in sim.parked
            if not (alive or (rec is not None and rec.finished)):
                out.add(g)
                break
    return out


def episode_figures(sim: Simulator, counts) -> dict:
    """A multi-turn workload's figures (none for a single-turn one): turns per finished episode, the
    environment's share of their rollout time, the environment tokens prefilled, episodes that migrated
    while waiting on their environment, and episodes whose turns ran under more than one version."""
    if sim.cfg.workload.turns.max == 1:
        return {}
    done = [r for r in sim.trajs.values() if r.finished]
    return {"episodes": {
        "turns_mean": sum(r.turn + 1 for r in done) / max(len(done), 1),
        "env_s_mean": sum(r.env_s for r in done) / max(len(done), 1),
        "env_prefill_tokens": int(counts["env_prefill_tokens"]),
        "waiting_migrations": int(counts["waiting_migrations"]),
        "multi_version_episodes": sum(1 for r in done if len(set(r.segments)) > 1)}}


def weight_figures(sim: Simulator, counts: Counter) -> dict:
    """The memory model of published versions: each trainer rank keeps its 1/T shard of every version it
    may serve, in the publish dtype (sim.model.bytes_per_param), and serves its 1/T of each load from the
    trainers; loads move ``sim.hardware.delta_ratio`` of the bytes where they go as deltas."""
    m, steps, t = sim.cfg.sim.model, len(sim.steps), sim.train_accels
    keep = traits_of(sim.mode, sim.cfg.dora.k).keep_versions
    return {"kept_versions": keep, "kept_gb_per_trainer_rank": keep * m.weight_bytes / t / 1e9,
            "publish_gb_per_step_per_trainer_rank": counts["trainer_load_bytes"] / steps / t / 1e9,
            "peer_load_gb_per_step": counts["peer_load_bytes"] / steps / 1e9,
            "weight_load_s_per_step": counts["weight_load_s"] / steps,
            "weight_load_s_per_step_whole": counts["weight_syncs"] * sim.cost.weight_load_s / steps,
            "delta_ratio": sim.cfg.sim.hardware.delta_ratio if sim.cfg.train.publish_delta else 1.0}


def summarize(sim: Simulator) -> dict:
    cfg = sim.cfg
    w = cfg.sim.warmup_steps
    t0, t1 = sim.steps[w - 1]["t_end"], sim.steps[-1]["t_end"]
    span = t1 - t0
    tables = sim.log.tables(sim.steps)
    u = utilization(tables.esteps, tables.tsteps, tables.ops, warmup_steps=w, colocated=sim.colocated,
                    ranks=[rank_of(i) for i in range(len(sim.inst))])
    traits = traits_of(sim.mode, cfg.dora.k)
    chk = check(tables.traj, tables.consumed, tables.ops, {0}, 0, traits.staleness_bound, cfg.batch.group_size)
    mig = migration_figures(tables.ops)
    wall = t1
    counts, ops = total(sim, "counts"), total(sim, "ops")
    return episode_figures(sim, counts) | {
        **{k: u[k] for k in ("throughput_tokens_per_s", "rollout_only_fraction", "trainer_wait_fraction",
                             "slot_utilization", "bubble_fraction", "inter_instance_bubble")},
        "mean_step_time_s": span / (len(sim.steps) - w),
        "max_staleness": max((x for s in sim.steps for x in s["staleness"]), default=0),
        "mean_staleness": sum(sum(s["staleness"]) for s in sim.steps) / (len(sim.steps) * cfg.batch.tbs),
        "mean_staleness_steady": sum(sum(s["staleness"]) for s in sim.steps[w:]) / ((len(sim.steps) - w)
                                                                                  * cfg.batch.tbs),
        "admission_cap": admission_caps({s["step"]: s["admission_cap"] for s in sim.steps
                                         if s["admission_cap"] is not None}, cfg.batch.tbs, w),
        "lost_groups": len(set(chk.lost.tolist()) | stranded_groups(sim)),
        "duplicate_groups": len(chk.duplicate),
        "mixed_version_trajectories": len(chk.mixed) if traits.single_version else 0,  # as analyze's
        "partial_segments": {} if traits.single_version else {"trajectories_with_switches": len(chk.mixed)},
        "split_groups": len(chk.split),
        "staleness_over_k": len(chk.over_k),
        "reprefill_tokens": int(counts["reprefill_tokens"]),
        "prefix_hit_tokens": int(counts["prefix_hit_tokens"]),
        "preemptions": int(counts["preemptions"]),
        "preempt_recompute_tokens": int(counts["preempt_recompute_tokens"]),
        "dropped_groups": len(sim.dropped),
        "migrations": mig["count"],
        "multi_version_batches": multi_version_batches(tables.esteps),
        "migrated_kv_bytes": float(mig["kv_bytes"]),
        "weight_syncs": int(counts["weight_syncs"]),
        "weights": weight_figures(sim, counts),
        "overheads": {k: v / wall / max(len(sim.inst), 1) for k, v in sorted(ops.items())},
        "kv_peak_fraction": sim.kv_peak,
        "rollout_instances": len(sim.inst) - sim.n_borrowed,
        "borrowed_instances": sim.n_borrowed,
        "drain_wait_s": sum(s["drain_s"] for s in sim.steps[w:]) / (len(sim.steps) - w),
        "drain_migrations": int(counts["drain_migrations"]),
        "drain_offloads": int(counts["drain_offloads"]),
        "train_accelerators": sim.train_accels,
        "placement": "colocated" if sim.colocated else "disaggregated",
        "steps": len(sim.steps),
        "sim_time_s": t1,
    }


def zero_bubble_limit(cfg: RunConfig, placement: str, moments: dict | None = None, borrowed: int = 0) -> float:
    """Consumed tokens/s with every rollout instance always decoding a full batch (no bubbles).

    ``borrowed`` instances (cluster.elastic) decode only while the trainer is idle: at throughput X the
    trainer is busy X / train_rate of the time, so X = dedicated + borrowed * (1 - X / train_rate),
    solved for X (drains and wake-ups cost nothing here)."""
    n_inst, train_accels = cfg.cluster.split(placement)
    cost = CostModel.build(cfg.sim, cfg.cluster.accelerators_per_instance)
    m = moments or Workload(cfg.workload, cfg.seed).moments()
    slots = cfg.cluster.max_num_seqs
    mean_kv = (m["PL"] + m["L2"] / 2) / m["L"]           # KV context seen by an average decode step
    step = cost.a + cost.b * slots * mean_kv             # one full-batch step
    decoded, env_tokens = m.get("model", m["L"]), m.get("env_tokens", 0.0)
    env_prefill = cost.prefill_time(m["P"] + env_tokens) - cost.prefill_time(m["P"]) if env_tokens else 0.0
    prompt_s = cost.prefill_time(m["P"])
    if cfg.engine.prefix_caching:  # a group's prompt prefilled and held once per G; the shared prefix once, by
        # every sequence of an instance (at best: this is a bound); its KV steps count what each holds alone
        head, g = cfg.workload.shared_prefix_tokens, cfg.batch.group_size
        prompt_s = (cost.prefill_time(m["P"]) - cost.prefill_time(head)) / g
        own = (m["P"] - head) / g + head / slots
        m = {**m, "kv_steps": m["kv_steps"] - (m["P"] - own) * decoded}
    per_traj = decoded * step / slots + prompt_s + env_prefill  # instance-seconds per trajectory
    if m.get("env_s"):  # a slot is held through the environment's steps: at most slots per (decode + env) time
        per_traj = max(per_traj, (decoded * step + m["env_s"]) / slots)
    per_traj = max(per_traj, 1.0 / kv_bound_rate(cost, m, per_traj - decoded * step / slots))
    tokens_per_traj = m["P"] + m["L"]
    rollout_rate = n_inst * tokens_per_traj / per_traj
    train_rate = tokens_per_traj / cost.train_time(tokens_per_traj, train_accels)
    if placement == "colocated":
        return 1.0 / (1.0 / rollout_rate + 1.0 / train_rate)
    lent = borrowed * tokens_per_traj / per_traj
    return min((rollout_rate + lent) / (1.0 + lent / train_rate), train_rate)


def kv_bound_rate(cost: CostModel, m: dict, prefill_s: float) -> float:
    """Trajectories per second one instance can finish before its KV memory binds, with every token of the
    pool in use: a trajectory occupies ``kv_steps`` KV tokens x decode-step seconds while it decodes
    (Little's law). An episode waiting on its environment binds no KV here: its KV may leave the pool for host
    memory (or be dropped and prefilled again), so only decoding KV bounds a bubble-free instance. A decode
    step reading u KV tokens takes a + b u, and the instance decodes only outside its ``prefill_s`` per
    trajectory; the rate is the largest that fits, found by bisection (the KV held grows with the rate)."""
    cap, ks = cost.kv_capacity_tokens, m["kv_steps"]

    def held(rate: float) -> float:  # KV tokens resident on average at this rate; inf past what decode allows
        decoding = 1.0 - rate * prefill_s
        if decoding <= 0 or cost.b * rate * ks >= decoding:
            return float("inf")
        step = cost.a / (1.0 - cost.b * rate * ks / decoding)  # u = rate * ks * step / decoding; step = a + b u
        return rate * ks * step / decoding

    lo, hi = 0.0, 1.0
    while held(hi) < cap:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if held(mid) < cap else (lo, mid)
    return lo
