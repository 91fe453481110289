"""``dora-hpc analyze RUN_DIR``: what a run did and whether it kept its invariants, from HDF5 alone.

Invariant: every figure here is computed from the run's complete shards (``*.h5``); nothing is
read from a live process or from the config beyond what the shards' attrs carry.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import h5py
import numpy as np

from ..store.shards import read_table, scan


def _config(run_dir: Path) -> dict:
    for p in sorted(Path(run_dir).glob("*.h5")):
        try:
            with h5py.File(p, "r") as f:
                return json.loads(f.attrs["config_json"])
        except (OSError, KeyError, ValueError):
            continue
    return {}


def analyze(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    scans = {k: scan(run_dir, k) for k in ("traj", "events", "train")}
    cfg = _config(run_dir)
    mode, k, g_size = cfg.get("mode"), cfg.get("dora", {}).get("k"), cfg.get("batch", {}).get("group_size", 1)
    traj = read_table(run_dir, "traj", "trajectories", scan_result=scans["traj"])
    consumed = read_table(run_dir, "train", "consumed", scan_result=scans["train"])
    tsteps = read_table(run_dir, "train", "steps", scan_result=scans["train"])
    ops = read_table(run_dir, "events", "ops", scan_result=scans["events"])
    esteps = read_table(run_dir, "events", "steps", scan_result=scans["events"])

    # trajectories: first segment = dispatch version; partial rollout may add segments
    first = {int(t): int(s[0]) if len(s) else int(v)
             for t, s, v in zip(traj["traj_id"], traj["segment_versions"], traj["version"], strict=True)}
    group_of = {int(t): int(g) for t, g in zip(traj["traj_id"], traj["group_id"], strict=True)}
    mixed = [int(t) for t, s in zip(traj["traj_id"], traj["segment_versions"], strict=True) if len(set(s)) > 1]
    by_group = defaultdict(set)
    for t, g in group_of.items():
        by_group[g].add(first[t])
    split = sorted(g for g, vs in by_group.items() if len(vs) > 1)

    # consumption: each group by one step, each of its trajectories once
    steps_of_group = defaultdict(set)
    traj_consumed = Counter(int(t) for t in consumed["traj_id"])
    for g, s in zip(consumed["group_id"], consumed["consume_step"], strict=True):
        steps_of_group[int(g)].add(int(s))
    dup = sorted({g for g, s in steps_of_group.items() if len(s) > 1}
                 | {group_of.get(t, -1) for t, c in traj_consumed.items() if c > 1})
    # staleness: consume step minus the oldest version that sampled any token of the trajectory
    min_seg = {int(t): int(min(s)) if len(s) else int(v)
               for t, s, v in zip(traj["traj_id"], traj["segment_versions"], traj["version"], strict=True)}
    stale = [int(s) - min_seg.get(int(t), int(v)) for t, s, v in
             zip(consumed["traj_id"], consumed["consume_step"], consumed["version"], strict=True)]
    bound = {"sync": 0, "oversample": 0, "one_step": 1, "dora": k}.get(mode)
    over_k = sorted({int(t) for t, s in zip(consumed["traj_id"], stale, strict=True)
                     if bound is not None and s > bound})

    dropped = {int(d.split()[0].split("=")[1]) for kind, d in zip(ops["kind"], ops["detail"], strict=True)
               if kind == "drop"}
    pending = set()
    for kind, d in zip(ops["kind"], ops["detail"], strict=True):
        if kind == "pending_at_end" and d:
            pending |= {int(x) for x in d.split(",")}
    rows_per_group = Counter(group_of.values())
    missing_rows = sorted(g for g in steps_of_group if rows_per_group[g] < g_size)
    lost = sorted(set(missing_rows) | (set(by_group) - set(steps_of_group) - dropped - pending))

    published = {int(st) + 1: str(c) for st, c in zip(tsteps["step"], tsteps["weights_checksum"], strict=True)}
    loads = [(int(v), str(d)) for kind, v, d in zip(ops["kind"], ops["version"], ops["detail"], strict=True)
             if kind == "weight_load"]
    mig = sum(1 for kind in ops["kind"] if kind == "migration_in")
    return {
        "run_dir": str(run_dir),
        "mode": mode,
        "k": k,
        "steps": int(len(tsteps["step"])),
        "trajectories": int(len(traj["traj_id"])),
        "consumed": int(len(consumed["traj_id"])),
        "invariants": {
            "mixed_version_trajectories": len(mixed) if mode != "partial" else 0,
            "staleness_over_k": len(over_k),
            "lost_groups": len(lost),
            "duplicate_groups": len(dup),
            "split_groups": len(split),
            "offenders": {"mixed_version_trajectories": mixed[:20] if mode != "partial" else [],
                          "staleness_over_k": over_k[:20], "lost_groups": lost[:20],
                          "duplicate_groups": dup[:20], "split_groups": split[:20]},
        },
        "staleness": {"max": max(stale, default=0), "mean": float(np.mean(stale)) if stale else 0.0,
                      "histogram": {str(s): c for s, c in sorted(Counter(stale).items())}},
        "partial_segments": {"trajectories_with_switches": len(mixed)} if mode == "partial" else {},
        "migrations": mig,
        "reprefill_tokens": int(np.sum(traj["reprefill_tokens"])) if len(traj["traj_id"]) else 0,
        "dropped_groups": len(dropped),
        "reward_errors": int(sum(1 for e in traj["reward_error"] if e)),
        "malformed_rows": int(sum(1 for kind in ops["kind"] if kind == "malformed_row")),
        "weights": {"published": len(published), "loads": len(loads),
                    "mismatched_loads": sum(1 for v, c in loads if v in published and c != published[v]),
                    "v0_checksums": len({c for v, c in loads if v == 0})},
        "max_live_versions": max_live_versions(esteps),
        "reward_by_step": [float(x) for x in tsteps["reward_mean"]],
        "shards": {k: {"files": len(s.files), "tmp_skipped": s.tmp_skipped, "bad": s.bad} for k, s in scans.items()},
    }


def max_live_versions(esteps: dict[str, np.ndarray], bucket_s: float = 0.25) -> int:
    """The most distinct versions generating within one time bucket, across all rollout ranks."""
    live = defaultdict(set)
    for t0, t1, v, n in zip(esteps["t_start"], esteps["t_end"], esteps["version"], esteps["batch_size"],
                            strict=True):
        if n > 0 and v >= 0:
            for b in range(int(t0 / bucket_s), int(t1 / bucket_s) + 1):
                live[b].add(int(v))
    return max((len(s) for s in live.values()), default=0)
