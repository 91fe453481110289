"""The environment protocol of a multi-turn episode, in skyrl-gym's shape (``BaseTextEnv``): chat
messages in, the model's text out.

* ``init(prompt) -> (messages, info)``: the conversation the first turn continues;
* ``step(action) -> StepOutput``: the model's turn as text; the environment's reply as chat messages
  (appended to the conversation), this step's reward, whether the episode ends, and free metadata.

An environment is built once per episode by ``envs.make_env`` from the episode's scorer (the task's reward of a
final answer, one group's) and its ``env.*`` settings; it holds that episode's state only, and it pickles:
its steps run in worker processes (envs/pool.py), which send it back with the step's output, and it travels
with its episode when the episode migrates. A ``Scorer`` names its group; the process's bound task scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


_TASK: list[Any] = []  # the task this process scores with (bind_task): the rollout rank's, or a worker's own


def bind_task(task: Any) -> None:
    """Scorers in this process score with ``task`` (its ``score_text(group_id, text)``)."""
    _TASK[:] = [task]


@dataclass(frozen=True)
class Scorer:
    """The task's score of a final answer to group ``group_id``'s prompt (raises what the scorer raises)."""

    group_id: int

    def __call__(self, text: str) -> float:
        if not _TASK:
            raise RuntimeError("no task is bound in this process (envs.base.bind_task)")
        return float(_TASK[0].score_text(self.group_id, text))

    def ground_truth(self) -> str | None:
        """The task's answer to the group's question (None for a task without one: the toy)."""
        if not _TASK:
            raise RuntimeError("no task is bound in this process (envs.base.bind_task)")
        return _TASK[0].ground_truth(self.group_id)
