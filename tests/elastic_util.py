"""Checks of an elastic run (cluster.elastic), shared by the built-in and vLLM runtime tests."""

from dora_hpc.analysis.basic import analyze
from dora_hpc.store.shards import read_table


def check_elastic_run(run_dir, steps: int, trainers: int, dedicated: int, tbs: int = 4, group: int = 4) -> dict:
    """Every invariant holds; each borrowed instance generated and its trainer rank's shard has rows; each
    trainer rank slept (freeing more than 0 bytes) and woke; a borrowed instance never decodes while its
    trainer trains (rank 1 writes the train-steps rows, with its own times). Returns the analysis."""
    a = analyze(run_dir)
    inv = a["invariants"]
    assert a["steps"] == steps and a["consumed"] == steps * tbs * group
    assert not any(inv[k] for k in ("mixed_version_trajectories", "staleness_over_k", "lost_groups",
                                    "duplicate_groups", "split_groups")), inv
    assert a["weights"]["mismatched_loads"] == 0
    trajs = read_table(run_dir, "traj", "trajectories", ["instance_path"], with_rank=True)
    borrowed = {str(dedicated + j) for j in range(trainers)}
    served = {i for path in trajs["instance_path"] for i in path.split(">")} & borrowed
    assert served == borrowed  # each borrowed instance generated (some finished there, some moved off)
    assert set(trajs["rank"].tolist()) & set(range(1, 1 + trainers))  # a trainer rank's shard has rows
    ops = read_table(run_dir, "events", "ops", ["kind", "bytes"], with_rank=True)
    on_trainers = [k for r, k in zip(ops["rank"].tolist(), ops["kind"].tolist(), strict=True) if r <= trainers]
    assert on_trainers.count("sleep") >= trainers and "weight_load" in on_trainers  # each slept and woke
    freed = [b for k, b in zip(ops["kind"], ops["bytes"], strict=True) if k == "sleep"]
    assert freed and min(freed) > 0  # each sleep gave the engine's KV memory back
    esteps = read_table(run_dir, "events", "steps", ["t_start", "t_end", "batch_size"], with_rank=True)
    tsteps = read_table(run_dir, "train", "steps", ["t_start", "t_end"])
    train = list(zip(tsteps["t_start"], tsteps["t_end"], strict=True))
    decode = [(s, e) for q, s, e, n in zip(esteps["rank"], esteps["t_start"], esteps["t_end"], esteps["batch_size"],
                                          strict=True) if q == 1 and n > 0]
    assert len(train) == steps and decode
    assert not [(d, t) for d in decode for t in train if d[0] < t[1] and t[0] < d[1]]
    return a
