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


def sample(logits: torch.Tensor, params: SamplingParams, u: float) -> tuple[int, float]:
    """Sample one token from fp32 ``logits`` [vocab] by inverse CDF with uniform ``u``.

    Returns (token, logprob), the logprob under the temperature-scaled distribution before top-p
    (the behaviour policy a PPO/GRPO ratio divides by). Temperature 0 is greedy.
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs, order = torch.sort(logp.exp(), descending=True)
    cdf = torch.cumsum(probs, dim=0)
    if params.top_p < 1.0:
        keep = int(torch.searchsorted(cdf, torch.tensor(params.top_p, dtype=cdf.dtype))) + 1
        cdf = cdf[:keep]
    idx = int(torch.searchsorted(cdf, torch.tensor(u * float(cdf[-1]), dtype=cdf.dtype), right=True))
    tok = int(order[min(idx, cdf.numel() - 1)])
    return tok, float(logp[tok])
