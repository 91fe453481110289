"""KV migration for the vLLM backend: a KV connector of ours, for an instance of one or more TP workers.

Export reads a live request's KV straight out of vLLM's paged cache on every tensor-parallel worker
(``collective_rpc(read_kv)``: the blocks its scheduler gave the request, whole blocks only; each worker
holds its share of the KV heads), giving ``[tp, layers, blocks, ...]`` on the host. Import parks that
tensor with the scheduler half of this connector (in this process: the engine core runs in-process)
and re-adds the request with all its tokens; the scheduler half tells vLLM those tokens are computed
externally and, once vLLM has given the request blocks, hands each worker the KV in the step's
connector metadata, which vLLM ships to its workers (in-process, or to worker processes when the
instance is tensor-parallel); the worker half writes its shard into the allocated blocks at the start
of that forward pass. Between instances (and nodes) the KV travels over the runtime's data plane.

Invariants:
* only whole blocks move, and never the last token (vLLM computes at least one token of a request to
  get its next logits): the tail of 1 to block_size tokens is recomputed at the destination, and
  counted as re-prefill by the engine;
* a pending import is consumed exactly once, by the step that first gives the request blocks; if vLLM
  cannot give it blocks yet, the scheduler asks again later and the KV is still here;
* with vLLM's prefix caching the blocks vLLM found cached (``num_computed_tokens``, whole blocks) are
  not written: the carried KV goes into the request's blocks after them only;
* both instances run the same model with the same block size and tensor-parallel size, so a worker's
  block is copied as-is, whatever the attention backend's layout (the block index is dim 0, or dim 1
  for [2, blocks, ...] layouts); a KV of another TP size is refused before it is parked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

PENDING: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}  # engine_id -> request id -> (KV, tokens)


def external_id(request_id: str) -> str:
    """vLLM appends '-<8 chars>' to the id a request was added with."""
    return request_id.rsplit("-", 1)[0]


def block_dim(cache: torch.Tensor, num_blocks: int) -> int:
    return 0 if cache.shape[0] == num_blocks else 1


def layer_caches(layers: dict) -> list[torch.Tensor]:
    """The paged KV cache of every attention layer, in the model's layer order (a forward context's
    ``no_compile_layers`` or a config's ``static_forward_context``)."""
    return [c for layer in layers.values() if isinstance(c := getattr(layer, "kv_cache", None), torch.Tensor)]


def read_blocks(caches: list[torch.Tensor], block_ids: list[int], num_blocks: int) -> torch.Tensor:
    """[layers, blocks, ...] on the host: a copy of those blocks of every layer."""
    out = []
    for cache in caches:
        d = block_dim(cache, num_blocks)
        idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        out.append(cache.index_select(d, idx).movedim(d, 0).to("cpu", copy=True))
    return torch.stack(out)


def read_kv(worker, block_ids: list[int], num_blocks: int) -> torch.Tensor:
    """Run on every worker by ``collective_rpc``: its share of those blocks, [layers, blocks, ...]."""
    return read_blocks(layer_caches(worker.vllm_config.compilation_config.static_forward_context), block_ids,
                       num_blocks)


def write_blocks(caches: list[torch.Tensor], block_ids: list[int], kv: torch.Tensor, num_blocks: int) -> None:
    if kv.shape[0] != len(caches):
        raise ValueError(f"KV of {kv.shape[0]} layers for a model of {len(caches)}")
    idx = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    for layer, cache in zip(kv, caches, strict=True):
        d = block_dim(cache, num_blocks)
        cache.index_copy_(d, idx, layer.movedim(0, d).to(cache))


@dataclass
class LoadMeta(KVConnectorMetadata):
    num_blocks: int = 0
    loads: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # (destination blocks, [tp, ...] KV)


class DoraKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.engine_id = self._kv_transfer_config.engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.allocated: dict[str, tuple[int, list[int]]] = {}  # scheduler side: imports that got blocks
        #   this step: (the first carried block to write, the blocks it goes to)
        self.cached: dict[str, int] = {}  # scheduler side: blocks vLLM's prefix cache gave an import
        PENDING.setdefault(self.engine_id, {})

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off when a request finishes

    # -- worker side -------------------------------------------------------------------------------
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, LoadMeta) or not meta.loads:
            return
        from vllm.distributed import get_tensor_model_parallel_rank

        caches = layer_caches(forward_context.no_compile_layers)
        rank = get_tensor_model_parallel_rank()
        for blocks, kv in meta.loads:
            write_blocks(caches, blocks, kv[rank], meta.num_blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # export reads the paged cache directly, outside a forward pass

    def wait_for_save(self) -> None:
        return

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        req = external_id(request.request_id)
        got = PENDING[self.engine_id].get(req)
        if got is not None and got[1] <= num_computed_tokens:  # vLLM's cache holds all it carries: drop it
            PENDING[self.engine_id].pop(req)
            self.cached.pop(req, None)
        if got is None or got[1] <= num_computed_tokens:
            return 0, False
        self.cached[req] = num_computed_tokens // self.block_size
        return got[1] - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            req = external_id(request.request_id)
            n = PENDING[self.engine_id][req][1] // self.block_size
            first = self.cached.pop(req, 0)
            self.allocated[req] = (first, list(blocks.get_block_ids()[0][first:n]))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        pending = PENDING[self.engine_id]
        got = [(first, blocks, pending.pop(req, None)) for req, (first, blocks) in self.allocated.items()]
        self.allocated = {}
        return LoadMeta(num_blocks=self.num_blocks, loads=[(blocks, kv[0][:, :, first:]) for first, blocks, kv in got
                                                          if kv is not None])
