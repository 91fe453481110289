"""The built-in environments over any text task (its scorer judges a final answer):

* ``retry``: a wrong answer gets a feedback turn and another attempt, up to ``max_turns`` attempts; the
  reward is the task's score of the answer that ended the episode, scaled by how early it came: attempt
  t of T earns (T - t + 1) / T of it, so a right first answer is worth most;
* ``python_tool``: the model may put code in a fenced block tagged python; the environment runs it in the
  sandbox (envs/sandbox.py: no network, time, memory and output limits) and replies with its output. A
  turn without a code block is the final answer, scored by the task; so is the last turn.

``retry`` and ``toy_turns`` take ``latency_s``, ``latency_sigma``, ``latency_max_s``: each step then waits a
lognormal time (median, sigma, cap), standing in for a slow tool, verifier or simulator. The wait is a
function of the turn and the action, so a step re-run waits as long.
"""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Callable
from typing import Any

from .base import EnvArgError, Message, StepOutput, register
from .sandbox import run_python

CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)


class Latency:
    """A step's wait: lognormal around ``median`` seconds with ``sigma``, at most ``cap``; none when median is 0."""

    def __init__(self, env: str, median: float, sigma: float, cap: float) -> None:
        if median < 0 or sigma < 0 or cap < 0:
            raise EnvArgError(f"env.args: {env} needs latency_s, latency_sigma and latency_max_s >= 0")
        self.median, self.sigma, self.cap = median, sigma, cap

    def wait(self, rng: random.Random) -> None:
        if self.median:
            time.sleep(min(self.cap, self.median * rng.lognormvariate(0.0, self.sigma)))


def step_rng(turn: int, action: str) -> random.Random:
    return random.Random(zlib.crc32(f"{turn}:{action}".encode()))


@register("retry")
class RetryEnv:
    def __init__(self, score: Callable[[str], float], max_turns: int, timeout_s: float,
                 feedback: str = "That is not right. Try again.", latency_s: float = 0.0, latency_sigma: float = 0.0,
                 latency_max_s: float = 60.0) -> None:
        if max_turns < 1:
            raise EnvArgError(f"env.max_turns: {max_turns}; retry needs at least 1")
        self.score, self.max_turns, self.feedback, self.turn = score, max_turns, feedback, 0
        self.latency = Latency("retry", latency_s, latency_sigma, latency_max_s)

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> StepOutput:
        self.turn += 1
        self.latency.wait(step_rng(self.turn, action))
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


@register("toy_turns")
class ToyTurnsEnv:
    """For the tiny random model and fast tests: text is token ids written as decimal numbers. Each step
    replies with ``reply_tokens`` token ids and rewards the turn's score / max_turns (the toy task's share of
    even tokens, over the whole episode); the episode ends after ``max_turns`` turns, or earlier with
    probability ``stop_prob`` after each. Every draw (the latency's too) is a function of the action, so a step
    re-run gives the same reply."""

    def __init__(self, score: Callable[[str], float], max_turns: int, timeout_s: float, reply_tokens: int = 4,
                 reply_vocab: int = 64, stop_prob: float = 0.0, latency_s: float = 0.0, latency_sigma: float = 0.0,
                 latency_max_s: float = 60.0) -> None:
        if reply_tokens < 1 or reply_vocab < 1 or not 0 <= stop_prob <= 1:
            raise EnvArgError("env.args: toy_turns needs reply_tokens >= 1, reply_vocab >= 1 and 0 <= stop_prob <= 1")
        self.score, self.max_turns, self.turn = score, max_turns, 0
        self.reply_tokens, self.reply_vocab, self.stop_prob = reply_tokens, reply_vocab, stop_prob
        self.latency = Latency("toy_turns", latency_s, latency_sigma, latency_max_s)

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> StepOutput:
        self.turn += 1
        rng = step_rng(self.turn, action)
        self.latency.wait(rng)
        done = self.turn >= self.max_turns or rng.random() < self.stop_prob
        reply = " ".join(str(3 + rng.randrange(self.reply_vocab)) for _ in range(self.reply_tokens))
        return {"observations": [] if done else [{"role": "user", "content": reply}],
                "reward": float(self.score(action)) / self.max_turns, "done": done, "metadata": {"turn": self.turn}}

    def close(self) -> None:
        pass
