"""What a run's multi-turn episodes did (``env.name``), from the trajectory rows: turns, the share of the
episodes' time spent in environment steps, environment errors by kind, episodes that spanned versions
(partial rollout) and staleness by number of turns. A single-turn run reads as 1 turn, no errors."""

from __future__ import annotations

import numpy as np

from ..measure.invariants import joined
from .invariants import ENV_ERRORS


def episode_figures(traj: dict[str, np.ndarray], matched: np.ndarray, stale: np.ndarray) -> dict:
    """``traj``: read_trajectories' columns; ``matched``/``stale``: each consumed row's trajectory row and
    staleness (analysis/invariants.py)."""
    turns, err = traj["turns"], traj["env_error"]
    life = traj["lifetime"].sum()
    consumed_turns = joined(turns, matched, 1)
    by_turns = {str(int(n)): {"n": int((consumed_turns == n).sum()), "mean": float(stale[consumed_turns == n].mean())}
                for n in np.unique(consumed_turns)} if len(stale) else {}
    return {
        "turns": {"mean": float(turns.mean()) if len(turns) else 0.0, "max": int(turns.max(initial=0))},
        "env_time_fraction": float(traj["env_s"].sum() / life) if life > 0 else 0.0,
        "env_errors": int((err > 0).sum()),
        "env_errors_by_kind": {kind: int((err == i).sum()) for i, kind in enumerate(ENV_ERRORS) if i},
        "multi_version_episodes": int(traj["switched"].sum()),  # partial rollout: within or between turns
        "staleness_by_turns": by_turns,
    }
