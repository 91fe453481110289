"""Agents written against the OpenAI client that ship with dora_hpc (``env.name: openai_agent``,
``env.args.agent: "dora_hpc.envs.agents:<name>"``): the built-in environments' logic, as a user would write it.
"""

from __future__ import annotations

import random
import time
from typing import Any

from openai import OpenAI


def retry(base_url: str, api_key: str, model: str, prompt: list[dict], metadata: dict[str, Any], attempts: int = 3,
          feedback: str = "That is not right. Try again.", max_tokens: int | None = None, latency_s: float = 0.0,
          latency_sigma: float = 0.0, latency_max_s: float = 60.0) -> float:
    """The ``retry`` environment's logic: answer; a wrong answer gets ``feedback`` and another attempt, up to
    ``attempts``; attempt t of T earns (T - t + 1) / T of the task's score of the answer that ended it. Judging
    an answer waits ``latency_s`` (lognormal, ``latency_sigma``, at most ``latency_max_s``), as the retry
    environment's ``latency_s`` does: a slow verifier or tool."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    score = metadata["score"]  # the task's own scorer of a final answer
    rng = random.Random(metadata["group_id"])
    messages = list(prompt)
    for t in range(1, attempts + 1):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        if latency_s:
            time.sleep(min(latency_max_s, latency_s * rng.lognormvariate(0.0, latency_sigma)))
        s = score(text)
        if s >= 1.0 or t == attempts:
            return s * (attempts - t + 1) / attempts
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
    return 0.0


def fixed_replies(base_url: str, api_key: str, model: str, prompt: list[dict], metadata: dict[str, Any],
                  turns: int = 4, reply: str = "4 6 8 10") -> None:
    """The smallest chat loop: every answer gets ``reply`` (as a user message), ``turns`` calls in all; the task
    scores the last answer. ``dora-hpc bench agent-gateway`` runs it against toy_turns on the same episodes."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for t in range(turns):
        answer = client.chat.completions.create(model=model, messages=messages)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        if t + 1 < turns:
            messages.append({"role": "user", "content": reply})
    return None
