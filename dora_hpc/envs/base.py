"""The environment protocol of a multi-turn episode, in skyrl-gym's shape (``BaseTextEnv``): chat
messages in, the model's text out.

* ``init(prompt) -> (messages, info)``: the conversation the first turn continues;
* ``step(action) -> StepOutput``: the model's turn as text; the environment's reply as chat messages
  (appended to the conversation), this step's reward, whether the episode ends, and free metadata.

An environment is built once per episode by ``envs.make_env`` from the episode's scorer (the task's reward of a
final answer, one group's) and its ``env.*`` settings; it holds that episode's state only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypedDict

Message = dict[str, str]  # {"role": "user" | "assistant" | "tool" | "system", "content": str}


class StepOutput(TypedDict):
    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any]


class TextEnv(Protocol):
    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]: ...

    def step(self, action: str) -> StepOutput: ...

    def close(self) -> None: ...


class EnvArgError(ValueError):
    """A bad ``env.args`` entry; the message names it."""


Factory = Callable[..., TextEnv]  # (score, max_turns, timeout_s, **args) -> TextEnv
ENVS: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        ENVS[name] = factory
        return factory
    return add
