"""What a rollout rank's two kinds of episodes share (episodes.py: an environment's; agent_episodes.py: an
agent's): the environment worker pool, and telling rank 0's dashboard how many episodes wait on it.

Invariant: workers score as the rank does (the run's task is bound in both); rank 0 hears a count only when it
changed, at most 4 times a second.
"""

from __future__ import annotations

import time

from ..envs import bind_task
from ..envs.pool import EnvPool
from .messages import EnvWaiting


def worker_pool(rank, model_dir, network: bool) -> EnvPool:
    """The rank's environment workers, each with the run's task bound (scorers score there as on the rank, and
    on the rank itself too: an environment's init may score)."""
    bind_task(rank.task)
    return EnvPool(rank.cfg.env.workers, rank.cfg.env.timeout_s, {
        "cfg_json": rank.cfg.model_dump_json(), "vocab_size": rank.task.vocab_size, "model_dir": str(model_dir),
        "network": network})


def tell_waiting(rank, told: tuple[int, float], waiting) -> tuple[int, float]:
    """Rank 0's dashboard: ``waiting()`` episodes wait on their environment (or agent) here; sent on change, at
    most 4 times a second, counted only when it may be sent. Returns what was last told, and when."""
    now = time.monotonic()
    if now - told[1] <= 0.25 or not hasattr(rank, "comm"):
        return told
    n = waiting()
    if n == told[0]:
        return told
    rank.comm.send(EnvWaiting(rank.instance, n), 0)
    return n, now
