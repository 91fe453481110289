"""``env.name: openai_agent``: the user's agent, written against the OpenAI API, is the episode's environment.

``env.args.agent`` names a callable ``"module:function"`` (sync or async), importable where the rollout ranks
run. It is called once per episode with keyword arguments

* ``base_url``, ``api_key``, ``model``: an OpenAI-compatible endpoint (runtime/gateway.py) that serves this
  episode only, with the policy version the episode was tagged with;
* ``prompt``: the task's chat messages for the episode's group; ``metadata``: ``{"group_id", "answer",
  "score"}`` (the task's answer, None for a task without one; ``score(text) -> float``, the task's own scorer
  of a final answer, as environments get it);

talks to the model only through that URL, and returns its reward (a float), or None: the task's scorer then
scores the text of the model's last reply.

An ``AgentRun`` is what the environment workers (envs/pool.py) run: one whole agent run is one job, whose
output is the episode's reward. The worker keeps its network (the agent must reach the endpoint); the agent is
the user's own code, not a sandboxed tool.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from .base import EnvArgError, Message, StepOutput, register


def load_agent(spec: Any) -> Callable[..., Any]:
    """The callable ``spec`` ("module:function") names; an EnvArgError naming env.args.agent otherwise."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise EnvArgError(f"env.args.agent: {spec!r}; give the agent as 'module:function'")
    mod, attr = spec.split(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise EnvArgError(f"env.args.agent: cannot import {spec!r} ({e})") from None
    if not callable(fn):
        raise EnvArgError(f"env.args.agent: {spec!r} is not callable")
    return fn


@register("openai_agent")
class AgentRun:
    """One episode's agent run. Built like any environment (``make_env``); ``bind`` gives it its endpoint and
    key; its one ``step`` runs the whole agent and returns its reward (``metadata["scored_by_task"]`` when the
    agent returned None: the episode's host scores the last reply)."""

    def __init__(self, score: Callable[[str], float], max_turns: int, timeout_s: float, agent: str | None = None,
                 **agent_kwargs: Any) -> None:
        if agent is None:
            raise EnvArgError("env.args.agent: openai_agent needs the agent, as 'module:function'")
        load_agent(agent)  # fails here, at config time, when it cannot be imported
        self.agent, self.agent_kwargs = agent, agent_kwargs  # (score: the host passes metadata["score"])
        self.prompt: list[Message] = []
        self.endpoint: dict[str, Any] = {}

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        self.prompt = prompt
        return prompt, {}

    def bind(self, base_url: str, api_key: str, model: str, metadata: dict[str, Any]) -> None:
        self.endpoint = {"base_url": base_url, "api_key": api_key, "model": model, "metadata": metadata}

    def step(self, action: str) -> StepOutput:
        fn = load_agent(self.agent)
        out = fn(prompt=self.prompt, **self.endpoint, **self.agent_kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        if out is not None and not isinstance(out, int | float):
            raise TypeError(f"the agent returned {type(out).__name__}; it must return its reward (a float) or None")
        return {"observations": [], "reward": float(out or 0.0), "done": True,
                "metadata": {"scored_by_task": out is None}}

    def close(self) -> None:
        pass


async def _awaited(aw: Any) -> Any:
    return await aw
