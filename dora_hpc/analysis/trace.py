"""``dora-hpc analyze RUN --trace trace.json``: a run's logs as a Chrome/Perfetto trace (ui.perfetto.dev).

What it holds (the Trace Event Format's JSON; times in microseconds of run time, real or simulated):
* process "rollout instances": one thread per rollout rank. Its engine steps run as slices named by the version
  they generated under (``v7``: Perfetto colours a name alike everywhere); consecutive steps of one version with
  no gap longer than ``MERGE_GAP_S`` are one slice, their count, tokens and mean running batch in its args. Its
  ops (weight loads, migrations in and out, offloads, sleeps, cache moves) are async slices beside it, so
  overlapping transfers stay apart;
* process "trainer": its train steps, and its waits named by what they waited for (``wait: window``,
  ``wait: tail``, ``wait: capacity``), on one thread; each window and tail wait's gating requests
  (measure/gate.py) are marked by the last of them to finish, an instant event with their count;
* process "orchestrator": instant events for publishes, checkpoints, fences, joins and starts.

Coalescing keeps a 4,096-accelerator simulation's trace to a few slices per instance and version.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..measure.gate import gating

MERGE_GAP_S = 0.05  # engine steps of one version this close are one slice
ROLLOUT_OPS = ("weight_load", "weight_send", "migration_in", "migration_out", "migration_lost", "offload", "sleep",
               "free_cache")
MARKS = ("publish", "checkpoint", "fence", "join", "start", "hung", "done", "preempted")
PID = {"orchestrator": 0, "trainer": 1, "rollout": 2}


def _us(t: float) -> float:
    return round(float(t) * 1e6, 1)


def engine_slices(esteps: dict) -> list[dict]:
    """Each rank's engine steps with a batch, merged into one slice per run of a version (module docstring)."""
    out = []
    busy = (esteps["batch_size"] > 0) & (esteps["t_end"] >= esteps["t_start"])
    for r in np.unique(esteps["rank"][busy]).tolist():
        m = busy & (esteps["rank"] == r)
        o = np.argsort(esteps["t_start"][m], kind="stable")
        t0, t1 = esteps["t_start"][m][o], esteps["t_end"][m][o]
        ver, run, new = esteps["version"][m][o], esteps["running"][m][o], esteps["new_tokens"][m][o]
        cut = np.flatnonzero((np.diff(ver) != 0) | (t0[1:] - t1[:-1] > MERGE_GAP_S)) + 1
        for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, len(t0)].tolist(), strict=True):
            out.append({"ph": "X", "pid": PID["rollout"], "tid": int(r), "name": f"v{int(ver[a])}", "cat": "engine",
                        "ts": _us(t0[a]), "dur": _us(t1[b - 1] - t0[a]),
                        "args": {"engine_steps": b - a, "new_tokens": int(new[a:b].clip(min=0).sum()),
                                 "running_mean": round(float(run[a:b].clip(min=0).mean()), 2)}})
    return out


def op_slices(ops: dict, ranks: dict) -> list[dict]:
    """Rollout ranks' ops as async slices; rank 0's marks as instant events."""
    out = []
    for n, (kind, rank, a, b, t, peer, v, d) in enumerate(zip(
            ops["kind"].tolist(), ranks.tolist(), ops["t_start"].tolist(), ops["t_end"].tolist(),
            ops["traj_id"].tolist(), ops["peer"].tolist(), ops["version"].tolist(), ops["detail"].tolist(),
            strict=True)):
        args = {k: x for k, x in (("traj_id", t), ("peer", peer), ("version", v)) if x >= 0} | (
            {"detail": str(d)} if d else {})
        if kind in ROLLOUT_OPS and rank != 0:
            name = f"{kind} v{v}" if kind == "weight_load" else kind
            base = {"pid": PID["rollout"], "tid": int(rank), "cat": "op", "name": name, "id": n}
            out += [base | {"ph": "b", "ts": _us(a), "args": args}, base | {"ph": "e", "ts": _us(max(a, b))}]
        elif kind in MARKS and rank == 0:
            out.append({"ph": "i", "s": "p", "pid": PID["orchestrator"], "tid": 0, "name": f"{kind} v{v}"
                        if kind == "publish" else kind, "ts": _us(b), "args": args})
    return out


def trainer_slices(tsteps: dict, ops: dict, consumed: dict, finished: dict) -> list[dict]:
    """Train steps, the trainer's waits, and each wait's last gating request."""
    tid = 1
    out = [{"ph": "X", "pid": PID["trainer"], "tid": tid, "name": f"train step {int(s)}", "cat": "train",
            "ts": _us(a), "dur": _us(b - a), "args": {"tokens": int(k)}}
           for s, a, b, k in zip(tsteps["step"].tolist(), tsteps["t_start"].tolist(), tsteps["t_end"].tolist(),
                                 tsteps["tokens"].tolist(), strict=True)]
    waits = (ops["kind"] == "trainer_wait") & (ops["t_end"] > ops["t_start"])
    out += [{"ph": "X", "pid": PID["trainer"], "tid": tid, "name": f"wait: {d}", "cat": "wait", "ts": _us(a),
             "dur": _us(b - a)} for a, b, d in zip(ops["t_start"][waits].tolist(), ops["t_end"][waits].tolist(),
                                                   ops["detail"][waits].tolist(), strict=True)]
    for kind, found in gating(ops, tsteps, consumed, finished).items():
        for _a, _b, held in found:
            if held:
                t, f, r = max(held, key=lambda x: x[1])
                out.append({"ph": "i", "s": "t", "pid": PID["trainer"], "tid": tid, "cat": "gating",
                            "name": f"last gating request ({kind})", "ts": _us(f),
                            "args": {"traj_id": int(t), "rank": int(r), "gating_requests": len(held)}})
    return out


def names(ranks: list[int], instance_of: dict[int, int]) -> list[dict]:
    meta = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": n}} for n, pid in
            (("orchestrator (rank 0)", PID["orchestrator"]), ("trainer", PID["trainer"]),
             ("rollout instances", PID["rollout"]))]
    meta += [{"ph": "M", "pid": PID["trainer"], "tid": 1, "name": "thread_name", "args": {"name": "train steps"}}]
    meta += [{"ph": "M", "pid": PID["rollout"], "tid": r, "name": "thread_name",
              "args": {"name": f"rank {r}" + (f" (instance {instance_of[r]})" if r in instance_of else "")}}
             for r in ranks]
    meta += [{"ph": "M", "pid": PID["rollout"], "tid": r, "name": "thread_sort_index", "args": {"sort_index": r}}
             for r in ranks]
    return meta


def write_trace(out: Path, esteps: dict, ops: dict, tsteps: dict, consumed: dict, finished: dict,
                first_rollout_rank: int) -> dict:
    """The trace of one run into ``out``; returns its counts by category. ``ops`` carries ``rank``."""
    events = engine_slices(esteps) + op_slices(ops, ops["rank"]) + trainer_slices(tsteps, ops, consumed, finished)
    ranks = sorted({int(r) for r in esteps["rank"].tolist()} | {int(e["tid"]) for e in events
                                                                if e["pid"] == PID["rollout"]})
    events = names(ranks, {r: r - first_rollout_rank for r in ranks if r >= first_rollout_rank}) + events
    Path(out).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")))
    counts: dict[str, int] = {}
    for e in events:
        counts[e.get("cat", "meta")] = counts.get(e.get("cat", "meta"), 0) + (e["ph"] != "e")
    return counts
