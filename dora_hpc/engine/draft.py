"""Drafts for speculative decoding, taken from text the run already holds: no draft model.

A draft is the continuation of the longest recent n-gram match (``MAX_NGRAM`` tokens down to ``MIN_NGRAM``)
of a request's last tokens in a corpus of token texts:
* ``ngram``: the request's own prompt and response (prompt-lookup decoding, as vLLM's n-gram drafter);
* ``group``: also the responses that answer the same prompt on this engine -- the group's siblings, live
  (their tokens as they are decoded) or finished, and the prompt's earlier responses (an earlier epoch's),
  up to ``HISTORY`` a prompt, the request's own version's text first.

Invariants:
* a draft is only a proposal: the engine verifies every drafted token under the request's version
  (engine.py ``_accept``), so where a draft came from never changes a trajectory's tokens, version or
  logprobs -- only how many tokens a forward makes;
* the corpus of a prompt holds at most ``HISTORY`` finished texts a version and the engine keeps at most
  ``PROMPTS`` prompts' corpora (least recently used out), so memory is bounded over any run;
* a draft never runs past what its source holds: it is the source's next tokens, at most ``k``.
"""

from __future__ import annotations

import collections

MAX_NGRAM, MIN_NGRAM = 4, 2   # the longest match tried first; a single token matches too often to pay
HISTORY = 16                  # finished texts kept per prompt and version
PROMPTS = 4096                # prompts whose corpora an engine keeps
METHODS = ("none", "ngram", "group")


class Text:
    """One token text and its n-gram index: n-gram -> the end positions where it occurs, latest last."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens or [])

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self.ends.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def follow(self, gram: tuple[int, ...], k: int, before: int | None = None) -> list[int]:
        """Up to ``k`` tokens after the latest occurrence of ``gram`` that ends before ``before`` and has a
        continuation; [] when there is none."""
        for end in reversed(self.ends.get(gram, ())):
            if end < (len(self.tokens) if before is None else before):
                return self.tokens[end:end + k]
        return []


class Drafter:
    """The drafts of one engine: each live request's own text, and by prompt the texts that answer it."""

    def __init__(self, method: str, draft_tokens: int) -> None:
        if method not in METHODS or method == "none":
            raise ValueError(f"speculation method must be one of {METHODS[1:]}, not {method!r}")
        self.method, self.k = method, draft_tokens
        self.own: dict[int, Text] = {}                  # req_id -> prompt + response so far
        self.live: dict[int, tuple[int, int]] = {}      # req_id -> (prompt key, version)
        self.siblings: dict[tuple[int, int], set[int]] = {}  # (prompt key, version) -> live req_ids
        self.done: collections.OrderedDict[int, dict[int, collections.deque[Text]]] = collections.OrderedDict()

    def track(self, req_id: int, prompt: list[int], response: list[int], version: int) -> None:
        """Start drafting for a request (new, imported or restarted): its text so far."""
        self.forget(req_id)
        self.own[req_id] = Text(prompt + response)
        self.live[req_id] = key = (hash(tuple(prompt)), version)
        self.siblings.setdefault(key, set()).add(req_id)

    def grow(self, req_id: int, tokens: list[int]) -> None:
        """Tokens appended to a tracked request (sampled, or an environment's)."""
        if req_id in self.own:
            self.own[req_id].extend(tokens)

    def finish(self, req_id: int, prompt_len: int) -> None:
        """A request left the engine having ended: its response joins its prompt's history."""
        own, (key, version) = self.own.get(req_id), self.live.get(req_id, (None, None))
        self.forget(req_id)
        if own is None or self.method != "group":
            return
        texts = self.done.setdefault(key, {})
        self.done.move_to_end(key)
        texts.setdefault(version, collections.deque(maxlen=HISTORY)).append(Text(own.tokens[prompt_len:]))
        while len(self.done) > PROMPTS:
            self.done.popitem(last=False)

    def forget(self, req_id: int) -> None:
        """A request left without ending (aborted, exported): nothing of it is kept."""
        self.own.pop(req_id, None)
        if (key := self.live.pop(req_id, None)) is not None:
            self.siblings[key].discard(req_id)
            if not self.siblings[key]:
                del self.siblings[key]

    def propose(self, req_id: int, k: int) -> list[int]:
        """A draft of at most ``min(k, draft_tokens)`` tokens for a tracked request; [] when nothing matches."""
        own = self.own.get(req_id)
        k = min(k, self.k)
        if own is None or k <= 0:
            return []
        toks = own.tokens
        for n in range(min(MAX_NGRAM, len(toks)), MIN_NGRAM - 1, -1):
            gram = tuple(toks[-n:])
            for text, before in self._sources(req_id, own):
                if draft := text.follow(gram, k, before):
                    return draft
        return []

    def _sources(self, req_id: int, own: Text):
        """Where a request's draft may come from, best first: its live siblings' texts and its prompt's
        finished ones under its version, then under other versions (newest first), then its own text (an
        occurrence ending before its last token)."""
        if self.method == "group":
            key, version = self.live[req_id]
            yield from ((self.own[r], None) for r in self.siblings[key, version] if r != req_id)
            texts = self.done.get(key, {})
            for v in sorted(texts, key=lambda v: (v != version, -v)):
                yield from ((t, None) for t in reversed(texts[v]))
        yield own, len(own.tokens)
