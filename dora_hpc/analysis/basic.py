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
from .history import history
from .staleness import stratified
from .utilization import utilization


def _config(run_dir: Path) -> dict:
    for p in sorted(Path(run_dir).glob("*.h5")):
        try:
            with h5py.File(p, "r") as f:
                return json.loads(f.attrs["config_json"])
        except (OSError, KeyError, ValueError):
            continue
    return {}


def analyze(run_dir: str | Path, plots: str | Path | None = None) -> dict:
    run_dir = Path(run_dir)
    scans = {k: scan(run_dir, k) for k in ("traj", "events", "train")}
    cfg = _config(run_dir)
    mode, k, g_size = cfg.get("mode"), cfg.get("dora", {}).get("k"), cfg.get("batch", {}).get("group_size", 1)
    traj = read_table(run_dir, "traj", "trajectories", scan_result=scans["traj"],  # never the token columns
                      columns=["traj_id", "group_id", "version", "segment_versions", "attempt", "response_len",
                               "reprefill_tokens", "reward_error"])
    consumed = read_table(run_dir, "train", "consumed", scan_result=scans["train"])
    tsteps = read_table(run_dir, "train", "steps", scan_result=scans["train"])
    ops = read_table(run_dir, "events", "ops", scan_result=scans["events"])
    esteps = read_table(run_dir, "events", "steps", scan_result=scans["events"], with_rank=True,
                        columns=["t_start", "t_end", "batch_size", "capacity", "version"])

    # a preempted and resumed run: keep only the rows its final history is made of (analysis/history.py)
    hist = history(ops)
    keep = hist.step_mask(consumed["attempt"], consumed["consume_step"])
    consumed = {c: v[keep] for c, v in consumed.items()}
    keep = hist.step_mask(tsteps["attempt"], tsteps["step"])
    all_tsteps = tsteps
    tsteps = {c: v[keep] for c, v in tsteps.items()}
    order = np.argsort(tsteps["step"], kind="stable")
    tsteps = {c: v[order] for c, v in tsteps.items()}

    # trajectories, keyed (traj_id, attempt): a re-dispatched one has a row per attempt that ran it
    row_of = {(int(t), int(a)): i for i, (t, a) in enumerate(zip(traj["traj_id"], traj["attempt"], strict=True))}
    first_v = [int(s[0]) if len(s) else int(v) for s, v in zip(traj["segment_versions"], traj["version"], strict=True)]
    min_v = [int(min(s)) if len(s) else int(v) for s, v in zip(traj["segment_versions"], traj["version"], strict=True)]
    mixed = [int(t) for t, s in zip(traj["traj_id"], traj["segment_versions"], strict=True) if len(set(s)) > 1]
    by_group = defaultdict(set)  # (group, attempt) -> dispatch versions of its rows
    for i, (g, a) in enumerate(zip(traj["group_id"], traj["attempt"], strict=True)):
        by_group[(int(g), int(a))].add(first_v[i])
    split = {g for (g, _a), vs in by_group.items() if len(vs) > 1}

    # consumption: each group by one step, each of its trajectories once
    steps_of_group = defaultdict(set)
    traj_consumed = Counter(int(t) for t in consumed["traj_id"])
    rows_consumed = Counter(int(g) for g in consumed["group_id"])
    for g, s in zip(consumed["group_id"], consumed["consume_step"], strict=True):
        steps_of_group[int(g)].add(int(s))
    dup = sorted({g for g, s in steps_of_group.items() if len(s) > 1}
                 | {int(t) // g_size for t, c in traj_consumed.items() if c > 1})
    # staleness: consume step minus the oldest version that sampled any token of the trajectory
    matched = [row_of.get((int(t), int(a))) for t, a in zip(consumed["traj_id"], consumed["traj_attempt"],
                                                              strict=True)]
    stale = [int(s) - (min_v[i] if i is not None else int(v)) for i, s, v in
             zip(matched, consumed["consume_step"], consumed["version"], strict=True)]
    consumed_versions = defaultdict(set)  # a group's tag: the first segment's version of each sample
    for g, i, v in zip(consumed["group_id"], matched, consumed["version"], strict=True):
        consumed_versions[int(g)].add(first_v[i] if i is not None else int(v))
    split = sorted(split | {g for g, vs in consumed_versions.items() if len(vs) > 1})
    bound = {"sync": 0, "oversample": 0, "one_step": 1, "dora": k}.get(mode)
    over_k = sorted({int(t) for t, s in zip(consumed["traj_id"], stale, strict=True)
                     if bound is not None and s > bound})

    dropped = {int(d.split()[0].split("=")[1]) for kind, d in zip(ops["kind"], ops["detail"], strict=True)
               if kind == "drop"} - set(steps_of_group)
    final = hist.chain[-1]
    pending, next_group = set(), None
    for kind, a, d in zip(ops["kind"], ops["attempt"], ops["detail"], strict=True):
        if int(a) != final:
            continue
        if kind == "pending_at_end" and d:
            pending |= {int(x) for x in d.split(",")}
        if kind in ("done", "preempted"):
            next_group = int(str(d).split("next_group=")[1])
    no_rows = {int(g) for g, i in zip(consumed["group_id"], matched, strict=True) if i is None}
    missing_rows = sorted(no_rows | {g for g, n in rows_consumed.items() if n < g_size})
    admitted = (set(range(next_group)) if next_group is not None
                else {g for (g, a) in by_group if a in hist.owns})
    lost = sorted(set(missing_rows) | (admitted - set(steps_of_group) - dropped - pending))
    live_rows = {i for i in matched if i is not None}
    latest_row: dict[int, tuple[int, int]] = {}
    for i, (t, a) in enumerate(zip(traj["traj_id"], traj["attempt"], strict=True)):
        if int(a) in hist.owns and int(t) not in traj_consumed:
            latest_row[int(t)] = max(latest_row.get(int(t), (-1, -1)), (int(a), i))
    live_rows |= {i for _a, i in latest_row.values()}
    discarded = len(traj["traj_id"]) - len(live_rows)

    published = {int(st) + 1: str(c) for st, c in zip(tsteps["step"], tsteps["weights_checksum"], strict=True)}
    by_attempt = {(int(a), int(st) + 1): str(c) for a, st, c in
                  zip(all_tsteps["attempt"], all_tsteps["step"], all_tsteps["weights_checksum"], strict=True)}
    loads = [(int(v), str(d), by_attempt.get((int(a), int(v)), published.get(int(v))))
             for kind, v, d, a in zip(ops["kind"], ops["version"], ops["detail"], ops["attempt"], strict=True)
             if kind == "weight_load"]
    is_mig = ops["kind"] == "migration_in"
    mig = int(is_mig.sum())
    mig_detail = {"count": mig, "kv_bytes": int(ops["bytes"][is_mig].sum()),
                  "seconds": float((ops["t_end"] - ops["t_start"])[is_mig].sum()),
                  "by_reprefill": int(sum(1 for d in ops["detail"][is_mig] if "reprefill=True" in str(d))),
                  "weight_syncs": int((ops["kind"] == "weight_load").sum())}
    result = {
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
                      "histogram": {str(s): c for s, c in sorted(Counter(stale).items())},
                      "by_version": {str(v): c for v, c in sorted(Counter(consumed["version"].tolist()).items())}},
        "stratified": stratified(np.array(stale, dtype=np.int64), consumed["reward"], consumed["group_id"],
                                 np.array([int(traj["response_len"][i]) if i is not None else 0 for i in matched])),
        "partial_segments": {"trajectories_with_switches": len(mixed)} if mode == "partial" else {},
        "migrations": mig,
        "migration": mig_detail,
        "reprefill_tokens": int(np.sum(traj["reprefill_tokens"])) if len(traj["traj_id"]) else 0,
        "dropped_groups": len(dropped),
        "reward_errors": int(sum(1 for e in traj["reward_error"] if e)),
        "malformed_rows": int(sum(1 for kind in ops["kind"] if kind == "malformed_row")),
        "weights": {"published": len(published), "loads": len(loads),
                    "mismatched_loads": sum(1 for _v, c, want in loads if want is not None and c != want),
                    "v0_checksums": len({c for v, c, _w in loads if v == 0})},
        "preemption": {"attempts": len(hist.starts), "chain": hist.chain,
                       "resumed_at_steps": [hist.starts[a] for a in hist.chain[1:]],
                       "redispatched_groups": int(sum(1 for kind, a in zip(ops["kind"], ops["attempt"], strict=True)
                                                      if kind == "discarded_by_preemption" and int(a) in hist.owns)),
                       "discarded_trajectories": int(discarded)},
        "max_live_versions": max_live_versions(esteps),
        **utilization(esteps, tsteps, ops, warmup_steps=1 if len(tsteps["step"]) > 1 else 0),
        "reward_by_step": [float(x) for x in tsteps["reward_mean"]],
        "shards": {k: {"files": len(s.files), "tmp_skipped": s.tmp_skipped, "bad": s.bad} for k, s in scans.items()},
    }
    if plots is not None:
        from .plots import write_plots

        result["plots"] = [str(p) for p in write_plots(Path(plots), esteps, tsteps, result)]
    return result


def max_live_versions(esteps: dict[str, np.ndarray], bucket_s: float = 0.25) -> int:
    """The most distinct versions generating within one time bucket, across all rollout ranks."""
    live = defaultdict(set)
    for t0, t1, v, n in zip(esteps["t_start"], esteps["t_end"], esteps["version"], esteps["batch_size"],
                            strict=True):
        if n > 0 and v >= 0:
            for b in range(int(t0 / bucket_s), int(t1 / bucket_s) + 1):
                live[b].add(int(v))
    return max((len(s) for s in live.values()), default=0)
