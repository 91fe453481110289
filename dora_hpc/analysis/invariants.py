"""A run's trajectory table read from its shards, in the columns the invariant check (measure/invariants.py) and
``analyze`` use: a few numbers per trajectory, whatever its lengths.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..store.shards import ShardScan, rank_of

TRAJ_COLUMNS = ["traj_id", "group_id", "version", "attempt", "prompt_len", "response_len", "reprefill_tokens", "turns"]
ENV_ERRORS = ("", "raised", "timed_out", "worker_died")  # env_error codes (episodes.py's error texts)


def env_error_code(text: str) -> int:
    if not text:
        return 0
    return 2 if "timed out" in text else 3 if "worker died" in text else 1


def read_trajectories(found: ShardScan) -> dict[str, np.ndarray]:
    """The trajectory columns analyze needs, shard by shard and never the token columns: each shard's
    vlen ``segment_versions`` is reduced at once to the first and lowest version and a switch flag, and
    ``reward_error`` to a flag and ``env_error`` to a code (ENV_ERRORS), so memory grows by a few numbers per
    trajectory whatever the lengths. ``lifetime`` is t_finish - t_dispatch; ``turns`` is 1 before schema 8; ``rank``
    is the rank that wrote the row (where the trajectory finished)."""
    parts: dict[str, list[np.ndarray]] = defaultdict(list)
    extra = ["segment_versions", "reward_error", "env_error", "env_s", "t_dispatch", "t_finish"]
    for path, shard in found.read("trajectories", TRAJ_COLUMNS + extra):
        seg = shard.pop("segment_versions")
        parts["has_error"].append(np.fromiter((bool(e) for e in shard.pop("reward_error")), bool, len(seg)))
        parts["env_error"].append(np.fromiter((env_error_code(str(e)) for e in shard.pop("env_error")), np.int64,
                                              len(seg)))
        parts["env_s"].append(np.nan_to_num(shard.pop("env_s").astype(np.float64)))
        parts["t_finish"].append(shard.pop("t_finish").astype(np.float64))
        parts["lifetime"].append(parts["t_finish"][-1] - shard.pop("t_dispatch").astype(np.float64))
        parts["rank"].append(np.full(len(seg), rank_of(path), np.int64))
        shard["turns"] = np.maximum(shard["turns"], 1)  # -1: a shard before episodes (schema < 8)
        version = shard["version"].astype(np.int64)
        lens = np.fromiter((len(s) for s in seg), np.int64, len(seg))
        first, low, switched = version.copy(), version.copy(), np.zeros(len(seg), bool)
        has = lens > 0
        if has.any():
            flat = np.concatenate([np.asarray(s, np.int64) for s in seg[has]])
            starts = np.concatenate([[0], np.cumsum(lens[has])[:-1]])
            first[has] = flat[starts]
            low[has] = np.minimum.reduceat(flat, starts)
            switched[has] = low[has] != np.maximum.reduceat(flat, starts)
        for name, col in (("first_version", first), ("min_version", low), ("switched", switched)):
            parts[name].append(col)
        for c in TRAJ_COLUMNS:
            parts[c].append(shard[c].astype(np.int64))
    names = TRAJ_COLUMNS + ["first_version", "min_version", "switched", "has_error", "env_error", "env_s", "lifetime",
                            "t_finish", "rank"]
    empty = {"switched": bool, "has_error": bool, "env_s": np.float64, "lifetime": np.float64, "t_finish": np.float64}
    return {c: np.concatenate(parts[c]) if parts[c] else np.empty(0, empty.get(c, np.int64)) for c in names}
