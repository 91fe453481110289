"""The one interface every rollout backend implements: the built-in engine (engine.py) and vLLM (vllm.py).

Invariant: nothing outside a backend imports the backend's library; the runtime talks to this.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .engine import Finished
from .sampling import SamplingParams


class RolloutEngine(Protocol):
    version: int
    max_num_seqs: int

    @property
    def versions(self) -> set[int]:
        """Every version a request may be tagged with here (one, but several when versions are adapters)."""

    def retire(self, version: int) -> None:
        """Stop hosting ``version`` (versions as adapters); no request of it is live."""

    def add(self, req_id: int, prompt: list[int], params: SamplingParams, version: int, hold: bool = False) -> None:
        """Queue a request tagged ``version``; raises RequestError for another version or a bad request.
        ``hold``: a multi-turn episode, whose KV stays between turns (the built-in engine only)."""

    def extend(self, req_id: int, tokens: list[int], max_tokens: int) -> None:
        """A held episode's next turn: the environment's ``tokens`` join its context (counted in
        ``stats()['env_prefill_tokens']``), then up to ``max_tokens`` are sampled."""

    def step(self) -> list[Finished]:
        """Run one engine step; returns the requests that finished in it."""

    def has_work(self) -> bool: ...

    def has_request(self, req_id: int) -> bool: ...

    def progress(self, req_id: int) -> tuple[int, int]:
        """(prompt tokens, generated tokens) of a live request."""

    def abort(self, req_id: int) -> None: ...

    def export(self, req_id: int) -> tuple[dict, torch.Tensor | None]:
        """Remove a request; (plain-data metadata with ``n_cached``, the tokens its KV covers, and that KV:
        the built-in engine's [layers, 2, tokens, kv_heads, head_dim], vLLM's whole blocks
        [layers, blocks, ...]; None when there is none to hand out)."""

    def import_(self, meta: dict, kv: torch.Tensor | None) -> None:
        """Continue an exported request here: with its KV, recomputing only what it does not cover (the
        built-in engine: nothing; vLLM: the tail past its last whole block), counted in
        ``stats()['reprefill_tokens']``; with None, by re-prefill of every token."""

    def offload(self, req_id: int) -> None: ...

    def restore(self, req_id: int) -> None: ...

    def load_weights(self, state: dict[str, torch.Tensor], version: int, keep_requests: bool = False,
                     add: bool = False) -> None:
        """Swap in ``version``'s weights (and wake a slept engine); ``add``: beside those hosted (adapters)."""

    def sleep(self) -> int:
        """Free the KV pool while the hosting trainer trains (cluster.elastic); returns the bytes freed."""

    def weights(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """A hosted version's weights (default the newest), Hugging Face names (served to peers, checksummed)."""

    def stats(self) -> dict: ...

    def close(self) -> None:
        """Release what the backend holds beyond this object (vLLM: its engine core, worker processes and
        distributed groups)."""


def make_engine(cfg, model_dir, borrowed: bool = False) -> RolloutEngine:
    """The configured backend for one rollout instance (``cfg`` is the RunConfig); version -1 until loaded.
    ``borrowed``: hosted on a trainer rank (cluster.elastic), so it must be able to sleep."""
    e = cfg.engine
    kw = dict(kv_blocks=e.kv_blocks, block_size=e.block_size, max_num_seqs=cfg.cluster.max_num_seqs,
              max_batched_tokens=e.max_batched_tokens, seed=cfg.seed, version=-1,
              min_step_time_s=e.step_time_s if e.pacing else 0.0,
              prefill_s_per_token=e.prefill_s_per_token if e.pacing else 0.0)
    if e.backend == "vllm":
        from .vllm import VllmEngine

        lo = cfg.train.lora  # every live version's adapter resident: the window's K + 1, and one being added
        return VllmEngine(model_dir, **kw, tensor_parallel=e.tensor_parallel, dtype=e.dtype,
                          gpu_memory_utilization=e.gpu_memory_utilization, sleepable=borrowed,
                          prefix_caching=e.prefix_caching, lora=lo and (lo.rank, lo.alpha, cfg.dora.k + 2))
    from .engine import Engine
    from .model import load_model

    lora = cfg.train.lora  # a version is an adapter (train/lora.py published_adapter)
    return Engine(load_model(model_dir, device=cfg.runtime.device), **kw, on_kv_full=e.on_kv_full,
                  prefix_caching=e.prefix_caching, lora_scale=lora.alpha / lora.rank if lora else None,
                  speculation=e.speculation.method, draft_tokens=e.speculation.draft_tokens)
