"""A simulated run's HDF5 logs (sim/logs.py): ``dora-hpc analyze`` opens them like a real run's, and the figures
both sides define alike agree with the simulator's own record."""

from collections import Counter

import pytest

from dora_hpc.analysis.basic import analyze
from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

SMALL = "configs/sim/small.yaml"


SHARED = ("throughput_tokens_per_s", "slot_utilization", "bubble_fraction", "rollout_only_fraction",
          "inter_instance_bubble")  # the figures both report, each defined once (measure/utilization.py)


@pytest.mark.parametrize("mode", ["dora", "partial", "oversample", "sync", "one_step", "dora-elastic"])
def test_analyze_reads_a_simulated_run_and_agrees_with_the_simulator(tmp_path, mode):
    cfg = load_config(SMALL, ["cluster.elastic=true"] if mode == "dora-elastic" else [])
    mode = mode.removesuffix("-elastic")
    sim = Simulator(cfg, mode, timeline=False).run()
    sim.write_logs(tmp_path / mode)
    s, a = summarize(sim), analyze(tmp_path / mode)
    g, n = cfg.batch.group_size, cfg.sim.steps
    assert a["mode"] == mode and a["steps"] == n and a["missing"] == []
    for k in ("lost_groups", "duplicate_groups", "split_groups", "staleness_over_k", "mixed_version_trajectories"):
        assert s[k] == a["invariants"][k] == 0, k  # measure/invariants.py's check, on both
    assert a["consumed"] == n * cfg.batch.tbs * g
    assert a["trajectories"] == sum(r.finished for r in sim.trajs.values())
    want = Counter(x for st in sim.steps for x in st["staleness"] for _ in range(g))
    assert a["staleness"]["histogram"] == {str(k): v for k, v in sorted(want.items())}
    assert a["staleness"]["max"] == s["max_staleness"] and a["staleness"]["mean"] == pytest.approx(s["mean_staleness"])
    assert a["admission_cap"] == s["admission_cap"]  # lean's cap, one definition (measure/admission.py)
    for key in SHARED:  # the same number for the same run
        assert a[key] == pytest.approx(s[key], rel=1e-9, abs=1e-12), key
    for kind, share in s["trainer_wait_fraction"].items():
        assert a["trainer_wait_fraction"][kind] == pytest.approx(share, rel=1e-9, abs=1e-12), kind
    # the logs hold what completed: migrations that arrived (measure/migration.py: the orders, restores included as
    # the runtime counts them, less those still moving), loads that finished, finished trajectories' re-prefill
    assert a["migrations"] == s["migrations"]
    ordered = sum(r.migrations for r in sim.trajs.values()) + sim.counts["restores"]
    assert s["migrations"] == ordered - len(sim.log.moving)
    assert a["weights"]["mismatched_loads"] == 0
    assert a["weights"]["loads"] == sim.counts["weight_syncs"] - len(sim.log.loading) - sim.log.cancelled
    assert a["reprefill_tokens"] == sum(r.reprefill for r in sim.trajs.values() if r.finished)
    assert a["dropped_groups"] == s["dropped_groups"]
    # every second the trainer waited, by kind, over the whole run (the simulator's own clock)
    waits = Counter()
    for kind, t0, t1, d in zip(*(analyze_ops(tmp_path / mode)), strict=True):
        if kind == "trainer_wait":
            waits[d] += t1 - t0
    for kind in ("capacity", "tail", "window"):
        assert waits[kind] == pytest.approx(sim.wait_s[kind], rel=1e-9, abs=1e-6), kind


def test_the_simulators_invariant_check_sees_a_group_consumed_twice_and_a_group_lost():
    sim = Simulator(load_config(SMALL), "dora", timeline=False).run()
    assert summarize(sim)["duplicate_groups"] == summarize(sim)["lost_groups"] == 0
    sim.log.consumed += [c for c in sim.log.consumed if c[1] == sim.log.consumed[0][1]]  # its first group again
    assert summarize(sim)["duplicate_groups"] == 1
    rank, rows = next((r, rows) for r, rows in sim.log.traj.items() if rows)
    sim.log.traj[rank] = rows[1:]  # a consumed trajectory's row gone from the logs: its group is lost
    assert summarize(sim)["lost_groups"] == 1
    g = min(sim.policy.ledger.open_groups())
    for t in range(g * sim.cfg.batch.group_size, (g + 1) * sim.cfg.batch.group_size):
        sim.trajs.pop(t, None)  # an open group's trajectories gone from the simulator: stranded, lost too
        sim.policy.view.trajs.pop(t, None)
        sim.in_transit.pop(t, None)
        sim.parked.pop(t, None)
    assert summarize(sim)["lost_groups"] == 2


def analyze_ops(run_dir):
    from dora_hpc.store.shards import read_table

    ops = read_table(run_dir, "events", "ops")
    return ops["kind"], ops["t_start"], ops["t_end"], ops["detail"]


def test_simulate_run_dir_writes_each_modes_logs_for_analyze(tmp_path):
    from dora_hpc.cli import main

    assert main(["simulate", SMALL, "--modes", "sync,dora", "--no-plots", "--out", str(tmp_path / "out"),
                 "--run-dir", str(tmp_path / "runs")]) == 0
    for mode in ("sync", "dora"):
        assert main(["analyze", str(tmp_path / "runs" / mode), "--plots", str(tmp_path / f"plots-{mode}")]) == 0
        assert (tmp_path / f"plots-{mode}" / "timeline.png").is_file()


def test_a_simulated_run_is_never_written_over_another_runs_logs(tmp_path):
    from dora_hpc.cli import main

    args = ["simulate", SMALL, "--modes", "sync", "--no-plots", "--out", str(tmp_path / "out"),
            "--run-dir", str(tmp_path / "runs")]
    assert main(args) == 0
    assert main(args) == 2  # its shards would mix with the first run's


def test_a_simulated_lora_run_shares_instances_and_analyze_agrees(tmp_path):
    """train.lora in the simulator: versions are adapters every instance hosts; several run in one macro step,
    nothing migrates, a publish moves the adapter's bytes, the invariants hold, and analyze counts the same."""
    cfg = load_config(SMALL, ["train.lora={rank: 32}"])
    sim = Simulator(cfg, "dora", timeline=False).run()
    sim.write_logs(tmp_path / "lora")
    s, a = summarize(sim), analyze(tmp_path / "lora")
    full = summarize(Simulator(load_config(SMALL), "dora", timeline=False).run())
    assert s["migrations"] == a["migrations"] == 0 < full["migrations"]
    assert s["multi_version_batches"] == a["multi_version_batches"] > 0
    for k in ("lost_groups", "duplicate_groups", "split_groups", "staleness_over_k", "mixed_version_trajectories"):
        assert s[k] == a["invariants"][k] == 0, k
    sent = s["weights"]["publish_gb_per_step_per_trainer_rank"] * 1e9 * s["steps"] * s["train_accelerators"]
    adds = s["weight_syncs"] - s["rollout_instances"]  # every load after each instance's v0 from the folder
    assert sent == pytest.approx(adds * cfg.sim.model.adapter_bytes(32))  # an adapter a load, never the model
