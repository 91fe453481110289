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
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                 "staleness_over_k", "mixed_version_trajectories"))
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
    # the logs hold what completed: migrations that arrived, loads that finished, finished trajectories' re-prefill
    assert a["migrations"] == s["migrations"] + sim.counts["restores"] - len(sim.log.moving)  # restores: as the runtime
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
