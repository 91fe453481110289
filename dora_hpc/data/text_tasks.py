"""Text tasks for real models: reasoning-gym generators and user jsonl files, scored per response.

Invariants:
* group g always gets the same prompt: item g % size of a seeded generator (reasoning_gym) or the
  g-th valid row of the file, cycling (jsonl); a malformed row is skipped at start-up and recorded
  (``malformed``) -- never a crash, never a silent gap;
* scoring runs in a worker thread with ``task.reward_timeout_s``; a scorer that raises or hangs
  yields reward 0 and the error text (math-verify's own timeouts are off in threads, so we enforce it).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from ..config import RunConfig
from .tool_calls import native, to_template


class TextTask:
    ignore_eos = False

    def __init__(self, cfg: RunConfig, tokenizer) -> None:
        self.cfg, self.tok = cfg, tokenizer
        self.vocab_size = len(tokenizer)
        self.max_new = cfg.sampling.max_tokens
        self.timeout = cfg.task.reward_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self.malformed: list[str] = []

    def question(self, group_id: int) -> str:
        raise NotImplementedError

    def score(self, group_id: int, text: str) -> float:
        raise NotImplementedError

    def messages(self, group_id: int) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.cfg.task.system_prompt}] if self.cfg.task.system_prompt else []
        q, hint = self.question(group_id), self.cfg.task.answer_hint
        msgs.append({"role": "user", "content": f"{q}\n{hint}" if hint else q})
        return msgs

    def _chat(self, msgs: list[dict], generation_prompt: bool, tools: list | None = None) -> list[int]:
        ids = self.tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=generation_prompt, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def chat_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """An agent's first chat call as the prompt's tokens: the chat template (with ``tools``, written into
        the system prompt in the Hermes format where the template does not render them: data/tool_calls.py)
        and the next assistant turn's header; without a template, the contents on lines of their own."""
        template = getattr(self.tok, "chat_template", None)
        if native(template):
            return self._chat(messages, True, tools)
        messages = to_template(messages, tools, first=True)
        if template:
            return self._chat(messages, True)
        return self.tok("\n".join(m["content"] for m in messages) + "\n")["input_ids"]

    def encode(self, text: str, first: bool = False) -> list[int]:
        """A text completion's prompt (``first``: special tokens as the tokenizer adds them) or the text that
        extends an episode, as tokens."""
        return self.tok(text, add_special_tokens=first)["input_ids"]

    def prompt(self, group_id: int) -> list[int]:
        msgs = self.messages(group_id)
        if getattr(self.tok, "chat_template", None):
            return self._chat(msgs, True)
        return self.tok(msgs[-1]["content"])["input_ids"]

    def max_tokens(self, traj_id: int, turn: int = 0) -> int:
        return self.max_new

    # -- multi-turn episodes (dora_hpc/envs/) ------------------------------------------------------------
    def decode_turn(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)

    def render_env(self, messages: list[dict[str, str]], last_token: int) -> list[int]:
        """The environment's messages as the tokens that follow the model's turn (which ended with
        ``last_token``): the end of that turn as the chat template writes it (what the model did not sample),
        then the messages, then the next assistant turn's header. Only these are tokenized; the model's own
        tokens are kept as sampled. Tool results (``role: tool``) are written as the Hermes format's
        ``<tool_response>`` blocks where the template does not render them."""
        if not native(getattr(self.tok, "chat_template", None)):
            messages = to_template(messages, None, first=False)
        if not getattr(self.tok, "chat_template", None):
            return self.tok("\n" + "\n".join(m["content"] for m in messages) + "\n",
                            add_special_tokens=False)["input_ids"]
        base = [{"role": "user", "content": "q"}]
        head = self._chat(base, True)
        turn = self._chat([*base, {"role": "assistant", "content": "a"}], False)
        body = self.tok("a", add_special_tokens=False)["input_ids"]
        end = turn[len(head) + len(body):] if turn[:len(head) + len(body)] == head + body else [
            *self.tok.convert_tokens_to_ids([self.tok.eos_token])]
        if end and end[0] == last_token:  # the model ended its turn itself: the rest of the turn's end
            end = end[1:]
        whole = self._chat([*base, {"role": "assistant", "content": "a"}, *messages], True)
        return end + whole[len(turn):]

    def score_text(self, group_id: int, text: str) -> float:
        return self.score(group_id, text)

    def safe_reward(self, group_id: int, response: list[int]) -> tuple[float, str]:
        text = self.tok.decode(response, skip_special_tokens=True)
        fut = self._pool.submit(self.score, group_id, text)
        try:
            return float(fut.result(timeout=self.timeout)), ""
        except FutureTimeout:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")  # abandon the stuck one
            return 0.0, f"reward timed out after {self.timeout}s"
        except Exception as e:  # noqa: BLE001 - a scorer may raise anything
            return 0.0, f"{type(e).__name__}: {e}"


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str, fallback: str = "last_line") -> str:
    """The last ``<answer>...</answer>`` span; without one, the last line (or ``fallback="last_number"``:
    the last number, for tasks whose answer is one)."""
    start, end = text.rfind("<answer>"), text.rfind("</answer>")
    if start != -1 and end > start:
        return text[start + len("<answer>"):end].strip()
    if fallback == "last_number":
        found = NUMBER.findall(text)
        return found[-1] if found else ""
    return text.strip().splitlines()[-1].strip() if text.strip() else ""


class ReasoningGymTask(TextTask):
    """A reasoning-gym generator (``task.dataset``), scored by the generator's own score_answer."""

    name = "reasoning_gym"

    def __init__(self, cfg: RunConfig, tokenizer) -> None:
        super().__init__(cfg, tokenizer)
        import reasoning_gym

        try:
            self.ds = reasoning_gym.create_dataset(cfg.task.dataset, size=cfg.task.size, seed=cfg.seed,
                                                   **cfg.task.dataset_args)
        except (TypeError, ValueError, AssertionError) as e:  # an unknown generator or setting
            raise ValueError(f"task.dataset={cfg.task.dataset!r} with task.dataset_args={cfg.task.dataset_args}: "
                             f"{type(e).__name__}: {e}") from None

    def question(self, group_id: int) -> str:
        return self.ds[group_id % len(self.ds)]["question"]

    def ground_truth(self, group_id: int) -> str:
        return str(self.ds[group_id % len(self.ds)]["answer"])

    def score(self, group_id: int, text: str) -> float:
        entry = self.ds[group_id % len(self.ds)]
        return float(self.ds.score_answer(answer=extract_answer(text, self.cfg.task.answer_from), entry=entry))


def _read_rows(path: Path):
    """(where, row dict or the Exception that made it unreadable) for each row of a .jsonl or .parquet file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
            raise ValueError(f"task.path: {path} is not a readable parquet file ({e})") from None
        for n, row in enumerate(table.to_pylist()):
            yield f"{path}:row {n}", row
        return
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{n}", e


class JsonlTask(TextTask):
    """User prompts from a .jsonl or .parquet file (by suffix) with ``question_field``/``answer_field``,
    scored by math-verify. Rows that lack a field (or hold null) are skipped and recorded, never fatal."""

    name = "jsonl"

    def __init__(self, cfg: RunConfig, tokenizer) -> None:
        super().__init__(cfg, tokenizer)
        path = Path(cfg.task.path or "")
        if not path.is_file():
            raise ValueError(f"task.path: prompt file {path} does not exist")
        qf, af = cfg.task.question_field, cfg.task.answer_field
        self.rows: list[tuple[str, str]] = []
        for where, row in _read_rows(path):
            if isinstance(row, Exception):
                self.malformed.append(f"{where}: {type(row).__name__}: {row}")
                continue
            try:
                if row[qf] is None or row[af] is None:
                    raise ValueError(f"{qf!r} or {af!r} is null")
                self.rows.append((str(row[qf]), str(row[af])))
            except (KeyError, TypeError, ValueError) as e:
                self.malformed.append(f"{where}: {type(e).__name__}: {e}")
        if not self.rows:
            raise ValueError(f"task.path: {path} has no valid row with fields {qf!r} and {af!r}")

    def question(self, group_id: int) -> str:
        return self.rows[group_id % len(self.rows)][0]

    def ground_truth(self, group_id: int) -> str:
        return self.rows[group_id % len(self.rows)][1]

    def score(self, group_id: int, text: str) -> float:
        from math_verify import parse, verify

        gold = parse(self.rows[group_id % len(self.rows)][1], parsing_timeout=None)
        pred = parse(extract_answer(text, self.cfg.task.answer_from), parsing_timeout=None)
        return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
