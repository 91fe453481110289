"""Synthetic long-tailed workload: prompt and response lengths, a pure function of (seed, id).

Invariant: every policy simulated with the same seed sees the same lengths for the same prompt group
and trajectory ids, so modes are compared on identical work.
"""

from __future__ import annotations

import numpy as np

from ..config import LengthDist, WorkloadConfig

_BLOCK = 4096


def sample_lengths(dist: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    x = dist.median * np.exp(dist.sigma * rng.standard_normal(n))
    return np.clip(np.rint(x), dist.min, dist.max).astype(np.int64)


class Workload:
    def __init__(self, cfg: WorkloadConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self._blocks: dict[tuple[str, int], np.ndarray] = {}

    def _value(self, kind: str, dist: LengthDist, idx: int) -> int:
        b, off = divmod(idx, _BLOCK)
        arr = self._blocks.get((kind, b))
        if arr is None:
            rng = np.random.default_rng([self.seed, 0 if kind == "prompt" else 1, b])
            arr = self._blocks[(kind, b)] = sample_lengths(dist, rng, _BLOCK)
        return int(arr[off])

    def prompt_len(self, group_id: int) -> int:
        return self._value("prompt", self.cfg.prompt_len, group_id)

    def response_len(self, traj_id: int) -> int:
        return self._value("response", self.cfg.response_len, traj_id)

    def moments(self, n: int = 200_000) -> dict[str, float]:
        """Monte-Carlo moments used by the zero-bubble limit: E[P], E[L], E[L^2], E[P L], p50/p99 of L."""
        rng = np.random.default_rng([self.seed, 2])
        p = sample_lengths(self.cfg.prompt_len, rng, n).astype(float)
        r = sample_lengths(self.cfg.response_len, rng, n).astype(float)
        return {"P": p.mean(), "L": r.mean(), "L2": (r * r).mean(), "PL": (p * r).mean(),
                "p50": float(np.percentile(r, 50)), "p99": float(np.percentile(r, 99))}
