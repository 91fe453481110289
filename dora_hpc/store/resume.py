"""Re-reading a preempted run's trajectories: which complete groups the HDF5 shards still hold.

Invariant: a group counts as stored only if all G of its trajectories are in complete shards, written
by one attempt no later than the checkpoint's, under the group's tag in the checkpointed ledger; for a
trajectory written by several attempts (it was re-dispatched) the latest such attempt is the one that
counts. Anything else is re-dispatched by core/resume.py. Memory stays bounded by reading the id
columns first and the token columns only for the rows kept.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from ..core.ledger import GroupState, Ledger
from ..core.trajectory import Trajectory
from .shards import scan, stored_name


def stored_groups(run_dir: Path, ledger: Ledger, max_attempt: int) -> dict[int, list[Trajectory]]:
    """Complete groups of ``ledger`` whose trajectories the shards hold, each as its G records (by traj id,
    without their prompt)."""
    wanted = {g: rec.version for g, rec in ledger.groups.items() if rec.state is GroupState.COMPLETE}
    best: dict[int, tuple[int, Path, int]] = {}  # traj_id -> (attempt, file, row)
    found = scan(run_dir, "traj")
    for path in found.files:
        with h5py.File(path, "r") as f:
            t = f["trajectories"]
            ids, groups, versions, attempts = (t[c][()] for c in ("traj_id", "group_id", "version", "attempt"))
        for row in np.flatnonzero(np.isin(groups, list(wanted)) & (attempts <= max_attempt)):
            tid, a = int(ids[row]), int(attempts[row])
            if int(versions[row]) == wanted[int(groups[row])] and (tid not in best or a > best[tid][0]):
                best[tid] = (a, path, int(row))
    by_file: dict[Path, list[tuple[int, int]]] = {}
    for tid, (_a, path, row) in best.items():
        by_file.setdefault(path, []).append((row, tid))
    out: dict[int, list[Trajectory]] = {}
    for path, rows in by_file.items():
        rows.sort()
        idx = [r for r, _ in rows]
        with h5py.File(path, "r") as f:
            t = f["trajectories"]
            cols = {c: t[stored_name(t, "trajectories", c)][idx] for c in
                    ("traj_id", "group_id", "version", "attempt", "response", "logprobs", "reward")}
            flat = t["env_spans"][idx] if "env_spans" in t else [np.zeros(0, np.int32)] * len(idx)  # schema < 8
        for i in range(len(idx)):
            spans = tuple(zip(flat[i][::2].tolist(), flat[i][1::2].tolist(), strict=True))
            s = Trajectory(int(cols["traj_id"][i]), int(cols["group_id"][i]), int(cols["version"][i]), [],
                           cols["response"][i].tolist(), cols["logprobs"][i].tolist(), float(cols["reward"][i]),
                           int(cols["attempt"][i]), spans)  # its prompt is the task's: the orchestrator adds it
            out.setdefault(s.group_id, []).append(s)
    whole = {}
    for g, trajs in out.items():
        trajs.sort(key=lambda s: s.traj_id)
        if len(trajs) == ledger.group_size and len({s.attempt for s in trajs}) == 1:
            whole[g] = trajs
    return whole
