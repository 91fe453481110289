import h5py
import numpy as np
import pytest

from dora_hpc.store.shards import SCHEMA_VERSION, ShardError, ShardWriter, read_table, scan, stored_name


def writer(tmp_path, **kw):
    return ShardWriter(tmp_path, "traj", rank=3, role="rollout", run_id="r1", config_json='{"seed": 0}', **kw)


def test_rows_round_trip_with_vlen_columns_and_rotation(tmp_path):
    w = writer(tmp_path, rows_per_shard=3)
    for i in range(7):
        w.append("trajectories", {"traj_id": i, "version": i % 2, "response": list(range(i)),
                                  "logprobs": [-0.5] * i, "finish_reason": "stop", "reward": 1.0 * i})
    w.flush()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["traj-r3-00000.h5", "traj-r3-00001.h5", "traj-r3-00002.h5"]
    t = read_table(tmp_path, "traj", "trajectories")
    assert t["traj_id"].tolist() == list(range(7))
    assert [len(x) for x in t["response"]] == list(range(7)) and t["response"][4].tolist() == [0, 1, 2, 3]
    assert t["logprobs"][3].dtype == np.float32 and t["finish_reason"][6] == "stop"
    assert t["n_migrations"][0] == -1  # unset columns get their documented default
    with h5py.File(tmp_path / "traj-r3-00000.h5") as f:
        assert dict(f.attrs) == {"schema_version": SCHEMA_VERSION, "run_id": "r1", "rank": 3, "role": "rollout",
                                 "config_json": '{"seed": 0}', "attempt": 0}
    assert t["attempt"].tolist() == [0] * 7  # every row says which launch wrote it
    # a new writer (after a restart) continues the numbering instead of overwriting
    assert writer(tmp_path).seq == 3


def test_readers_skip_tmp_corrupt_and_foreign_schema_naming_the_file(tmp_path):
    w = writer(tmp_path)
    w.append("trajectories", {"traj_id": 1})
    w.flush()
    (tmp_path / "traj-r3-00001.h5.tmp").write_bytes(b"half a file")
    (tmp_path / "traj-r3-00002.h5").write_bytes(b"garbage")
    w2 = ShardWriter(tmp_path, "traj", rank=4, role="rollout", run_id="r1")
    w2.append("trajectories", {"traj_id": 2})
    p = w2.flush()
    with h5py.File(p, "a") as f:
        f.attrs["schema_version"] = 99
    with pytest.warns(UserWarning, match="traj-r3-00002.h5"):
        found = scan(tmp_path, "traj")
    assert found.tmp_skipped == 1 and len(found.files) == 1
    assert "schema_version 99" in found.bad[str(p)]
    assert read_table(tmp_path, "traj", "trajectories", ["traj_id"], found)["traj_id"].tolist() == [1]
    with pytest.raises(ShardError, match="does not exist"):
        scan(tmp_path / "missing", "traj")


def test_unknown_columns_are_refused(tmp_path):
    with pytest.raises(KeyError, match="trajectory_id"):
        writer(tmp_path).append("trajectories", {"trajectory_id": 1})


def test_a_version_2_train_shard_reads_its_newer_columns_as_defaults(tmp_path):
    """Schema 3 added logprob_gap/gap_tokens to the train steps; a run logged before (or a resumed run
    whose first launch was) still reads, the missing columns as their defaults."""
    w = ShardWriter(tmp_path, "train", rank=1, role="trainer", run_id="r1")
    w.append("steps", {"step": 0, "loss": 0.5, "logprob_gap": 1e-6, "gap_tokens": 40})
    p = w.flush()
    with h5py.File(p, "a") as f:
        f.attrs["schema_version"] = 2
        del f["steps"]["logprob_gap"], f["steps"]["gap_tokens"]
    w.append("steps", {"step": 1, "loss": 0.25, "logprob_gap": 2e-6, "gap_tokens": 30})
    w.flush()
    t = read_table(tmp_path, "train", "steps")
    assert t["step"].tolist() == [0, 1] and t["loss"].tolist() == [0.5, 0.25]
    assert np.isnan(t["logprob_gap"][0]) and t["logprob_gap"][1] == 2e-6
    assert t["gap_tokens"].tolist() == [-1, 30]


def test_older_trajectory_shards_read_their_columns_under_the_new_names(tmp_path):
    """Schema 5 renamed dispatch_step (it holds a version) to dispatch_version and dropped prompt_id and
    t_first_token; schema 6 renamed tokens to response. A shard written before reads its old columns
    under the new names (read_table, and resume's direct reads through stored_name), and the dropped
    ones are never asked for."""
    w = ShardWriter(tmp_path, "traj", rank=2, role="rollout", run_id="r1")
    w.append("trajectories", {"traj_id": 0, "group_id": 0, "version": 1, "dispatch_version": 1, "response": [5, 6]})
    p = w.flush()
    with h5py.File(p, "a") as f:  # as schema 4 wrote it
        f.attrs["schema_version"] = 4
        g = f["trajectories"]
        g["dispatch_step"] = g["dispatch_version"][()]
        g["tokens"] = g["response"][()]
        del g["dispatch_version"], g["response"]
        g["prompt_id"], g["t_first_token"] = g["group_id"][()], np.full(1, np.nan)
        assert stored_name(g, "trajectories", "response") == "tokens"
    w.append("trajectories", {"traj_id": 1, "group_id": 0, "version": 1, "dispatch_version": 0, "response": [7]})
    p6 = w.flush()
    with h5py.File(p6) as f:
        assert stored_name(f["trajectories"], "trajectories", "response") == "response"
    t = read_table(tmp_path, "traj", "trajectories")
    assert t["dispatch_version"].tolist() == [1, 0] and "prompt_id" not in t and "t_first_token" not in t
    assert [x.tolist() for x in t["response"]] == [[5, 6], [7]] and "tokens" not in t


def test_episode_rows_come_back_on_resume_with_their_environment_spans_and_older_rows_without(tmp_path):
    """Schema 8: a multi-turn episode's row keeps where its environment tokens are; resume rebuilds the
    trainer's sample with them (masked out of the loss). A schema-7 row (single turn) reads as one turn
    with no environment tokens, in resume and in analyze's reader."""
    from dora_hpc.analysis.invariants import read_trajectories
    from dora_hpc.core.ledger import Ledger
    from dora_hpc.store.resume import stored_groups
    from dora_hpc.store.shards import scan

    ledger = Ledger(group_size=2)
    for _ in range(2):
        g = ledger.new_group(0)
        for t in ledger.traj_ids(g):
            ledger.finish(t)
    w = ShardWriter(tmp_path, "traj", rank=2, role="rollout", run_id="r1")
    for t, spans in ((0, [3, 5]), (1, [2, 4, 6, 7])):  # group 0: episodes
        w.append("trajectories", {"traj_id": t, "group_id": 0, "version": 0, "response": list(range(9)),
                                  "logprobs": [-1.0] * 9, "reward": 0.5, "turns": len(spans) // 2 + 1,
                                  "env_spans": spans, "env_s": 0.25, "env_error": "", "segment_versions": [0]})
    w.flush()
    w.append("trajectories", {"traj_id": 2, "group_id": 1, "version": 0, "response": [4, 5], "logprobs": [-1.0] * 2,
                              "reward": 1.0, "segment_versions": [0]})
    w.append("trajectories", {"traj_id": 3, "group_id": 1, "version": 0, "response": [6], "logprobs": [-1.0],
                              "reward": 0.0, "segment_versions": [0]})
    p7 = w.flush()
    with h5py.File(p7, "a") as f:  # as schema 7 wrote it: no episode columns
        f.attrs["schema_version"] = 7
        for c in ("turns", "env_spans", "env_s", "env_error", "env_prefill_tokens", "env_reruns", "segment_turns"):
            del f["trajectories"][c]
    got = stored_groups(tmp_path, ledger, max_attempt=0)
    assert [s.env_spans for s in got[0]] == [((3, 5),), ((2, 4), (6, 7))]
    assert got[0][1].model_tokens == 9 - 3 and got[0][1].model_mask()[2:4] == [0.0, 0.0]
    assert [s.env_spans for s in got[1]] == [(), ()]
    t = read_trajectories(scan(tmp_path, "traj"))
    assert t["turns"].tolist() == [2, 3, 1, 1] and t["env_s"].tolist() == [0.25, 0.25, 0.0, 0.0]
    assert t["env_error"].tolist() == [0, 0, 0, 0]


def test_rows_several_replicas_logged_are_read_once_and_the_first_kept():
    """store/shards.py first_of_each: the first row of each key tuple, in order, as a full comparison finds it;
    None (nothing to drop) when the last key alone is unique."""
    from dora_hpc.store.shards import first_of_each

    keys = ("attempt", "consume_step", "traj_attempt", "traj_id")
    rng = np.random.default_rng(0)
    for _ in range(5):
        rows = {k: rng.integers(0, 3, 400) for k in keys}
        _, first = np.unique(np.stack([rows[k] for k in keys], axis=1), axis=0, return_index=True)
        assert first_of_each(rows, keys).tolist() == sorted(first.tolist())
    assert first_of_each({k: np.arange(10) for k in keys}, keys) is None
