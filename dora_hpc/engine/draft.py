"""Drafts for speculative decoding, taken from text the run already holds: no draft model.

A draft continues the longest n-gram match (``MAX_NGRAM`` tokens down to ``MIN_NGRAM``) of a request's last
tokens in a corpus of token texts, token by token with what most of the match's occurrences continue with
(while they agree enough: ``MIN_PATH_P``):
* ``ngram``: the request's own prompt and response (prompt-lookup decoding, as vLLM's n-gram drafter);
* ``group``: also the responses that answer the same prompt on this engine -- the group's siblings, live
  (their tokens as they are decoded) or finished, and the prompt's earlier responses (an earlier epoch's),
  up to ``HISTORY`` a prompt and version: the request's own version's texts first, other versions' only
  where those match nothing.

Invariants:
* a draft is only a proposal: the engine verifies every drafted token under the request's version
  (engine.py ``_accept``), so where a draft came from never changes a trajectory's tokens, version or
  logprobs -- only how many tokens a forward makes;
* the corpus of a prompt holds at most ``HISTORY`` finished texts a version and the engine keeps at most
  ``PROMPTS`` prompts' corpora (least recently used out), so memory is bounded over any run;
* a draft never runs past what its source holds: it is the source's next tokens, at most ``k``;
* a step drafts at most ``Budget.limit`` tokens a sequence: the draft length that makes the most tokens a
  second by the engine's own measurements (its steps' seconds against their tokens, its drafts' acceptance).
"""

from __future__ import annotations

import collections

import numpy as np

MAX_NGRAM, MIN_NGRAM = 4, 2   # the longest match tried first; a single token matches too often to pay
MAX_OCCURRENCES = 32          # the latest occurrences of an n-gram a text contributes to a draft
MIN_PATH_P = 0.3              # a draft stops where the share of occurrences agreeing on its path falls below
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
        """A draft of at most ``min(k, draft_tokens)`` tokens for a tracked request; [] when nothing matches.
        The longest n-gram of its last tokens (``MAX_NGRAM`` down to ``MIN_NGRAM``) that occurs in its own
        version's texts (or, failing every n, in other versions'), then the tokens most of those occurrences
        continue with, one at a time, while the share of occurrences that agree keeps the path's estimated
        probability at ``MIN_PATH_P`` or more."""
        own = self.own.get(req_id)
        k = min(k, self.k)
        if own is None or k <= 0:
            return []
        toks = own.tokens
        for tier in self._tiers(req_id, own):
            for n in range(min(MAX_NGRAM, len(toks)), MIN_NGRAM - 1, -1):
                gram = tuple(toks[-n:])
                occ = [(t.tokens, e) for t, before in tier for e in t.ends.get(gram, ())[-MAX_OCCURRENCES:]
                       if e < (len(t.tokens) if before is None else before)]
                if occ:
                    return walk(occ, k)
        return []

    def _tiers(self, req_id: int, own: Text):
        """The texts a request's draft may come from, as (text, end bound) in tiers tried in turn: its own
        version's (its own text, an occurrence ending before its last token; its live siblings'; its prompt's
        finished responses), then other versions' finished responses of its prompt (``group`` only)."""
        mine: list[tuple[Text, int | None]] = [(own, len(own.tokens))]
        if self.method != "group":
            yield mine
            return
        key, version = self.live[req_id]
        mine += [(self.own[r], None) for r in self.siblings[key, version] if r != req_id]
        texts = self.done.get(key, {})
        mine += [(t, None) for t in texts.get(version, ())]
        yield mine
        yield [(t, None) for v in sorted(texts, reverse=True) if v != version for t in texts[v]]


def walk(occ: list[tuple[list[int], int]], k: int) -> list[int]:
    """Up to ``k`` tokens continuing the occurrences (text, end): each the token most of those still agreeing
    continue with, while the product of those majorities' shares stays at ``MIN_PATH_P`` or more."""
    draft: list[int] = []
    p = 1.0
    while len(draft) < k:
        nxt = collections.Counter(t[e] for t, e in occ if e < len(t))
        if not nxt:
            break
        tok, c = nxt.most_common(1)[0]
        p *= c / len(occ)
        if p < MIN_PATH_P:
            break
        draft.append(tok)
        occ = [(t, e + 1) for t, e in occ if e < len(t) and t[e] == tok]
    return draft


class Budget:
    """How long a step's drafts may be: the length g in 0..k that maximises the expected tokens a second of a
    decode batch of n, tau(g) / (c0 + c1 * n * (1 + g)), where tau(g) = (1 - a^(g+1)) / (1 - a) is the expected
    tokens a verify makes at acceptance a per drafted token (i.i.d., Leviathan et al. 2023), and c0 + c1 * tokens
    the engine's step time, least squares over its last ``WINDOW`` steps. It drafts fully until ``WARMUP`` steps
    are measured, and every ``EXPLORE``-th step whatever the fit says, so both figures stay current."""

    WINDOW, WARMUP, EXPLORE, REFIT = 128, 16, 16, 8

    def __init__(self, k: int) -> None:
        self.k = k
        self.drafted, self.accepted = 4.0, 2.0   # a weak prior: acceptance 0.5
        self.steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.WINDOW)
        self.calls, self.seen, self._fit = 0, 0, None  # the fit is redone every REFIT steps measured

    def observe(self, tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        """A step computed ``tokens`` tokens in ``seconds``; its drafts proposed ``drafted``, ``accepted`` kept."""
        self.steps.append((tokens, seconds))
        self.seen += 1
        decay = 0.98 ** max(drafted, 1)  # acceptance over about the last 50 drafted tokens
        self.drafted, self.accepted = self.drafted * decay + drafted, self.accepted * decay + accepted

    @property
    def acceptance(self) -> float:
        return min(self.accepted / self.drafted, 0.999)

    def fit(self) -> tuple[float, float] | None:
        """(c0, c1) of seconds = c0 + c1 * tokens over the window, c1 >= 0, as of the last multiple of ``REFIT``
        steps measured; None before ``WARMUP`` steps or while every step had the same token count."""
        if len(self.steps) < self.WARMUP:
            return None
        if self._fit is None or self.seen % self.REFIT == 0:
            self._fit = (self._solve(),)
        return self._fit[0]

    def _solve(self) -> tuple[float, float] | None:
        x, y = np.array(self.steps, dtype=float).T
        if np.ptp(x) == 0:
            return None
        c1, c0 = np.polyfit(x, y, 1)
        c1 = max(float(c1), 0.0)
        return max(float(np.mean(y - c1 * x)), 1e-9), c1

    def limit(self, n: int) -> int:
        """The draft length for a step of ``n`` decoding sequences."""
        self.calls += 1
        fit = self.fit()
        if fit is None or self.calls % self.EXPLORE == 0:
            return self.k
        c0, c1 = fit
        a = self.acceptance
        rate = [(1 - a ** (g + 1)) / (1 - a) / (c0 + c1 * n * (1 + g)) for g in range(self.k + 1)]
        return int(np.argmax(rate))
