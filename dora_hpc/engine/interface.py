"""The one interface every rollout backend implements (built-in engine; vLLM next).

Invariant: nothing outside a backend imports the backend's library; the runtime talks to this.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .engine import Finished
from .sampling import SamplingParams


class RolloutEngine(Protocol):
    version: int

    def add(self, req_id: int, prompt: list[int], params: SamplingParams, version: int) -> None:
        """Queue a request tagged ``version``; raises RequestError for another version or a bad request."""

    def step(self) -> list[Finished]:
        """Run one engine step; returns the requests that finished in it."""

    def has_work(self) -> bool: ...

    def abort(self, req_id: int) -> None: ...

    def export(self, req_id: int) -> tuple[dict, torch.Tensor]:
        """Remove a request; (plain-data metadata, KV [layers, 2, tokens, kv_heads, head_dim])."""

    def import_(self, meta: dict, kv: torch.Tensor) -> None:
        """Continue an exported request here with zero re-prefill."""

    def offload(self, req_id: int) -> None: ...

    def restore(self, req_id: int) -> None: ...

    def load_weights(self, state: dict[str, torch.Tensor], version: int, keep_requests: bool = False) -> None: ...

    def stats(self) -> dict: ...
