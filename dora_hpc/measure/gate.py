"""The requests an idle trainer waits for, and how they decode while it waits (``window_gate``, ``tail_gate``).

A wait is a ``trainer_wait`` op of one kind (``window``: TBS groups complete, the staleness window needs older ones;
``tail``: nothing queued, the batch's last requests decoding). The step that starts first after it is the one it
held back. Its **gating requests** are the trajectories that step consumes and that finished inside the wait: the
step could not start before the last of them. Over every wait of the kind:

* ``waits``, ``wait_s``: how many, and their seconds;
* ``gating_requests``: gating requests per wait, mean;
* ``explained``: the share of the waits' seconds until their last gating request finished (the rest is the
  trainer hearing of it and starting);
* ``decode_step_s``, ``batch``: over the engine steps that the rank where each gating request finished took from
  the wait's start to that finish, one entry per (request, step): the mean step's seconds (a decoding request's
  seconds per token) and the mean running batch beside it. A sync run's ``tail_gate`` is the reference a DORA run's
  ``window_gate`` compares with: the same requests in the same place in the batch.

Pure: arrays in, figures out (numpy). None when the run has no wait of the kind.
"""

from __future__ import annotations

import numpy as np


def gating(ops: dict, tsteps: dict, consumed: dict, finished: dict) -> dict[str, list[tuple]]:
    """For each kind (``window``, ``tail``), each wait as ``(start, end, held)``: ``held`` is None when the run
    ended while it waited, else its gating requests as ``(traj_id, t_finish, rank)``. Arguments as
    ``gate_figures``'."""
    order = np.argsort(tsteps["t_start"])
    step_t, step_n = tsteps["t_start"][order].astype(float), tsteps["step"][order]
    fin_of = dict(zip(finished["traj_id"].tolist(), zip(finished["t_finish"].tolist(), finished["rank"].tolist(),
                                                         strict=True), strict=True))
    by_step: dict[int, list[int]] = {}
    for t, s in zip(consumed["traj_id"].tolist(), consumed["consume_step"].tolist(), strict=True):
        by_step.setdefault(int(s), []).append(int(t))
    waits = (ops["kind"] == "trainer_wait") & (ops["t_end"] > ops["t_start"])
    detail = ops["detail"].astype(str)
    out: dict[str, list[tuple]] = {}
    for kind in ("window", "tail"):
        m = waits & (detail == kind)
        out[kind] = []
        for a, b in zip(ops["t_start"][m].astype(float).tolist(), ops["t_end"][m].astype(float).tolist(), strict=True):
            i = int(np.searchsorted(step_t, b - 1e-6))
            held = None if i == len(step_t) else [
                (t, *fin_of[t]) for t in by_step.get(int(step_n[i]), []) if t in fin_of and a < fin_of[t][0] <= b]
            out[kind].append((a, b, held))
    return out


def gate_figures(ops: dict, tsteps: dict, consumed: dict, finished: dict, esteps: dict) -> dict[str, dict | None]:
    """``window_gate`` and ``tail_gate``. ``finished``: trajectories with ``traj_id``, ``t_finish`` and ``rank`` (the
    rank that wrote the row, where the request finished; read_trajectories' columns); ``esteps``: engine steps with
    ``rank``, ``t_start``, ``t_end`` and ``running``."""
    steps = _steps_by_rank(esteps)
    found = gating(ops, tsteps, consumed, finished)
    return {f"{kind}_gate": _gate(waits, steps) if len(tsteps["t_start"]) else None for kind, waits in found.items()}


def _gate(waits: list[tuple], steps: dict) -> dict | None:
    """The figures of one kind's waits (``gating``; module docstring); None when there is none."""
    if not waits:
        return None
    n_gating, covered, step_s, batch = [], 0.0, [], []
    for a, _b, held in waits:
        if held is None:
            continue  # the run ended while it waited
        n_gating.append(len(held))
        if held:
            covered += max(f for _t, f, _r in held) - a
        for _t, f, r in held:
            t0, t1, run = steps.get(int(r), _EMPTY)
            lo, hi = np.searchsorted(t0, a), np.searchsorted(t0, f)
            step_s.append(t1[lo:hi] - t0[lo:hi])
            batch.append(run[lo:hi])
    total = float(sum(b - a for a, b, _ in waits))
    s, n = (np.concatenate(step_s), np.concatenate(batch)) if step_s else (np.zeros(0), np.zeros(0))
    return {"waits": len(waits), "wait_s": total,
            "gating_requests": float(np.mean(n_gating)) if n_gating else 0.0,
            "explained": covered / total if total else 0.0,
            "decode_step_s": float(s.mean()) if len(s) else None, "batch": float(n.mean()) if len(n) else None}


_EMPTY = (np.zeros(0), np.zeros(0), np.zeros(0))


def _steps_by_rank(esteps: dict) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each rank's engine steps with a running batch, by start: (t_start, t_end, running)."""
    out = {}
    busy = esteps["running"] > 0
    for r in np.unique(esteps["rank"][busy]):
        m = busy & (esteps["rank"] == r)
        o = np.argsort(esteps["t_start"][m])
        out[int(r)] = (esteps["t_start"][m][o].astype(float), esteps["t_end"][m][o].astype(float),
                       esteps["running"][m][o].astype(float))
    return out
