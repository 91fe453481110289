"""Environments of multi-turn episodes: the protocol (base.py), the built-in ones (builtin.py: retry,
python_tool, toy_turns), skyrl-gym's run unchanged (skyrl.py), the sandbox that runs tool code (sandbox.py)
and the worker processes that run environment steps off the rollout rank's loop (pool.py).

``env.name`` is a built-in name, ``skyrl:<id>`` (a registered skyrl-gym environment) or ``module:Class`` (a
user's environment class, importable where the rollout ranks run, built like the built-in ones)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from . import builtin, openai_agent  # noqa: F401 - registers the built-in environments
from .base import ENVS, EnvArgError, Factory, Scorer, TextEnv, bind_task

__all__ = ["ENVS", "EnvArgError", "Scorer", "TextEnv", "bind_task", "check_env", "make_env"]


def factory(name: str) -> Factory:
    """The constructor ``name`` stands for; an unknown one is an EnvArgError naming env.name."""
    if name in ENVS:
        return ENVS[name]
    if name.startswith("skyrl:"):
        from .skyrl import skyrl_factory

        return skyrl_factory(name.removeprefix("skyrl:"))
    mod, sep, attr = name.partition(":")
    if sep:
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise EnvArgError(f"env.name: cannot import {name!r} ({e})") from None
    raise EnvArgError(f"env.name: unknown environment {name!r}; choose from none, {', '.join(sorted(ENVS))}, "
                      "skyrl:<id> or module:Class")


def make_env(name: str, score: Callable[[str], float], max_turns: int, timeout_s: float,
             args: dict[str, Any] | None = None) -> TextEnv:
    """The environment ``name`` for one episode; an unknown name or argument is an EnvArgError naming it."""
    build = factory(name)
    try:
        return build(score=score, max_turns=max_turns, timeout_s=timeout_s, **(args or {}))
    except TypeError as e:  # an argument the environment does not take
        raise EnvArgError(f"env.args: {name} {e}") from e


def check_env(name: str, max_turns: int, timeout_s: float, args: dict[str, Any]) -> None:
    """Raise EnvArgError (naming the key) unless ``name`` builds with ``args``: a throwaway episode's env."""
    make_env(name, Scorer(0), max_turns, timeout_s, args).close()
