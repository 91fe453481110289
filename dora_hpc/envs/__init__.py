"""Environments of multi-turn episodes: the protocol (base.py), the built-in ones over any text task
(builtin.py: retry, python_tool) and the sandbox that runs tool code (sandbox.py). Not yet driven by the
rollout ranks (issue 30)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import builtin  # noqa: F401 - registers the built-in environments
from .base import ENVS, EnvArgError, TextEnv


def make_env(name: str, score: Callable[[str], float], max_turns: int, timeout_s: float,
             args: dict[str, Any] | None = None) -> TextEnv:
    """The environment ``name`` for one episode; an unknown name or argument is an EnvArgError naming it."""
    if name not in ENVS:
        raise EnvArgError(f"env.name: unknown environment {name!r}; choose from {', '.join(sorted(ENVS))}")
    try:
        return ENVS[name](score=score, max_turns=max_turns, timeout_s=timeout_s, **(args or {}))
    except TypeError as e:  # an argument the environment does not take
        raise EnvArgError(f"env.args: {name} {e}") from e
