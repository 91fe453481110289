"""The run invariants (docs/invariants.md), checked on a run's tables, vectorised: a log of 10^6 trajectories costs a
few integers per row and a few seconds, never a Python object per row. ``analyze`` calls it on the files
(analysis/invariants.py reads the trajectory table) and the simulator on the tables it records (sim/logs.py).

Inputs are column dicts of numpy arrays: ``traj`` (one row per trajectory per attempt that ran it, with
``first_version``, ``min_version`` and ``switched`` reduced from its segment versions), ``consumed`` and ``ops``,
already cut to the run's effective history (measure/history.py). Invariant: a row joins its consumption by
(traj_id, attempt); when a trajectory has several rows of one attempt the last one read counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def fence_detail(detail: str) -> dict:
    """A ``fence`` op's detail (``cause=hung silent=12s started_again=8 unlogged=3,17``; a trainer replica's
    ``role=trainer``) as a dict."""
    f = dict(kv.split("=", 1) for kv in str(detail).split())
    return {"cause": f.get("cause", "hung"), "role": f.get("role", "rollout"),
            "silent_s": float(f.get("silent", "0").rstrip("s")),
            "started_again": int(f.get("started_again", 0)),
            "unlogged": [int(x) for x in f.get("unlogged", "").split(",") if x]}


def groups_with_many(group: np.ndarray, value: np.ndarray) -> np.ndarray:
    """The groups (sorted, unique) whose rows carry more than one distinct value."""
    if not len(group):
        return np.empty(0, np.int64)
    o = np.lexsort((value, group))
    g, v = group[o], value[o]
    new = np.ones(len(g), bool)
    new[1:] = (g[1:] != g[:-1]) | (v[1:] != v[:-1])
    ug, n = np.unique(g[new], return_counts=True)
    return ug[n > 1]


def joined(column: np.ndarray, matched: np.ndarray, fallback) -> np.ndarray:
    """``column`` of each consumed row's trajectory row (``matched``), ``fallback`` where none was stored."""
    if not len(column):
        return np.broadcast_to(np.asarray(fallback), matched.shape).copy()
    return np.where(matched >= 0, column[np.maximum(matched, 0)], fallback)


def last_per_key(key: np.ndarray, order_by: np.ndarray) -> np.ndarray:
    """Row indices: for each distinct key, the row with the largest (order_by, index)."""
    if not len(key):
        return np.empty(0, np.int64)
    o = np.lexsort((np.arange(len(key)), order_by, key))
    last = np.ones(len(o), bool)
    last[:-1] = key[o][1:] != key[o][:-1]
    return o[last]


@dataclass
class Checked:
    matched: np.ndarray      # per consumed row: its trajectory row, -1 when no row was stored
    stale: np.ndarray        # per consumed row: consume step - oldest version that sampled a token
    mixed: np.ndarray        # traj ids whose tokens come from more than one version
    over_k: np.ndarray       # traj ids consumed staler than the mode's bound
    lost: np.ndarray         # groups admitted but neither consumed, dropped nor pending
    duplicate: np.ndarray    # groups consumed by two steps, or holding a trajectory consumed twice
    split: np.ndarray        # groups whose samples carry more than one version tag
    dropped: np.ndarray      # groups oversampling dropped (and never consumed)
    filtered: np.ndarray     # groups dynamic sampling filtered (equal rewards; never consumed)
    discarded: int           # trajectory rows outside the run's history (thrown away by preemption)


def check(traj: dict, consumed: dict, ops: dict, owns: set[int], final_attempt: int, bound: int | None,
          g_size: int) -> Checked:
    n = len(traj["traj_id"])
    amax = int(max(traj["attempt"].max(initial=0), consumed["traj_attempt"].max(initial=0))) + 1
    tkey = traj["traj_id"] * amax + traj["attempt"]
    order = np.argsort(tkey, kind="stable")
    ckey = consumed["traj_id"] * amax + consumed["traj_attempt"]
    pos = np.searchsorted(tkey[order], ckey, side="right") - 1  # the last row of that (traj, attempt)
    hit = (pos >= 0) & (tkey[order][np.maximum(pos, 0)] == ckey) if n else np.zeros(len(ckey), bool)
    matched = np.where(hit, order[np.maximum(pos, 0)] if n else 0, -1)
    ok = matched >= 0

    c_group, c_step = consumed["group_id"], consumed["consume_step"]
    stale = c_step - joined(traj["min_version"], matched, consumed["version"])
    tag = joined(traj["first_version"], matched, consumed["version"])
    split = np.union1d(groups_with_many(traj["group_id"] * amax + traj["attempt"], traj["first_version"]) // amax,
                       groups_with_many(c_group, tag))
    t_ids, t_count = np.unique(consumed["traj_id"], return_counts=True)
    duplicate = np.union1d(groups_with_many(c_group, c_step), t_ids[t_count > 1] // g_size)
    over_k = np.unique(consumed["traj_id"][stale > bound]) if bound is not None else np.empty(0, np.int64)

    consumed_groups, rows_per_group = np.unique(c_group, return_counts=True)
    def groups_of(which: str) -> np.ndarray:  # "group=G ..." in the detail of each op of this kind
        return np.array([int(d.split()[0].split("=")[1]) for kind, d in zip(ops["kind"], ops["detail"], strict=True)
                         if kind == which], np.int64)

    dropped = np.setdiff1d(groups_of("drop"), consumed_groups)
    filtered = np.setdiff1d(groups_of("filter"), consumed_groups)
    pending, next_group = set(), None
    for kind, a, d in zip(ops["kind"], ops["attempt"], ops["detail"], strict=True):
        if int(a) != final_attempt:
            continue
        if kind == "pending_at_end" and d:
            pending |= {int(x) for x in d.split(",")}
        if kind in ("done", "preempted"):
            next_group = int(str(d).split("next_group=")[1])
    # a fenced rollout rank's rows since its last flush died with it (runtime/orchestrator.py: fence); the
    # trainer logged their consumption, so they are unlogged, not lost
    unlogged = {(t, int(a)) for kind, a, d in zip(ops["kind"], ops["attempt"], ops["detail"], strict=True)
                if kind == "fence" for t in fence_detail(d)["unlogged"]}
    excused = np.array([(int(t), int(a)) in unlogged for t, a in zip(consumed["traj_id"], consumed["traj_attempt"],
                                                                     strict=True)], bool).reshape(-1)
    missing_rows = np.union1d(c_group[~ok & ~excused], consumed_groups[rows_per_group < g_size])
    owned = np.isin(traj["attempt"], np.array(sorted(owns), np.int64))
    admitted = np.arange(next_group) if next_group is not None else np.unique(traj["group_id"][owned])
    not_done = np.setdiff1d(admitted, np.concatenate([consumed_groups, dropped, filtered,
                                                      np.array(sorted(pending), np.int64)]))
    lost = np.union1d(missing_rows, not_done)

    live = np.zeros(n, bool)
    live[matched[ok]] = True
    waiting = np.flatnonzero(owned & ~np.isin(traj["traj_id"], t_ids))  # never consumed: its latest row is live
    live[waiting[last_per_key(traj["traj_id"][waiting], traj["attempt"][waiting])]] = True
    return Checked(matched, stale, traj["traj_id"][traj["switched"]], over_k, lost, duplicate, split, dropped,
                   filtered, int(n - live.sum()))
