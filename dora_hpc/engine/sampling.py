"""Sampling with reproducible noise: the random number behind token ``pos`` of request ``req_id``
is a pure function of (run seed, req_id, pos).

Invariant: given the same logits, a request samples the same token wherever it runs -- on its first
instance or after migrating to another one -- and in whatever batch it shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1:
            raise ValueError(f"bad sampling params {self}: need temperature >= 0, 0 < top_p <= 1, max_tokens >= 1")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, req_id: int, pos: int) -> float:
    """A uniform number in [0, 1) determined by (seed, req_id, pos) only."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ (req_id & _MASK)) ^ (pos & _MASK))
    return (h >> 11) * (1.0 / (1 << 53))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], us: list[float]) -> tuple[list[int], list[float]]:
    """Sample one token per row of fp32 ``logits`` [B, vocab] by inverse CDF with uniforms ``us``.

    Returns (tokens, logprobs), each logprob under that row's temperature-scaled distribution
    before top-p (the behaviour policy a PPO/GRPO ratio divides by). Temperature 0 is greedy.
    Every operation is row-wise, so a row's result does not depend on the other rows.
    """
    temp = torch.tensor([p.temperature or 1.0 for p in params], dtype=logits.dtype)[:, None]
    logp = torch.log_softmax(logits / temp, dim=-1)
    probs = logp.exp()
    # rows without top-p sample over the vocabulary in token order (no sort needed); rows with
    # top-p over tokens sorted by probability. Either way a row's order depends on that row only.
    order = torch.arange(probs.shape[1]).expand_as(probs).clone()
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        probs[nucleus], order[nucleus] = torch.sort(probs[nucleus], dim=-1, descending=True)
    cdf = torch.cumsum(probs, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=cdf.dtype)[:, None]
    keep = torch.full((len(params), 1), cdf.shape[1])
    if nucleus:
        keep[nucleus] = (torch.searchsorted(cdf[nucleus], top_p[nucleus]) + 1).clamp(max=cdf.shape[1])
    total = cdf.gather(1, keep - 1)
    u = torch.tensor(us, dtype=cdf.dtype)[:, None]
    idx = torch.minimum(torch.searchsorted(cdf, u * total, right=True), keep - 1)
    toks = order.gather(1, idx)[:, 0]
    greedy = torch.tensor([p.temperature == 0 for p in params])
    toks = torch.where(greedy, logits.argmax(-1), toks)
    return toks.tolist(), logp.gather(1, toks[:, None])[:, 0].tolist()


def sample(logits: torch.Tensor, params: SamplingParams, u: float) -> tuple[int, float]:
    """One row of sample_batch."""
    toks, lps = sample_batch(logits[None], [params], [u])
    return toks[0], lps[0]
