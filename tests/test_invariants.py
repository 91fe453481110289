"""analyze finds every kind of broken invariant, naming the offenders, on a hand-built log with known
answers (the runtime tests only ever see logs where every count is 0)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dora_hpc.analysis.basic import analyze, instance_timeline
from dora_hpc.measure.invariants import groups_with_many, last_per_key
from dora_hpc.store.shards import ShardWriter

CONFIG = json.dumps({"mode": "dora", "dora": {"k": 1}, "batch": {"group_size": 2, "tbs": 2},
                     "cluster": {"trainer_ranks": 1, "rollout_ranks": 2}})  # rollout ranks 2 and 3


def build(run_dir):
    traj = ShardWriter(run_dir, "traj", 3, "rollout", "r", CONFIG, rows_per_shard=5)  # several shards
    train = ShardWriter(run_dir, "train", 1, "trainer", "r", CONFIG)
    ops = ShardWriter(run_dir, "events", 0, "orchestrator", "r", CONFIG)
    # (traj, group, version, segment_versions, consume_step or None, reward_error)
    rows = [(0, 0, 0, [0], 0, ""), (1, 0, 0, [0], 0, "ZeroDivisionError"),
            (2, 1, 0, [0], 1, ""), (3, 1, 1, [1], 1, ""),          # group 1 split over v0 and v1
            (4, 2, 0, [0], 2, ""), (5, 2, 0, [0], 2, ""),          # consumed at step 2 from v0: staleness 2 > K
            (6, 3, 1, [1, 2], 2, ""), (7, 3, 1, [1], 2, ""),       # traj 6 switched versions mid-way
            (8, 4, 2, [2], 2, ""), (9, 4, 2, [2], 3, ""),          # group 4 consumed by two steps
            (10, 5, 2, [2], None, ""), (11, 5, 2, [2], None, ""),  # group 5 never consumed: lost
            (12, 6, 2, [2], 3, ""), (13, 6, 2, [2], None, ""),     # group 6 half consumed: lost
            (15, 7, 3, [3], None, "")]                             # traj 14 (group 7) consumed, never stored
    traj.append("trajectories", {"traj_id": 0, "group_id": 0, "version": 0, "segment_versions": [0],
                                 "response_len": 99})  # an earlier row of traj 0: the last one read counts
    for t, g, v, seg, step, err in rows:
        traj.append("trajectories", {"traj_id": t, "group_id": g, "version": v, "segment_versions": seg,
                                     "response_len": 5, "reward_error": err, "reward": 1.0})
        if step is not None:
            train.append("consumed", {"traj_id": t, "group_id": g, "consume_step": step, "version": v,
                                      "staleness": step - v, "reward": 1.0, "traj_attempt": 0})
    train.append("consumed", {"traj_id": 14, "group_id": 7, "consume_step": 3, "version": 3, "traj_attempt": 0})
    for s in range(4):
        train.append("steps", {"step": s, "t_start": s, "t_end": s + 0.5, "tokens": 10, "weights_checksum": "x"})
    ops.append("ops", {"kind": "done", "detail": "next_group=8", "t_start": 9.0, "t_end": 9.0})
    for w in (traj, train, ops):
        w.flush()


def test_every_broken_invariant_is_counted_and_named(tmp_path):
    build(tmp_path)
    a = analyze(tmp_path)
    inv = a["invariants"]
    assert {k: v for k, v in inv.items() if k != "offenders"} == {
        "mixed_version_trajectories": 1, "staleness_over_k": 2, "lost_groups": 3, "duplicate_groups": 1,
        "split_groups": 1}
    assert inv["offenders"] == {"mixed_version_trajectories": [6], "staleness_over_k": [4, 5],
                                "lost_groups": [5, 6, 7], "duplicate_groups": [4], "split_groups": [1]}
    assert a["reward_errors"] == 1 and a["preemption"]["discarded_trajectories"] == 1
    assert a["staleness"]["histogram"] == {"0": 5, "1": 5, "2": 2}  # traj 6: step 2 - its oldest version 1
    assert a["stratified"]["median_length_by_staleness"]["0"] == 5.0  # the last row of traj 0, not the 99


def test_vectorised_helpers():
    g = np.array([3, 1, 3, 2, 1, 3])
    v = np.array([0, 5, 0, 7, 6, 0])
    assert groups_with_many(g, v).tolist() == [1]
    key, by = np.array([4, 4, 2, 4, 2]), np.array([0, 1, 0, 1, 0])
    assert sorted(last_per_key(key, by).tolist()) == [3, 4]  # ties on `by` go to the later row


def test_the_cli_says_which_shards_it_left_out(tmp_path, capsys):
    from dora_hpc.cli import main

    build(tmp_path)
    (tmp_path / "traj-r3-00009.h5.tmp").write_bytes(b"a shard being written")
    (tmp_path / "traj-r3-00008.h5").write_bytes(b"truncated")
    assert main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "partial logs, analysed without: skipped traj-r3-00008.h5 (unreadable HDF5" in out
    assert "1 unfinished traj-*.h5.tmp skipped; no traj shard from rollout rank 2; no events shard from " \
           "rollout ranks 2, 3" in out
    assert "lost_groups" in out  # the rest was still analysed
    assert analyze(tmp_path)["missing"][-2:] == ["no traj shard from rollout rank 2",
                                                 "no events shard from rollout ranks 2, 3"]


def _killed_before_its_first_step(run_dir):
    for kind in ("traj", "events"):
        w = ShardWriter(run_dir, kind, 2, "rollout", "r", CONFIG)
        w.append("trajectories" if kind == "traj" else "ops", {"traj_id": 0, "group_id": 0, "version": 0}
                 if kind == "traj" else {"kind": "weight_load", "version": 0})
        w.flush()
    (run_dir / "traj-r3-00000.h5.tmp").write_bytes(b"a shard being written when the job was killed")


@pytest.mark.parametrize("case", ["empty", "one corrupt shard", "killed before its first train step"])
def test_analyze_without_a_train_step_exits_2_on_one_line(tmp_path, case):
    if case == "one corrupt shard":
        (tmp_path / "train-00000.h5").write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    elif case != "empty":
        _killed_before_its_first_step(tmp_path)
    p = subprocess.run([sys.executable, "-m", "dora_hpc.cli", "analyze", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    line, = p.stderr.splitlines()  # one line, however long
    assert line.startswith(f"analyze: {tmp_path}: nothing to analyse: ")
    assert {"empty": "no HDF5 shard in it",
            "one corrupt shard": "shards read: 0 traj, 0 events, 0 train; skipped train-00000.h5 (unreadable HDF5",
            "killed before its first train step": "no train step logged (the run stopped before its first step, "
            "or no train shard is readable); shards read: 1 traj, 1 events, 0 train; 1 unfinished traj-*.h5.tmp "
            "skipped; no traj shard from rollout rank 3; no events shard from rollout rank 3"}[case] in line


def test_analyze_names_the_ranks_with_no_clean_exit_on_record(tmp_path):
    """A killed rank's rows since its last shard are gone: a rank whose pids/rank-N has no newer .done
    is named under `missing`, so a count that looks low (migrations, engine steps) is read as partial."""
    import os

    build(tmp_path)
    assert not any("clean exit" in m for m in analyze(tmp_path)["missing"])  # no pids/: nothing known
    pids = tmp_path / "pids"
    pids.mkdir()
    for r in range(4):
        (pids / f"rank-{r}").write_text(str(1000 + r))
    for r in (0, 1):
        (pids / f"rank-{r}.done").write_text("ok")
    (pids / "rank-3.done").write_text("ok")
    os.utime(pids / "rank-3.done", (1, 1))  # a .done of an earlier launch: older than this launch's pid file
    assert analyze(tmp_path)["missing"][-1] == ("no clean exit on record for ranks 2, 3 (still running, or killed): "
                                                "what they logged since the last shard is not here")
    for r in (2, 3):
        (pids / f"rank-{r}.done").write_text("ok")
    assert not any("clean exit" in m for m in analyze(tmp_path)["missing"])


def test_a_trainer_replicas_fence_is_no_instances_in_the_instance_timeline():
    """analyze's instance timeline counts rollout instances: a fenced trainer replica (``role=trainer``) leaves
    the count alone, a fenced rollout rank takes one away and its replacement gives it back."""
    rows = [("start", 0, 0.0, ""), ("fence", 2, 5.0, "cause=dead silent=0s role=trainer"),
            ("fence", 4, 6.0, "cause=dead silent=0s started_again=2"), ("join", 4, 9.0, "")]
    ops = {"kind": np.array([r[0] for r in rows]), "peer": np.array([r[1] for r in rows]),
           "attempt": np.zeros(len(rows), int), "t_end": np.array([r[2] for r in rows]),
           "detail": np.array([r[3] for r in rows])}
    got = instance_timeline(ops, 3)
    assert [(e["event"], e["rank"], e["instances"]) for e in got["timeline"]] == [
        ("start", None, 3), ("fence", 4, 2), ("join", 4, 3)]
    assert got["fewest"] == 2
