"""Synthetic long-tailed workload: prompt and response lengths, and a multi-turn episode's turns, environment
latencies and environment tokens, a pure function of (seed, id).

Invariants:
* every policy simulated with the same seed sees the same lengths for the same prompt group and trajectory
  ids, so modes are compared on identical work;
* a single-turn workload (``turns.max: 1``) draws exactly what it drew before episodes existed: the first
  turn's length is ``response_len(traj)``, later turns and environment steps use streams of their own;
* ``Logged`` lengths (a real run's, replayed by plan's fit check) replace the draws for the prompt groups and
  trajectories they name; everything else is drawn as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import LengthDist, WorkloadConfig

_BLOCK = 4096


def sample_lengths(dist: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    x = dist.median * np.exp(dist.sigma * rng.standard_normal(n))
    return np.clip(np.rint(x), dist.min, dist.max).astype(np.int64)


@dataclass(frozen=True)
class Logged:
    """A logged run's own lengths: the whole prompt (shared prefix included) by group, the response by
    trajectory."""
    prompt: dict[int, int]
    response: dict[int, int]


@dataclass(frozen=True)
class Turn:
    tokens: int          # model tokens of the turn
    env_tokens: int      # the environment's tokens after it (0 after the last turn: it ends the episode)
    env_s: float         # the environment step's latency after it (after the last turn too: it says done)


class Workload:
    def __init__(self, cfg: WorkloadConfig, seed: int, logged: Logged | None = None) -> None:
        self.cfg, self.seed, self.logged = cfg, seed, logged
        self._blocks: dict[tuple[str, int], np.ndarray] = {}

    def _value(self, kind: str, dist: LengthDist, idx: int) -> int:
        b, off = divmod(idx, _BLOCK)
        arr = self._blocks.get((kind, b))
        if arr is None:
            rng = np.random.default_rng([self.seed, 0 if kind == "prompt" else 1, b])
            arr = self._blocks[(kind, b)] = sample_lengths(dist, rng, _BLOCK)
        return int(arr[off])

    def prompt_len(self, group_id: int) -> int:
        """The whole prompt: ``shared_prefix_tokens`` every prompt starts with, then the group's own."""
        if self.logged is not None and group_id in self.logged.prompt:
            return self.logged.prompt[group_id]
        return self.cfg.shared_prefix_tokens + self._value("prompt", self.cfg.prompt_len, group_id)

    def response_len(self, traj_id: int) -> int:
        if self.logged is not None and traj_id in self.logged.response:
            return self.logged.response[traj_id]
        return self._value("response", self.cfg.response_len, traj_id)

    def _draw(self, kind: int, idx: int, median: float, sigma: float, lo: float, hi: float) -> float:
        rng = np.random.default_rng([self.seed, kind, idx])
        return min(max(float(median * np.exp(sigma * rng.standard_normal())), lo), hi)  # np.clip, less its overhead

    def episode(self, traj_id: int, prompt_len: int) -> list[Turn]:
        """The turns of trajectory ``traj_id``: one for a single-turn workload, else ``turns`` of them, cut
        where prompt + tokens would pass ``max_episode_tokens`` (the cut turn is the last)."""
        c = self.cfg
        first = self.response_len(traj_id)
        if c.turns.max == 1:
            return [Turn(first, 0, 0.0)]
        n = int(round(self._draw(3, traj_id, c.turns.median, c.turns.sigma, c.turns.min, c.turns.max)))
        room, turns = c.max_episode_tokens - prompt_len, []
        for k in range(n):
            d = c.response_len
            tokens = first if k == 0 else int(round(self._draw(4, traj_id * 4096 + k, d.median, d.sigma, d.min,
                                                                  d.max)))
            tokens = min(tokens, room)
            room -= tokens
            e, lat = c.env_tokens, c.env_latency_s
            env = int(round(self._draw(5, traj_id * 4096 + k, e.median, e.sigma, e.min, e.max)))
            env_s = self._draw(6, traj_id * 4096 + k, lat.median, lat.sigma, 0.0, lat.max)
            if k == n - 1 or room - env < 1 or tokens < 1:  # the last turn: its environment step says done
                turns.append(Turn(max(tokens, 1), 0, env_s))
                break
            room -= env
            turns.append(Turn(tokens, env, env_s))
        return turns

    def moments(self, n: int = 200_000) -> dict[str, float]:
        """Monte-Carlo moments used by the zero-bubble limit: E[P], E[L], E[L^2], E[P L], p50/p99 of L (L: the
        tokens after the prompt), the KV a trajectory reads while it decodes (``kv_steps``: see episode_kv);
        for a multi-turn workload also, per episode, ``model`` (decoded tokens), ``env_tokens`` and ``env_s``
        (from 20,000 episodes)."""
        if self.cfg.turns.max > 1:
            return self._episode_moments(20_000)
        rng = np.random.default_rng([self.seed, 2])
        p = sample_lengths(self.cfg.prompt_len, rng, n).astype(float) + self.cfg.shared_prefix_tokens
        r = sample_lengths(self.cfg.response_len, rng, n).astype(float)
        return {"P": p.mean(), "L": r.mean(), "L2": (r * r).mean(), "PL": (p * r).mean(),
                "p50": float(np.percentile(r, 50)), "p99": float(np.percentile(r, 99)),
                "kv_steps": float((p * r + r * (r - 1) / 2).mean())}

    def _episode_moments(self, n: int) -> dict[str, float]:
        p = np.array([self.prompt_len(g) for g in range(n)], float)
        eps = [self.episode(t, int(p[t])) for t in range(n)]
        model = np.array([sum(x.tokens for x in e) for e in eps], float)
        env = np.array([sum(x.env_tokens for x in e) for e in eps], float)
        r = model + env
        kv_steps = [episode_kv(int(p[t]), e) for t, e in enumerate(eps)]
        return {"P": p.mean(), "L": r.mean(), "L2": (r * r).mean(), "PL": (p * r).mean(),
                "p50": float(np.percentile(r, 50)), "p99": float(np.percentile(r, 99)), "model": model.mean(),
                "env_tokens": env.mean(), "env_s": float(np.mean([sum(x.env_s for x in e) for e in eps])),
                "turns": float(np.mean([len(e) for e in eps])), "kv_steps": float(np.mean(kv_steps))}


def episode_kv(prompt: int, turns: list[Turn]) -> float:
    """KV tokens summed over the episode's decode steps: a decode step of a sequence with context c reads c
    tokens of KV (the environment's tokens join the context at the next turn's prefill)."""
    ctx, steps = float(prompt), 0.0
    for x in turns:
        steps += x.tokens * ctx + x.tokens * (x.tokens - 1) / 2
        ctx += x.tokens + x.env_tokens
    return steps
