"""The simulator: cost-model algebra, instance mechanics, and whole runs checked from its own record."""

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dora_hpc.cli import main
from dora_hpc.config import load_config, with_overrides
from dora_hpc.core.policies import MODES
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.costs import CostModel
from dora_hpc.sim.instance import Instance, Req
from dora_hpc.sim.metrics import kv_bound_rate, summarize, zero_bubble_limit

SMALL = "configs/sim/small.yaml"


def cost(**kw):
    base = dict(a=0.01, b=1e-6, prefill_per_token=1e-5, prefill_per_token2=0.0, train_flops_per_token=1.0,
                train_flops_per_accel=1.0, kv_bytes_per_token=1.0, kv_link=1.0, host_link=1.0,
                weight_load_s=1.0, colocated_switch_s=0.0, kv_capacity_tokens=1e9)
    base.update(kw)
    return CostModel(**base)


@given(k=st.integers(0, 5000), n=st.integers(1, 300), kv0=st.floats(0, 1e6))
def test_decode_time_is_the_sum_of_steps_and_its_inverse_is_exact(k, n, kv0):
    c = cost()
    if k <= 50:
        stepwise = sum(c.a + c.b * (kv0 + n * s) for s in range(k))
        assert c.decode_time(k, n, kv0) == pytest.approx(stepwise, rel=1e-9, abs=1e-12)
    t = c.decode_time(k, n, kv0)
    assert c.decode_steps_within(t, n, kv0) == k
    assert c.decode_steps_within(t + c.a * 0.5, n, kv0) == k


def test_instance_preempts_newest_and_readmits_fifo():
    c = cost(kv_capacity_tokens=1000)
    inst = Instance(0, c, kv_offload=False, version=0)
    for t in range(3):
        inst.admit(Req(t, prompt=300, target=500))
    assert list(inst.reqs) == [0, 1, 2]  # 900 tokens + 3 < 1000
    inst.t_run = 0.0
    assert inst.offset == pytest.approx(-c.prefill_time(900))  # three prompt prefills owed first
    # prefill, then 33 steps -> 999 tokens: the next step (3 more) would overflow 1000
    inst.advance(-inst.offset + c.decode_time(33, 3, inst.kv_tokens()))
    assert inst.steps == 33
    inst.preempt()
    assert list(inst.reqs) == [0, 1] and inst.waiting[0].traj == 2 and inst.waiting[0].owes == "recompute"
    assert inst.counts["preemptions"] == 1
    assert inst.generated(inst.waiting[0]) == 33


def test_offload_parks_kv_on_host_instead_of_recomputing():
    c = cost(kv_capacity_tokens=1000)
    inst = Instance(0, c, kv_offload=True, version=0)
    for t in range(3):
        inst.admit(Req(t, prompt=300, target=500))
    inst.t_run = 0.0
    inst.advance(-inst.offset + c.decode_time(33, 3, inst.kv_tokens()))
    inst.preempt()
    assert inst.waiting[0].owes == "host" and inst.ops["offload"] > 0


@pytest.fixture(scope="module")
def small_runs():
    cfg = load_config(SMALL, ["engine.prefix_caching=false"])  # the golden figures below were made unshared
    return {m: summarize(Simulator(cfg, m).run()) for m in MODES}


def test_every_mode_keeps_the_invariants(small_runs):
    for mode, s in small_runs.items():
        assert s["lost_groups"] == 0 and s["duplicate_groups"] == 0 and s["split_groups"] == 0, mode
        assert s["steps"] == 12
        if mode != "partial":
            assert s["mixed_version_trajectories"] == 0, mode
    assert small_runs["sync"]["max_staleness"] == 0
    assert small_runs["oversample"]["max_staleness"] == 0
    assert small_runs["one_step"]["max_staleness"] == 1
    assert small_runs["dora"]["max_staleness"] <= 2


def test_each_mode_shows_its_mechanism(small_runs):
    dora, partial, over = small_runs["dora"], small_runs["partial"], small_runs["oversample"]
    assert dora["migrations"] > 0 and dora["reprefill_tokens"] == 0
    assert partial["reprefill_tokens"] > 0 and partial["partial_segments"]["trajectories_with_switches"] > 0
    assert over["dropped_groups"] > 0
    assert dora["throughput_tokens_per_s"] > small_runs["sync"]["throughput_tokens_per_s"]
    assert small_runs["sync"]["rollout_only_fraction"] > dora["rollout_only_fraction"]


def test_trainer_waits_are_its_idle_time_split_by_what_binds():
    """The waits add up to the window's time outside train steps (and drains); a sync trainer never waits
    for the staleness window, DORA at K=1 does, and a larger K frees some of it. Without prefix sharing:
    with it, seed 0's K=4 run waits on the window 0.442 of the time against K=1's 0.436 (unshared: 0.383
    and 0.432), while seeds 1 and 2 wait less shared than unshared (0.399, 0.397 against 0.409, 0.417):
    this 12-step config's spread, not the window's accounting, which is what this test checks."""
    def run(mode, *over):
        sim = Simulator(load_config(SMALL, [*over, "engine.prefix_caching=false"]), mode, timeline=False).run()
        return sim, summarize(sim)

    for mode, k in (("sync", 2), ("dora", 1), ("dora", 4)):
        sim, s = run(mode, f"dora.k={k}")
        w = sim.cfg.sim.warmup_steps
        span = sim.steps[-1]["t_end"] - sim.steps[w - 1]["t_end"]
        busy = sum(st["train_s"] + st["drain_s"] for st in sim.steps[w:])
        waits = s["trainer_wait_fraction"]
        assert sum(waits.values()) == pytest.approx(1 - busy / span, abs=1e-9), (mode, k)
        if mode == "sync":
            assert waits["window"] == 0 and waits["capacity"] + waits["tail"] > 0.2
        elif k == 1:
            k1 = waits["window"]
            assert k1 > 0.2
        else:
            assert waits["window"] < k1


def test_dora_keeps_several_versions_on_the_instances():
    sim = Simulator(load_config(SMALL), "dora").run()
    t_mid = sim.steps[6]["t_start"]
    live = {v for (_, t0, t1, state, v, _) in sim.timeline if state == "busy" and t0 <= t_mid < t1}
    assert len(live) >= 2


def test_same_seed_same_result_and_kv_ablation_reprefills():
    cfg = load_config(SMALL)
    a = summarize(Simulator(cfg, "dora", timeline=False).run())
    b = summarize(Simulator(cfg, "dora", timeline=False).run())
    assert a == b
    no_kv = load_config(SMALL, ["dora.kv_migration=false"])
    c = summarize(Simulator(no_kv, "dora", timeline=False).run())
    assert c["reprefill_tokens"] > 0 and c["migrations"] > 0


def test_kv_pressure_causes_preemption_when_memory_is_short():
    cfg = load_config(SMALL, ["sim.hardware.hbm_gb=17"])  # 7.6B weights leave ~0.1M KV tokens
    s = summarize(Simulator(cfg, "sync", timeline=False).run())
    assert s["preemptions"] > 0 and s["preempt_recompute_tokens"] > 0 and s["kv_peak_fraction"] <= 1.0
    assert s["lost_groups"] == 0


def test_cli_writes_summary_and_timelines(tmp_path, capsys):
    assert main(["simulate", SMALL, "--modes", "sync,dora", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out  # small.yaml leaves 2 warm-up steps out at K=2: the window holds the fill
    assert "note: sim.warmup_steps (2) <= dora.k (2)" in out and "dora: the trainer waited" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    keys = {"throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "slot_utilization",
            "bubble_fraction", "max_staleness", "lost_groups", "duplicate_groups",
            "mixed_version_trajectories", "reprefill_tokens", "dropped_groups"}
    assert set(summary["modes"]) == {"sync", "dora"}
    assert keys <= set(summary["modes"]["dora"])
    assert summary["limit_tokens_per_s"] > summary["modes"]["dora"]["throughput_tokens_per_s"]
    assert (tmp_path / "timeline-dora.png").stat().st_size > 10_000


@pytest.mark.slow  # a scale check, left to --full
def test_512_instances_simulate_well_under_a_minute():
    """512 instances of a 4,096-accelerator config in under a minute of one core: 40 s on 2026-12-06's 2-core
    box (50 s before ClusterView kept its live instances as a set; the same code measured 31-43 s on an
    earlier box, so the bound is the minute the name promises, not a measurement)."""
    cfg = load_config("configs/sim/scale-4096.yaml")
    t = time.perf_counter()
    sim = Simulator(cfg, "dora", timeline=False).run()
    elapsed = time.perf_counter() - t
    s = summarize(sim)
    assert len(sim.inst) == 512 and s["lost_groups"] == 0
    assert elapsed < 60, f"{elapsed:.1f}s"


def test_elastic_borrows_the_trainers_accelerators_and_drains_them_before_each_step():
    """cluster.elastic on the small config cut to 4 rollout instances (rollout-bound: the trainer waits
    86% of the time): the 12 training accelerators also host 12 borrowed instances; every step starts
    only after they are drained (KV migrated or offloaded, nothing re-prefilled), the invariants hold,
    and the run is faster than without them. (Where the trainer waits for stragglers rather than for
    capacity, as on the full small config, borrowing buys nothing: results/sim/elastic.)"""
    base = load_config(SMALL, ["cluster.rollout_instances=4"])
    elastic = load_config(SMALL, ["cluster.rollout_instances=4", "cluster.elastic=true"])
    a, b = (summarize(Simulator(c, "dora", timeline=False).run()) for c in (base, elastic))
    assert b["borrowed_instances"] == 12 and a["borrowed_instances"] == 0
    assert (b["lost_groups"], b["duplicate_groups"], b["split_groups"], b["mixed_version_trajectories"]) == (0,) * 4
    assert b["max_staleness"] <= 2 and b["reprefill_tokens"] == 0
    assert b["drain_migrations"] + b["drain_offloads"] > 0 and b["drain_wait_s"] > 0
    assert b["throughput_tokens_per_s"] > a["throughput_tokens_per_s"]
    sim = Simulator(elastic, "dora").run()  # asleep (drawn as paused) whenever the trainer trains
    step = sim.steps[5]
    mid = step["t_start"] + step["drain_s"] + step["train_s"] / 2
    states = {s for (i, t0, t1, s, _, _) in sim.timeline if i >= 4 and t0 <= mid < t1}
    assert states == {"paused"}, states


def test_elastic_needs_dora_disaggregated():
    with pytest.raises(Exception, match="cluster.elastic"):
        load_config(SMALL, ["cluster.elastic=true", "mode=sync"])


# -- multi-turn episodes (workload.turns) ------------------------------------------------------------------
def same(a, b) -> bool:
    """Equal, floats to rounding (1e-12 relative: a sum taken in another order), nested dicts and lists too."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-12, abs=1e-15)
    return a == b


def test_single_turn_workloads_give_exactly_the_figures_of_before_episodes(small_runs):
    """tests/data/sim-small-single-turn.json: every mode on configs/sim/small.yaml (and DORA elastic) as the
    simulator gave them at commit dfd7fa5, before it knew episodes (DORA's under dora.admission: eager, the
    default, pinned; every mode without prefix sharing, engine.prefix_caching=false, as they were made).
    turns.max 1 must change nothing. Two figures were re-recorded when their definitions became analyze's
    (measure/utilization.py, 2026-12-05): ``inter_instance_bubble`` (intervals within the measured window) and
    elastic's ``rollout_only_fraction`` (a drain before a step is not training); and three when the simulator's
summary took analyze's definitions (measure/migration.py, measure/invariants.py): ``migrations`` and
``migrated_kv_bytes`` count the moves that arrived (restores included), and partial's
``mixed_version_trajectories`` is 0 (its switches are ``partial_segments``, not a broken invariant)."""
    import json
    from pathlib import Path

    gold = json.loads((Path(__file__).parent / "data" / "sim-small-single-turn.json").read_text())
    unshared = ["dora.admission=eager", "engine.prefix_caching=false"]
    eager = {"dora": summarize(Simulator(load_config(SMALL, unshared), "dora").run()),
             "dora-elastic": summarize(Simulator(load_config(SMALL, ["cluster.elastic=true", *unshared]),
                                                 "dora").run())}
    for mode, s in {**small_runs, **eager}.items():
        got = json.loads(json.dumps(s, sort_keys=True))
        assert same({k: got[k] for k in gold[mode]}, gold[mode]), mode
        assert "episodes" not in got


AGENTIC = ["workload.turns={median: 4, sigma: 0.7, max: 20}",
           "workload.response_len={median: 250, sigma: 1.0, max: 8192, min: 16}",
           "workload.env_tokens={median: 300, sigma: 1.0, max: 4096}",
           "workload.env_latency_s={median: 2, sigma: 1.3, max: 300}", "workload.max_episode_tokens=32768"]


def test_an_episode_is_its_turns_cut_at_the_episode_cap():
    from dora_hpc.sim.workload import Workload

    cfg = load_config(SMALL, [*AGENTIC[:-1], "workload.max_episode_tokens=2000"])
    w = Workload(cfg.workload, 0)
    eps = [w.episode(t, 100) for t in range(300)]
    assert max(len(e) for e in eps) > 4 and min(len(e) for e in eps) >= 1
    for t, e in enumerate(eps):
        assert 100 + sum(x.tokens + x.env_tokens for x in e) <= 2000
        assert e[0].tokens == min(w.response_len(t), 1900)  # the first turn is the single-turn draw
        assert e[-1].env_tokens == 0 and all(x.env_tokens > 0 for x in e[:-1])  # the last step says done
    assert all(e[-1].env_s > 0 for e in eps)  # ... and takes its latency, as every step does
    assert w.episode(7, 100) == eps[7]  # a pure function of (seed, trajectory)


def test_logged_lengths_replace_the_draws_they_name_and_only_those():
    """plan's fit check replays a real run's lengths (sim/fit.py): a logged group's prompt and a logged
    trajectory's response are the logged ones; every other id keeps its draw; the simulated run trains them."""
    from dora_hpc.sim.workload import Logged, Workload

    cfg = load_config(SMALL)
    drawn = Workload(cfg.workload, cfg.seed)
    w = Workload(cfg.workload, cfg.seed, Logged({1: 7}, {0: 3, 5: 11}))
    assert (w.prompt_len(1), w.response_len(0), w.response_len(5)) == (7, 3, 11)
    assert [w.prompt_len(g) for g in (0, 2)] == [drawn.prompt_len(g) for g in (0, 2)]
    assert [w.response_len(t) for t in range(1, 5)] == [drawn.response_len(t) for t in range(1, 5)]
    long = Logged({}, dict.fromkeys(range(cfg.batch.group_size), cfg.workload.response_len.max))
    s = Simulator(cfg, "sync", timeline=False, logged=long)
    s.run()
    assert s.episodes[0][0].tokens == cfg.workload.response_len.max


def test_an_instant_environment_still_gives_every_turn():
    """Environment steps that take no time: an episode still runs all its turns (the step after the last one
    is the only one that may be skipped, since it only says done)."""
    from dora_hpc.sim.workload import Workload

    cfg = load_config(SMALL, [*AGENTIC[:3], "workload.env_latency_s={median: 0, sigma: 0, max: 1}", AGENTIC[4]])
    s = summarize(Simulator(cfg, "dora", timeline=False).run())
    w = Workload(cfg.workload, cfg.seed)
    assert s["episodes"]["turns_mean"] > 3 and s["episodes"]["env_prefill_tokens"] > 0
    assert all(x.env_s == 0 for t in range(50) for x in w.episode(t, 100))


@pytest.fixture(scope="module")
def agentic_runs():
    cfg = load_config(SMALL, AGENTIC)
    return {m: summarize(Simulator(cfg, m).run()) for m in MODES}


def test_every_mode_runs_multi_turn_episodes_and_keeps_the_invariants(agentic_runs):
    for mode, s in agentic_runs.items():
        assert (s["lost_groups"], s["duplicate_groups"], s["split_groups"]) == (0, 0, 0), mode
        assert 3 < s["episodes"]["turns_mean"] < 8 and s["episodes"]["env_s_mean"] > 0, mode
        assert s["episodes"]["env_prefill_tokens"] > 0, mode
    dora, partial = agentic_runs["dora"], agentic_runs["partial"]
    assert dora["mixed_version_trajectories"] == 0 and dora["episodes"]["multi_version_episodes"] == 0
    assert dora["max_staleness"] <= 2 and dora["reprefill_tokens"] == 0
    assert dora["episodes"]["waiting_migrations"] > 0  # episodes moved with their KV while their tool ran
    assert partial["episodes"]["multi_version_episodes"] > 0 and partial["reprefill_tokens"] > 0
    assert dora["throughput_tokens_per_s"] > agentic_runs["sync"]["throughput_tokens_per_s"]


def test_environment_steps_queue_for_an_instances_workers_first_come_first_served(agentic_runs):
    """workload.env_workers: an instance runs that many environment steps at once; the rest wait for the
    earliest free worker in arrival order, none waits while a worker is free. A step's own seconds
    (env_s) are unchanged, so only the episodes' wall time grows."""
    steps: list[tuple[int, float, float, float]] = []  # (instance, submitted, start, end)
    workers = 2

    class Recorded(Simulator):
        def _env_done_at(self, inst, secs):
            end = super()._env_done_at(inst, secs)
            steps.append((inst.idx, self.now, end - secs, end))
            return end

    s = summarize(Recorded(load_config(SMALL, [*AGENTIC, f"workload.env_workers={workers}"]), "dora",
                           timeline=False).run())
    waited = 0
    for i in {x[0] for x in steps}:
        mine = [x for x in steps if x[0] == i]
        for k, (_, sub, start, _) in enumerate(mine):
            busy = sum(1 for _, _, s0, e0 in mine[:k] if s0 <= start < e0 - 1e-9)  # (start is end - secs: rounded)
            assert start >= sub - 1e-9 and busy < workers  # a free worker for it when it starts
            if start > sub + 1e-9:  # it waited: every worker was taken when it came, by steps that came before it
                waited += 1
                assert sum(1 for x in mine[:k] if x[3] > sub) >= workers
            assert all(x[2] <= start for x in mine[:k])  # first come, first started
    assert waited > 0 and s["episodes"]["env_s_mean"] == pytest.approx(
        agentic_runs["dora"]["episodes"]["env_s_mean"], rel=0.3)
    assert s["throughput_tokens_per_s"] < agentic_runs["dora"]["throughput_tokens_per_s"]


def test_a_held_episode_keeps_its_kv_without_compute_and_leaves_first_under_pressure():
    c = cost(kv_capacity_tokens=2000, prefill_per_token=1e-3, host_link=1e6)
    inst = Instance(0, c, kv_offload=True)
    inst.admit(Req(0, prompt=500, target=100))
    inst.t_run = 0.0
    inst.advance(-inst.offset + c.decode_time(100, 1, inst.batch_kv()))
    (r,) = inst.pop_finished()
    r.waiting_env = True
    inst.hold(r)
    assert inst.kv_tokens() == 600 and inst.batch_kv() == 0 and not inst.reqs and inst.has_work()
    inst.admit(Req(1, prompt=1500, target=10))  # needs the room: the held episode goes to host memory
    assert 1 in inst.reqs and inst.held[0].owes == "host" and inst.held_kv == 0 and inst.ops["offload"] > 0
    r = inst.unhold(0)
    r.gen_at_join, r.env_owed, r.target, r.waiting_env = 100 + 50, 50, 200, False
    before = inst.offset
    inst.remove(1)
    inst.admit(r)  # back from host, then only the environment's 50 tokens are prefilled
    assert inst.counts["env_prefill_tokens"] == 50
    assert before - inst.offset == pytest.approx(c.host_copy_time(600) + c.prefill_time(650) - c.prefill_time(600))


def test_the_zero_bubble_limit_is_bounded_by_kv_memory():
    """An instance finishes at most capacity / (KV token-seconds per trajectory) trajectories a second: with
    flat decode steps (b = 0) and no prefill that is exact; the KV read per step (b > 0) and prefill lower it."""
    c, m = cost(a=0.02, b=0.0, kv_capacity_tokens=1e6), {"kv_steps": 5e6}
    assert kv_bound_rate(c, m, 0.0) == pytest.approx(1e6 / (5e6 * 0.02), rel=1e-9)
    assert kv_bound_rate(cost(a=0.02, b=1e-8, kv_capacity_tokens=1e6), m, 0.0) < kv_bound_rate(c, m, 0.0)
    assert kv_bound_rate(c, m, 1.0) < kv_bound_rate(c, m, 0.0)


def test_the_limit_bounds_every_mode_when_kv_memory_binds(monkeypatch):
    """20 GB accelerators: the agentic episodes' decoding KV, not the slots, binds; the limit says so (61% of
    the slot-and-compute bound) and DORA stays under it (measured at 75% of it)."""
    import dora_hpc.sim.metrics as metrics

    cfg = load_config(SMALL, [*AGENTIC, "sim.hardware.hbm_gb=20"])
    limit = zero_bubble_limit(cfg, "disaggregated")
    with monkeypatch.context() as m:
        m.setattr(metrics, "kv_bound_rate", lambda *a: float("inf"))
        assert limit < 0.75 * zero_bubble_limit(cfg, "disaggregated")
    s = summarize(Simulator(cfg, "dora", timeline=False).run())
    assert s["kv_peak_fraction"] > 0.99 and s["throughput_tokens_per_s"] <= limit


def test_kept_versions_are_sharded_over_the_trainers_and_deltas_cut_the_weight_loads(small_runs):
    """The memory model: each trainer rank keeps its 1/T shard of K+2 versions (DORA) in the publish dtype;
    with ``sim.hardware.delta_ratio`` a load from the trainers onto an instance that holds a version moves
    that share of the bytes (peer and first loads move them all), and the loads' time drops with it."""
    cfg = load_config(SMALL)
    whole = small_runs["dora"]["weights"]
    t = small_runs["dora"]["train_accelerators"]
    assert whole["kept_versions"] == cfg.dora.k + 2
    assert whole["kept_gb_per_trainer_rank"] == pytest.approx((cfg.dora.k + 2) * cfg.sim.model.weight_bytes / t / 1e9)
    assert whole["weight_load_s_per_step"] == pytest.approx(whole["weight_load_s_per_step_whole"])
    d = summarize(Simulator(load_config(SMALL, ["sim.hardware.delta_ratio=0.25"]), "dora", timeline=False).run())
    w = d["weights"]
    assert w["delta_ratio"] == 0.25 and w["weight_load_s_per_step"] < 0.5 * w["weight_load_s_per_step_whole"]
    assert w["publish_gb_per_step_per_trainer_rank"] < whole["publish_gb_per_step_per_trainer_rank"]
    off = summarize(Simulator(load_config(SMALL, ["sim.hardware.delta_ratio=0.25", "train.publish_delta=false"]),
                              "dora", timeline=False).run())
    assert off["weights"]["weight_load_s_per_step"] == pytest.approx(off["weights"]["weight_load_s_per_step_whole"])


def test_a_mixture_of_experts_computes_with_its_active_parameters_and_stores_all_of_them():
    """production-4096.yaml's LongCat-Flash: prefill and training FLOPs follow the 27B active parameters, a
    decode step's weight reads, a weight load and the KV room all 560B; MLA caches 576 values a token a
    layer. A dense model's costs are unchanged by stating its active parameters as all of them."""
    cfg = load_config("configs/sim/production-4096.yaml")
    m, tp = cfg.sim.model, cfg.cluster.accelerators_per_instance
    moe = CostModel.build(cfg.sim, tp)
    dense = CostModel.build(load_config("configs/sim/production-4096.yaml", ["sim.model.active_params_b=560"]).sim, tp)
    assert moe.prefill_per_token == pytest.approx(dense.prefill_per_token * 27 / 560)
    assert moe.train_flops_per_token == pytest.approx(8 * 27e9)
    stored = ("a", "weight_load_s", "kv_capacity_tokens")
    assert [getattr(moe, k) for k in stored] == [getattr(dense, k) for k in stored]
    assert m.kv_bytes_per_token == 56 * 576 * 2
    qwen = load_config("configs/sim/paper-64.yaml").sim
    stated = load_config("configs/sim/paper-64.yaml", [f"sim.model.active_params_b={qwen.model.params_b}"]).sim
    assert CostModel.build(qwen, 4) == CostModel.build(stated, 4)
    with pytest.raises(ValueError, match="active_params_b"):
        load_config("configs/sim/paper-64.yaml", ["sim.model.active_params_b=40"])


# -- shared prompts (engine.prefix_caching) ----------------------------------------------------------------
def test_a_groups_prompt_and_the_shared_prefix_are_prefilled_and_held_once_per_instance():
    c = cost(prefill_per_token=1e-3)
    inst = Instance(0, c, share=True, shared_prefix=200)
    inst.admit(Req(0, prompt=500, target=10, group=7))
    first = -inst.offset
    inst.admit(Req(1, prompt=500, target=10, group=7))  # its whole prompt is resident: nothing to prefill
    inst.admit(Req(2, prompt=450, target=10, group=8))  # another group: only its own 250 tokens
    assert first == pytest.approx(c.prefill_time(500))
    assert -inst.offset == pytest.approx(first + c.prefill_time(450) - c.prefill_time(200))
    assert inst.counts["prefix_hit_tokens"] == 500 + 200
    assert inst.kv_tokens() == 200 + 300 + 250  # the prefix, group 7's own part, group 8's own part
    assert inst.batch_kv() == 500 + 500 + 450  # a decode step still reads every context whole
    for t in (0, 1, 2):
        inst.remove(t)
    assert inst.kv_tokens() == 0 and not inst.refs and inst.shared_kv == 0


def test_sharing_a_system_prompt_raises_the_kv_bound_limit_and_the_throughput_under_it():
    """Agentic episodes on 20 GB accelerators (KV binds) with a 2,000-token system prompt: held once per
    instance and each group's prompt once, the limit and DORA's tokens/s rise, and DORA stays under it."""
    base = [*AGENTIC, "sim.hardware.hbm_gb=20", "workload.shared_prefix_tokens=2000"]
    runs = {}
    for shared in (False, True):
        cfg = load_config(SMALL, [*base, f"engine.prefix_caching={str(shared).lower()}"])
        s = summarize(Simulator(cfg, "dora", timeline=False).run())
        runs[shared] = (zero_bubble_limit(cfg, "disaggregated"), s)
        assert s["throughput_tokens_per_s"] <= runs[shared][0] and s["lost_groups"] == 0
    assert runs[True][0] > runs[False][0]
    assert runs[True][1]["throughput_tokens_per_s"] > runs[False][1]["throughput_tokens_per_s"]
    assert runs[True][1]["prefix_hit_tokens"] > 0 == runs[False][1]["prefix_hit_tokens"]


def test_a_chunked_reprefill_stalls_the_batch_only_beyond_its_chunks_decode_steps():
    """sim.hardware.reprefill: blocking charges the whole prefill; chunked charges each 512-token chunk at
    10% less efficiency, minus the decode step's fixed part each chunk's iteration carries the decodes in."""
    blocking = cost(prefill_per_token=1e-4)
    chunked = cost(prefill_per_token=1e-4, chunk_tokens=512, chunk_slowdown=1 / 0.9)
    whole = blocking.prefill_time(5000)  # 0.5 s
    assert blocking.reprefill_stall(5000, whole) == whole
    assert chunked.reprefill_stall(5000, whole) == pytest.approx(whole / 0.9 - 10 * 0.01)
    assert chunked.reprefill_stall(50, blocking.prefill_time(50)) == 0  # a chunk within one decode step
    inst = Instance(0, chunked, kv_offload=False, version=0)
    inst.admit(Req(0, prompt=300, target=500))
    inst.reqs[0].owes = "reprefill"  # as a partial rollout's invalidate_kv leaves it, before it runs again
    req = inst.remove(0)
    before = inst.offset
    inst.admit(req)
    assert before - inst.offset == pytest.approx(chunked.reprefill_stall(300, chunked.prefill_time(300)))


def test_a_frontier_keeps_each_simulation_and_a_second_run_takes_them_from_there(tmp_path, monkeypatch):
    from dora_hpc.sim import frontier as fr

    cfg = load_config("configs/sim/small.yaml", ["sim.steps=4", "sim.warmup_steps=1", "batch.tbs=16",
                                                 "batch.rbs=24"])
    monkeypatch.setattr(fr, "DEPTHS", (1.5,))
    first = fr.frontier(cfg, ks=(2,), workers=1, cache=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == len(first) == len(fr.points(cfg, (2,)))

    def never(*_):
        raise AssertionError("a kept simulation was run again")

    monkeypatch.setattr(fr, "run_point", never)
    assert fr.frontier(cfg, ks=(2,), workers=1, cache=tmp_path) == first
    # another config is another simulation: nothing kept is taken for it
    other = fr.run_file(tmp_path, with_overrides(cfg, {"seed": 1}), fr.points(cfg, (2,))[0], 0)
    assert not other.exists()
