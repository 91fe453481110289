"""``dora-hpc bench analysis``: how long ``analyze`` takes on a large synthetic run log.

The log is what a DORA run with K=2 would write: groups of 4 tagged with versions up to 2 steps old,
16 groups a step, trajectories spread over 4 rollout ranks, every group consumed exactly once, engine
steps and ops alongside, shards of ``rows_per_shard`` rows. Columns are written whole (vectorised),
in the same schema as the runtime's ShardWriter, so the timing is that of reading and analysing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import h5py
import numpy as np

from ..store.shards import FILE_KINDS, SCHEMA_VERSION, _column, _default, _dtype

G, TBS, RANKS, K = 4, 16, (2, 3, 4, 5), 2


def _write(path: Path, kind: str, rank: int, tables: dict[str, dict[str, np.ndarray]], n: dict[str, int]) -> None:
    config = json.dumps({"mode": "dora", "dora": {"k": K}, "batch": {"group_size": G, "tbs": TBS}})
    with h5py.File(path, "w") as f:
        f.attrs.update({"schema_version": SCHEMA_VERSION, "run_id": "synthetic", "rank": rank,
                        "role": "rollout" if kind != "train" else "trainer", "config_json": config, "attempt": 0})
        for table, schema in FILE_KINDS[kind].items():
            g = f.create_group(table)
            cols = tables.get(table, {})
            for col, ck in schema.items():
                data = cols.get(col)
                if data is None:
                    data = _column(ck, [_default(ck)] * n.get(table, 0))
                g.create_dataset(col, data=data, dtype=_dtype(ck))


def synthetic_run(run_dir: Path, trajectories: int, rows_per_shard: int = 100_000, seed: int = 0) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    groups = trajectories // G
    steps = groups // TBS
    n = steps * TBS * G
    traj_id = np.arange(n)
    group = traj_id // G
    consume = group // TBS
    version = np.maximum(0, consume - rng.integers(0, K + 1, size=groups)[group])
    resp = np.clip(rng.lognormal(3.0, 1.0, size=n).astype(np.int64), 1, 4096)
    reward = rng.random(n)
    rank = np.array(RANKS)[rng.integers(0, len(RANKS), size=n)]
    for r in RANKS:
        idx = np.flatnonzero(rank == r)
        for s, lo in enumerate(range(0, len(idx), rows_per_shard)):
            sl = idx[lo:lo + rows_per_shard]
            cols = {"traj_id": traj_id[sl], "group_id": group[sl], "version": version[sl],
                    "response_len": resp[sl], "reward": reward[sl], "attempt": np.zeros(len(sl), np.int64),
                    "reprefill_tokens": np.zeros(len(sl), np.int64),
                    "segment_versions": _column("vlen_i4", [[v] for v in version[sl].tolist()])}
            _write(run_dir / f"traj-r{r}-{s:05d}.h5", "traj", r, {"trajectories": cols}, {"trajectories": len(sl)})
        t = np.sort(rng.random(max(1, len(idx) // 8)) * steps * 10.0)
        est = {"t_start": t, "t_end": t + 0.05, "batch_size": rng.integers(1, 9, size=len(t)),
               "capacity": np.full(len(t), 8), "version": np.minimum(steps - 1, (t // 10).astype(np.int64)),
               "attempt": np.zeros(len(t), np.int64)}
        _write(run_dir / f"events-r{r}-00000.h5", "events", r, {"steps": est}, {"steps": len(t), "ops": 0})
    t_end = (np.arange(steps) + 1) * 10.0
    consumed = {"traj_id": traj_id, "group_id": group, "consume_step": consume, "version": version,
                "staleness": consume - version, "reward": reward, "advantage": np.zeros(n),
                "attempt": np.zeros(n, np.int64), "traj_attempt": np.zeros(n, np.int64)}
    tsteps = {"step": np.arange(steps), "t_start": t_end - 1.0, "t_end": t_end, "tokens": np.full(steps, 1000),
              "reward_mean": np.full(steps, 0.5), "attempt": np.zeros(steps, np.int64),
              "weights_checksum": _column("str", [f"c{s}" for s in range(steps)])}
    _write(run_dir / "train-00000.h5", "train", 1, {"consumed": consumed, "steps": tsteps},
           {"consumed": n, "steps": steps})
    ops = {"kind": _column("str", ["start", "done"]), "version": np.array([0, steps]),
           "detail": _column("str", ["fresh", f"next_group={steps * TBS}"]), "t_start": np.zeros(2),
           "t_end": np.zeros(2), "attempt": np.zeros(2, np.int64)}
    _write(run_dir / "events-r0-00000.h5", "events", 0, {"ops": ops}, {"ops": 2, "steps": 0})
    return {"trajectories": n, "steps": steps}


ANALYZE_ONLY = """
import json, resource, sys, time
from dora_hpc.analysis.basic import analyze
t = time.perf_counter()
a = analyze(sys.argv[1])
print(json.dumps({"analyze_s": time.perf_counter() - t, "peak_rss_mib": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "invariants": {k: v for k, v in a["invariants"].items()
    if k != "offenders"}, "consumed": a["consumed"], "max_staleness": a["staleness"]["max"]}))
"""


def bench_analysis(out: Path, trajectories: int, work_dir: Path) -> dict:
    """Generate the log here, then time ``analyze`` in a fresh process: its peak RSS is analyze's own."""
    import subprocess
    import sys

    t = time.perf_counter()
    made = synthetic_run(work_dir, trajectories)
    gen_s = time.perf_counter() - t
    p = subprocess.run([sys.executable, "-c", ANALYZE_ONLY, str(work_dir)], capture_output=True, text=True,
                       check=True)
    measured = json.loads(p.stdout.strip().splitlines()[-1])
    summary = {**made, "generate_s": gen_s, **measured,
               "rss_bytes_per_trajectory": measured["peak_rss_mib"] * 2**20 / max(made["trajectories"], 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
