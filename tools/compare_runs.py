"""Are two runs the same run? Compare their HDF5 logs: every trajectory (id, group, version, response,
logprobs, reward) and every train step (loss, reward, clip fraction, tokens), exactly.

    python tools/compare_runs.py RUN_A RUN_B

A sync run's sampling noise depends only on (seed, request, position) and its trainer on the seed, so
the same config and seed give the same logs before and after a change that keeps behaviour (the
architecture issue checks its refactors this way). Exits 0 when equal, 1 naming the first difference.
"""

from __future__ import annotations

import sys

import numpy as np

from dora_hpc.store.shards import read_table

TRAJ = ["traj_id", "group_id", "version", "reward", "response", "logprobs"]
STEPS = ["step", "loss", "reward_mean", "clip_frac", "tokens", "weights_checksum"]


def rows(run: str, kind: str, table: str, cols: list[str], key: str) -> dict:
    t = read_table(run, kind, table, cols)
    order = np.argsort(t[key], kind="stable")
    return {c: [t[c][i] for i in order] for c in cols}


def drift(a: str, b: str) -> dict:
    """Where the runs differ, how much: per version, the trajectories whose responses differ, and the largest
    logprob difference over trajectories whose responses agree (same tokens, same weights: float noise)."""
    x, y = rows(a, "traj", "trajectories", TRAJ, "traj_id"), rows(b, "traj", "trajectories", TRAJ, "traj_id")
    out: dict = {}
    for i in range(min(len(x["traj_id"]), len(y["traj_id"]))):
        v = int(x["version"][i])
        d = out.setdefault(v, {"trajectories": 0, "tokens_differ": 0, "max_logprob_diff": 0.0})
        d["trajectories"] += 1
        if not np.array_equal(x["response"][i], y["response"][i]):
            d["tokens_differ"] += 1
        else:
            gap = float(np.max(np.abs(x["logprobs"][i] - y["logprobs"][i]), initial=0.0))
            d["max_logprob_diff"] = max(d["max_logprob_diff"], gap)
    return out


def compare(a: str, b: str) -> list[str]:
    diffs = []
    for kind, table, cols, key in (("traj", "trajectories", TRAJ, "traj_id"), ("train", "steps", STEPS, "step")):
        x, y = rows(a, kind, table, cols, key), rows(b, kind, table, cols, key)
        if len(x[key]) != len(y[key]):
            diffs.append(f"{table}: {len(x[key])} rows vs {len(y[key])}")
            continue
        for c in cols:
            bad = [i for i, (u, v) in enumerate(zip(x[c], y[c], strict=True))
                   if not np.array_equal(np.asarray(u), np.asarray(v))]
            if bad:
                diffs.append(f"{table}.{c}: {len(bad)} of {len(x[c])} rows differ (first: {key} {x[key][bad[0]]})")
    return diffs


if __name__ == "__main__":
    found = compare(sys.argv[1], sys.argv[2])
    for d in found:
        print(d)
    n = len(read_table(sys.argv[1], "traj", "trajectories", ["traj_id"])["traj_id"])
    print("the same run" if not found else "different runs", f"({n} trajectories compared)")
    if found:
        for v, d in sorted(drift(sys.argv[1], sys.argv[2]).items()):
            print(f"  v{v}: {d['tokens_differ']} of {d['trajectories']} trajectories' tokens differ; same tokens: "
                  f"max |logprob difference| {d['max_logprob_diff']:.2e}")
    sys.exit(1 if found else 0)
