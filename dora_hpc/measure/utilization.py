"""Bubbles and utilization of a run (real, or simulated: sim/logs.py), from its engine-step and train-step logs.

The definitions are the simulator's (sim/metrics.py), applied to measured intervals:
* window: from the first engine step to the end of the last train step (``warmup_steps`` > 0 starts
  it at the end of train step ``warmup_steps - 1`` instead, to leave the ramp-up out);
* slot_utilization: integral of filled batch slots (the sequences running; schema < 9: the batch) /
  (instances x capacity x window);
* bubble_fraction: the idle share of the decode slots while rollout may run: 1 - slot_utilization when it
  may run the whole window (disaggregated), and over the window less its training time when training pauses
  it (``colocated``);
* rollout_only_fraction: share of the window in which some instance generates while no train step runs;
* inter_instance_bubble: the C.3 formula (max_i L_i - L_i) / max_i L_i averaged over instances, with
  L_i the busy time of instance i between consecutive train-step starts within the window (its start and
  end bound the first and last interval), averaged over those intervals;
* throughput_tokens_per_s, **trained tokens/s**: the trained tokens (``trained_tokens``: prompt + response
  tokens of the trajectories a step consumed) of the train steps that end in the window / its length;
* instance_busy_s: seconds an instance spent in non-empty engine steps within the window, mean over
  instances (the rollout time of the KV-migration ablation);
* engine_steps_per_trained_token: engine steps with a non-empty batch, summed over instances, that
  start in the window / the tokens those steps' train steps consumed (hardware-independent: pacing and
  core contention change seconds, not step counts);
* overheads: seconds spent in each kind of op (weight loads, migrations, ...) / (instances x window);
* trainer_wait_fraction: share of the window in which rank 0's policy had the trainer waiting, by
  what for (``trainer_wait`` ops; core: Policy.train_wait): capacity, tail or window.

Invariant: only measured intervals are used; a run with no engine steps or no train steps gives zeros.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..core.policy_base import TRAIN_WAITS


def trained_tokens(steps: np.ndarray, consume_step: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Each train step's trained tokens (in the order of ``steps``): the prompt + response tokens (``tokens``,
    one per consumed trajectory) of the trajectories it consumed (``consume_step``). The one definition of a
    trained token (docs/glossary.md); the simulator's steps count the same (sim/cluster.py)."""
    by_step: dict[int, int] = defaultdict(int)
    for s, n in zip(consume_step.tolist(), tokens.tolist(), strict=True):
        by_step[int(s)] += int(n)
    return np.array([by_step.get(int(s), 0) for s in steps], dtype=np.int64)


def trained_tokens_per_s(t_end: list[float], tokens: list[int], warmup_steps: int = 1) -> float | None:
    """Trained tokens/s (docs/glossary.md): the trained tokens of the steps that end after step
    ``warmup_steps - 1`` over the time from its end to the last step's; ``t_end`` and ``tokens`` by step, in
    order. None until a step ends after the window opens. ``utilization`` and the live status line use it."""
    if len(t_end) <= warmup_steps or warmup_steps < 1:
        return None
    lo, hi = t_end[warmup_steps - 1], t_end[-1]
    return sum(int(k) for k, e in zip(tokens, t_end, strict=True) if lo < e <= hi) / (hi - lo) if hi > lo else None


class Cover:
    """The union of some intervals, with O(log n) 'how much of [a, b] is covered' queries."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        merged: list[list[float]] = []
        for a, b in sorted(i for i in intervals if i[1] > i[0]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        arr = np.array(merged, dtype=float).reshape(-1, 2)
        self.a, self.b = arr[:, 0], arr[:, 1]
        self.before = np.concatenate([[0.0], np.cumsum(self.b - self.a)])  # covered length before interval i

    def upto(self, x: np.ndarray) -> np.ndarray:
        """Covered length in (-inf, x] for each x."""
        x = np.asarray(x, dtype=float)
        if not len(self.a):
            return np.zeros_like(x)
        i = np.searchsorted(self.a, x, side="right") - 1
        inside = np.where(i >= 0, np.clip(np.minimum(x, self.b[np.maximum(i, 0)]) - self.a[np.maximum(i, 0)],
                                          0, None), 0.0)
        return self.before[np.maximum(i, 0)] * (i >= 0) + inside

    def length(self, lo: float, hi: float) -> float:
        return float(self.upto(hi) - self.upto(lo)) if len(self.a) else 0.0


def op_seconds(ops: dict[str, np.ndarray], lo: float, hi: float) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds within [lo, hi] of each kind of op, and of the trainer's waits by what for (not an op's cost)."""
    over: dict[str, float] = defaultdict(float)
    waits = dict.fromkeys(TRAIN_WAITS, 0.0)
    for kind, a, b, detail in zip(ops["kind"], ops["t_start"], ops["t_end"], ops["detail"], strict=True):
        if b > a:
            seconds = max(0.0, min(b, hi) - max(a, lo))
            if kind == "trainer_wait":
                waits[str(detail)] = waits.get(str(detail), 0.0) + seconds
            else:
                over[str(kind)] += seconds
    return over, waits


def utilization(esteps: dict[str, np.ndarray], tsteps: dict[str, np.ndarray], ops: dict[str, np.ndarray],
                warmup_steps: int = 0, colocated: bool = False, ranks: list[int] | None = None) -> dict:
    """``esteps`` must carry a ``rank`` column (which rollout instance wrote the row); ``colocated``: training
    pauses rollout (the placement); ``ranks``: every rollout instance's rank, so an instance that never took a
    step counts its idle slots (its capacity: the others')."""
    zero = {"window_s": 0.0, "slot_utilization": 0.0, "bubble_fraction": 0.0, "rollout_only_fraction": 0.0,
            "inter_instance_bubble": 0.0, "throughput_tokens_per_s": 0.0, "engine_steps_per_trained_token": 0.0,
            "instance_busy_s": 0.0, "trainer_wait_fraction": dict.fromkeys(TRAIN_WAITS, 0.0),
            "overheads": {}}
    if not len(esteps["t_start"]) or not len(tsteps["t_end"]):
        return zero
    order = np.argsort(tsteps["t_end"])
    t_start, t_end, tokens = tsteps["t_start"][order], tsteps["t_end"][order], tsteps["tokens"][order]
    lo = float(t_end[warmup_steps - 1]) if 0 < warmup_steps < len(t_end) else float(esteps["t_start"].min())
    hi = float(t_end[-1])
    span = hi - lo
    if span <= 0:
        return zero
    ranks = sorted({int(r) for r in esteps["rank"]} | set(ranks or ()))
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    slot_s = capacity = 0.0
    busy_steps = 0
    cap_of: dict[int, int] = {}
    filled = np.where(esteps["running"] >= 0, esteps["running"], esteps["batch_size"]) if "running" in esteps \
        else esteps["batch_size"]
    for r, a, b, n, cap in zip(esteps["rank"], esteps["t_start"], esteps["t_end"], filled, esteps["capacity"],
                               strict=True):
        cap_of[int(r)] = int(cap)
        if n > 0:
            busy[int(r)].append((float(a), float(b)))
            busy_steps += lo <= a < hi
            slot_s += int(n) * max(0.0, min(b, hi) - max(a, lo))
    typical = max(cap_of.values(), default=0)
    capacity = sum(cap_of.get(r, typical) for r in ranks)
    slot_util = slot_s / (capacity * span) if capacity else 0.0
    training = Cover(list(zip(t_start.tolist(), t_end.tolist(), strict=True)))
    rolling = Cover([(max(a, lo), min(b, hi)) for r in ranks for a, b in busy[r]])
    # rollout-only: covered by some generating instance and not by a train step
    rollout_only = (rolling.length(lo, hi) - float(np.sum(training.upto(rolling.b) - training.upto(rolling.a)))) / span
    marks = np.array([lo] + [float(s) for s in t_start if lo < s < hi] + [hi])  # window start, step starts, end
    bubbles = []
    if len(marks) > 1:
        per = np.array([np.diff(Cover(busy[r]).upto(marks)) if busy[r] else np.zeros(len(marks) - 1)
                        for r in ranks])  # [instance, window] busy seconds
        top = per.max(axis=0)
        ok = top > 0
        bubbles = ((top[ok] - per[:, ok]) / top[ok]).mean(axis=0).tolist()
    trained = float(sum(int(k) for k, e in zip(tokens, t_end, strict=True) if lo < e <= hi))
    over, waits = op_seconds(ops, lo, hi)
    n_inst = max(len(ranks), 1)
    rollout_span = span - (training.length(lo, hi) if colocated else 0.0)
    bubble = 1.0 - slot_util * span / rollout_span if rollout_span > 0 else 1.0
    return {"window_s": span, "slot_utilization": slot_util, "bubble_fraction": bubble,
            "rollout_only_fraction": rollout_only,
            "inter_instance_bubble": float(np.mean(bubbles)) if bubbles else 0.0,
            "throughput_tokens_per_s": trained / span,
            "engine_steps_per_trained_token": busy_steps / trained if trained else 0.0,
            "instance_busy_s": float(np.mean([Cover(busy[r]).length(lo, hi) if busy[r] else 0.0 for r in ranks])),
            "trainer_wait_fraction": {k: float(v / span) for k, v in waits.items()},
            "overheads": {k: v / (n_inst * span) for k, v in sorted(over.items())}}


def multi_version_batches(esteps: dict) -> int:
    """Engine steps whose requests were of two versions or more (``batch_versions``): under train.lora's shared
    instances one forward serves several versions' adapters. A simulated run counts its macro steps."""
    return int((esteps["batch_versions"] >= 2).sum()) if "batch_versions" in esteps else 0
