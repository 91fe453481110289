"""measure/utilization.py on hand-built logs with known answers."""

import numpy as np
import pytest

from dora_hpc.measure.utilization import utilization
from dora_hpc.store.shards import ShardWriter, read_table


def cols(rows, names):
    return {n: np.array([r[i] for r in rows]) for i, n in enumerate(names)}


def test_two_instances_two_steps_known_answers():
    # instance 2 decodes a full batch (2 of 2 slots) over [0,10] and [12,22]; instance 3 only half as long
    esteps = cols([(2, 0, 10, 2, 2), (2, 12, 22, 2, 2), (3, 0, 5, 2, 2), (3, 12, 17, 2, 2), (3, 5, 10, 0, 2)],
                  ["rank", "t_start", "t_end", "batch_size", "capacity"])
    tsteps = cols([(0, 10, 12, 100), (1, 22, 24, 300)], ["step", "t_start", "t_end", "tokens"])
    ops = cols([("weight_load", 10, 11.2, ""), ("migration_in", 15, 15.0, ""), ("trainer_wait", 0, 9, "capacity"),
                ("trainer_wait", 9, 10, "window"), ("trainer_wait", 12, 22, "tail")],
               ["kind", "t_start", "t_end", "detail"])
    u = utilization(esteps, tsteps, ops)
    assert u["window_s"] == 24
    assert u["slot_utilization"] == pytest.approx(60 / 96)       # 2*10 + 2*10 + 2*5 + 2*5 slot-seconds of 2x2x24
    assert u["bubble_fraction"] == pytest.approx(1 - 60 / 96)
    assert u["rollout_only_fraction"] == pytest.approx(20 / 24)  # busy [0,10] u [12,22], training [10,12] u [22,24]
    assert u["inter_instance_bubble"] == pytest.approx(0.25)     # per window: (0 + (10-5)/10) / 2
    assert u["throughput_tokens_per_s"] == pytest.approx(400 / 24)
    assert u["engine_steps_per_trained_token"] == pytest.approx(4 / 400)  # the idle step does not count
    assert u["instance_busy_s"] == pytest.approx((20 + 10) / 2)
    assert u["overheads"] == {"weight_load": pytest.approx(1.2 / 48)}  # zero-length ops take no time
    assert u["trainer_wait_fraction"] == {"capacity": pytest.approx(9 / 24), "tail": pytest.approx(10 / 24),
                                          "window": pytest.approx(1 / 24)}  # a wait is not an overhead
    # leaving step 0 out as warm-up: the window is [12, 24]
    w = utilization(esteps, tsteps, ops, warmup_steps=1)
    assert w["window_s"] == 12 and w["slot_utilization"] == pytest.approx(30 / 48)
    assert w["trainer_wait_fraction"]["tail"] == pytest.approx(10 / 12) and w["trainer_wait_fraction"]["capacity"] == 0
    assert w["throughput_tokens_per_s"] == pytest.approx(300 / 12)
    assert w["engine_steps_per_trained_token"] == pytest.approx(2 / 300)


def test_a_perfectly_balanced_run_has_no_inter_instance_bubble_and_empty_logs_give_zeros():
    esteps = cols([(r, 0, 10, 4, 4) for r in (2, 3, 4)], ["rank", "t_start", "t_end", "batch_size", "capacity"])
    tsteps = cols([(0, 10, 11, 50)], ["step", "t_start", "t_end", "tokens"])
    ops = cols([], ["kind", "t_start", "t_end", "detail"])
    u = utilization(esteps, tsteps, ops)
    assert u["inter_instance_bubble"] == 0 and u["slot_utilization"] == pytest.approx(10 / 11)
    empty = cols([], ["rank", "t_start", "t_end", "batch_size", "capacity"])
    assert utilization(empty, tsteps, ops)["slot_utilization"] == 0.0


def test_engine_steps_carry_the_rank_of_their_shard(tmp_path):
    for rank in (2, 3):
        w = ShardWriter(tmp_path, "events", rank, "rollout", "r")
        w.append("steps", {"t_start": 0.0, "t_end": 1.0, "batch_size": rank, "capacity": 8, "new_tokens": 1,
                           "kv_blocks_used": 0, "version": 0})
        w.flush()
    e = read_table(tmp_path, "events", "steps", with_rank=True)
    assert sorted(zip(e["rank"].tolist(), e["batch_size"].tolist(), strict=True)) == [(2, 2), (3, 3)]


def test_a_large_synthetic_log_analyses_with_its_invariants(tmp_path):
    """The scaling benchmark's generator and analyze agree (10^6 rows: `dora-hpc bench analysis`)."""
    from dora_hpc.bench.analysis_bench import bench_analysis

    s = bench_analysis(tmp_path / "out", 20_000, tmp_path / "run")
    assert s["consumed"] == s["trajectories"] == 19_968 and s["max_staleness"] == 2
    assert s["invariants"] == {"mixed_version_trajectories": 0, "staleness_over_k": 0, "lost_groups": 0,
                               "duplicate_groups": 0, "split_groups": 0}


def test_the_window_gate_is_the_requests_the_held_step_consumes_that_finish_inside_the_wait():
    from dora_hpc.measure.gate import gate_figures

    a = np.array
    # one window wait [10, 14] before step 3 (starts 14.1), one tail wait [20, 21] before step 4
    ops = {"kind": a(["trainer_wait", "trainer_wait", "publish"], dtype=object),
           "detail": a(["window", "tail", "x"], dtype=object),
           "t_start": a([10.0, 20.0, 5.0]), "t_end": a([14.0, 21.0, 5.0])}
    tsteps = {"step": a([3, 4]), "t_start": a([14.1, 21.1])}
    # step 3 consumes 7 (finished at 13 on rank 5), 8 (at 12 on rank 6) and 9 (before the wait: not gating)
    consumed = {"traj_id": a([7, 8, 9, 11]), "consume_step": a([3, 3, 3, 4])}
    finished = {"traj_id": a([7, 8, 9, 11]), "t_finish": a([13.0, 12.0, 4.0, 20.5]), "rank": a([5, 6, 5, 5])}
    # rank 5: steps of 1 s with 2 running from 9 on; rank 6: steps of 0.5 s with 4 running
    r5 = np.arange(9.0, 22.0)
    r6 = np.arange(10.0, 12.0, 0.5)
    esteps = {"rank": np.concatenate([np.full(len(r5), 5), np.full(len(r6), 6)]),
              "t_start": np.concatenate([r5, r6]), "t_end": np.concatenate([r5 + 1.0, r6 + 0.5]),
              "running": np.concatenate([np.full(len(r5), 2), np.full(len(r6), 4)])}
    w = gate_figures(ops, tsteps, consumed, finished, esteps)["window_gate"]
    assert w["waits"] == 1 and w["wait_s"] == 4.0 and w["gating_requests"] == 2
    assert w["explained"] == 0.75                   # the last gating request finished 3 s into the 4 s wait
    # request 7: rank 5's steps starting in [10, 13): 3 of 1 s at 2; request 8: rank 6's in [10, 12): 4 of 0.5 s at 4
    assert w["decode_step_s"] == (3 * 1.0 + 4 * 0.5) / 7 and w["batch"] == (3 * 2 + 4 * 4) / 7
    t = gate_figures(ops, tsteps, consumed, finished, esteps)["tail_gate"]
    assert t["gating_requests"] == 1 and t["explained"] == 0.5 and t["batch"] == 2.0
    none = {**ops, "detail": a(["capacity", "capacity", "x"], dtype=object)}
    assert gate_figures(none, tsteps, consumed, finished, esteps)["window_gate"] is None
