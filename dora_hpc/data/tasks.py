"""Prompt sources with their reward functions.

Invariants:
* the prompt of group g and the length budget of trajectory t are pure functions of (seed, g) and
  (seed, t): a resumed or re-dispatched group gets exactly the same prompt;
* ``safe_reward`` never raises: a reward function that fails gives reward 0 and the error text,
  which the rollout rank records with the trajectory.
"""

from __future__ import annotations

import numpy as np

from ..config import RunConfig


class EvenTokensTask:
    """A toy task a tiny random model can learn: random prompts, reward = share of even token ids in
    the response. Response budgets follow ``workload.response_len`` (a long tail, ``ignore_eos``), so
    rollout has the straggler structure DORA is built for."""

    name = "even_tokens"
    ignore_eos = True

    def __init__(self, cfg: RunConfig, vocab_size: int) -> None:
        self.cfg, self.seed, self.vocab = cfg, cfg.seed, vocab_size
        self.vocab_size = vocab_size
        self.prompt_dist, self.resp_dist = cfg.workload.prompt_len, cfg.workload.response_len
        self.user_reward = load_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else None

    def _rng(self, kind: int, idx: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, kind, idx])

    @staticmethod
    def _length(dist, rng) -> int:
        return int(np.clip(np.rint(dist.median * np.exp(dist.sigma * rng.standard_normal())), dist.min, dist.max))

    def prompt(self, group_id: int) -> list[int]:
        """workload.shared_prefix_tokens tokens every prompt starts with, then the group's own."""
        rng = self._rng(0, group_id)
        own = rng.integers(3, self.vocab, size=self._length(self.prompt_dist, rng)).tolist()
        n = self.cfg.workload.shared_prefix_tokens
        return (self._rng(2, 0).integers(3, self.vocab, size=n).tolist() if n else []) + own

    def max_tokens(self, traj_id: int, turn: int = 0) -> int:
        """The response budget of trajectory ``traj_id`` (of each turn of a multi-turn episode)."""
        rng = self._rng(1, traj_id) if turn == 0 else np.random.default_rng([self.seed, 1, traj_id, turn])
        return self._length(self.resp_dist, rng)

    # -- multi-turn episodes (dora_hpc/envs/): the toy's text is its token ids as decimal numbers --------------
    def messages(self, group_id: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.decode_turn(self.prompt(group_id))}]

    @staticmethod
    def decode_turn(tokens: list[int]) -> str:
        return " ".join(map(str, tokens))

    def render_env(self, messages: list[dict[str, str]], last_token: int) -> list[int]:
        """The environment's messages as tokens: the numbers in their contents (mod the vocabulary)."""
        return [int(t) % self.vocab for m in messages for t in m["content"].split() if t.lstrip("-").isdigit()]

    def chat_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """An agent's first chat call as the prompt's tokens: the numbers in the messages' contents."""
        return self.render_env(messages, -1)

    def encode(self, text: str, first: bool = False) -> list[int]:
        """A text completion's prompt (or the part that extends an episode) as tokens: its numbers."""
        return self.render_env([{"role": "user", "content": text}], -1)

    def ground_truth(self, group_id: int) -> None:
        return None

    def score_text(self, group_id: int, text: str) -> float:
        return self.reward(group_id, [int(t) for t in text.split() if t.lstrip("-").isdigit()])

    def reward(self, group_id: int, response: list[int]) -> float:
        if self.user_reward is not None:
            return self.user_reward(response)
        return sum(1 for t in response if t % 2 == 0) / max(len(response), 1)

    def safe_reward(self, group_id: int, response: list[int]) -> tuple[float, str]:
        try:
            return float(self.reward(group_id, response)), ""
        except Exception as e:  # noqa: BLE001 - a user's reward function may raise anything
            return 0.0, f"{type(e).__name__}: {e}"


def overlong_penalty(length: int, budget: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``budget - buffer`` tokens, then linearly down to
    ``-penalty`` at the budget (a response cut at the budget gets the full penalty)."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -penalty * min(length - (budget - buffer), buffer) / buffer


def load_reward_fn(spec: str):
    """Import 'package.module:function'; a bad spec fails at start-up with a clear message."""
    import importlib

    mod, sep, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn) if sep else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task.reward_fn={spec!r}: cannot import it ({e})") from None


def make_task(cfg: RunConfig, vocab_size: int, model_dir=None):
    """The configured task; text tasks load the model folder's tokenizer."""
    if cfg.task.name == "even_tokens":
        return EvenTokensTask(cfg, vocab_size)
    from transformers import AutoTokenizer

    from .text_tasks import JsonlTask, ReasoningGymTask

    tok = AutoTokenizer.from_pretrained(model_dir)
    return {"reasoning_gym": ReasoningGymTask, "jsonl": JsonlTask}[cfg.task.name](cfg, tok)
