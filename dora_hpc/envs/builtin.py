"""The built-in environments over any text task (its scorer judges a final answer):

* ``retry``: a wrong answer gets a feedback turn and another attempt, up to ``max_turns`` attempts; the
  reward is the task's score of the answer that ended the episode, scaled by how early it came: attempt
  t of T earns (T - t + 1) / T of it, so a right first answer is worth most;
* ``python_tool``: the model may put code in a fenced block tagged python; the environment runs it in the
  sandbox (envs/sandbox.py: no network, time, memory and output limits) and replies with its output. A
  turn without a code block is the final answer, scored by the task; so is the last turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .base import EnvArgError, Message, StepOutput, register
from .sandbox import run_python

CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)


@register("retry")
class RetryEnv:
    def __init__(self, score: Callable[[str], float], max_turns: int, timeout_s: float,
                 feedback: str = "That is not right. Try again.") -> None:
        if max_turns < 1:
            raise EnvArgError(f"env.max_turns: {max_turns}; retry needs at least 1")
        self.score, self.max_turns, self.feedback, self.turn = score, max_turns, feedback, 0

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> StepOutput:
        self.turn += 1
        score = float(self.score(action))
        done = score >= 1.0 or self.turn >= self.max_turns
        reward = score * (self.max_turns - self.turn + 1) / self.max_turns if done else 0.0
        return {"observations": [] if done else [{"role": "user", "content": self.feedback}], "reward": reward,
                "done": done, "metadata": {"attempt": self.turn, "score": score}}

    def close(self) -> None:
        pass


@register("python_tool")
class PythonToolEnv:
    def __init__(self, score: Callable[[str], float], max_turns: int, timeout_s: float, mem_mb: int = 512,
                 max_output: int = 2048) -> None:
        if max_turns < 1:
            raise EnvArgError(f"env.max_turns: {max_turns}; python_tool needs at least 1")
        self.score, self.max_turns, self.turn = score, max_turns, 0
        self.limits = {"timeout_s": timeout_s, "mem_mb": mem_mb, "max_output": max_output}

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> StepOutput:
        self.turn += 1
        code = CODE.search(action)
        if code is None or self.turn >= self.max_turns:  # a final answer
            return {"observations": [], "reward": float(self.score(action)), "done": True,
                    "metadata": {"turn": self.turn, "ran_code": False}}
        r = run_python(code.group(1), **self.limits)
        status = "timed out" if r.timed_out else f"exit {r.exit_code}" + (", output cut" if r.truncated else "")
        reply = f"Output ({status}):\n{r.stdout}" + (f"\nErrors:\n{r.stderr}" if r.stderr else "")
        return {"observations": [{"role": "user", "content": reply}], "reward": 0.0, "done": False,
                "metadata": {"turn": self.turn, "ran_code": True, "timed_out": r.timed_out}}

    def close(self) -> None:
        pass
