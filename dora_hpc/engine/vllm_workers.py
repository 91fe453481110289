"""What the vLLM backend (engine/vllm.py) runs on each of an instance's vLLM workers through
``collective_rpc`` (reloading weights, refreshing the LM head after a reload, freeing and re-allocating the
KV cache of a borrowed instance), the model-config figures it sizes the KV cache with, and the shutdown of an
in-process engine core that leaves this process's other engine cores working."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch


def kv_bytes_per_token(model_dir: Path, dtype: str = "float32") -> int:
    """KV bytes one token takes in the whole instance (all TP workers together)."""
    c = hf_config(model_dir)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * getattr(torch, dtype).itemsize


def reload(llm, state: dict[str, torch.Tensor], tensor_parallel: int) -> None:
    """Swap an instance's weights in place, then refresh its LM head. A single worker (in this process)
    takes the tensors as they are. Worker processes (tensor parallel) get only a file name: the weights are
    written once to shared memory (``/dev/shm`` when it has room) and each worker maps that file, so vLLM's
    loader copies each worker's slice of a tensor straight from the mapping and no worker is sent, or
    copies, a whole tensor. (A slice along dim 1 still reads across a row-major tensor's pages.)"""
    if tensor_parallel == 1:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
    else:
        need = sum(t.numel() * t.element_size() for t in state.values())
        shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * need
        fd, path = tempfile.mkstemp(suffix=".pt", prefix="dora-weights-", dir="/dev/shm" if shm else None)
        os.close(fd)
        try:
            torch.save(state, path)
            llm.collective_rpc(reload_from_file, args=(path,))
        finally:
            os.unlink(path)
    llm.collective_rpc(refresh_lm_head)


def reload_from_file(worker, path: str) -> None:
    """Run on every tensor-parallel worker: load new weights from a file mapped, not read, into memory."""
    state = torch.load(path, mmap=True, weights_only=True)
    worker.reload_weights(weights_iterator=iter(state.items()))


def refresh_lm_head(worker) -> None:
    """Run on every worker after a weight reload. vLLM's CPU build packs the LM head's weight for its
    GEMM when the model loads; a reload refreshes the layers it loads, but a tied LM head loads nothing
    (it shares the embedding), so its packed copy kept the first weights. Packing it again fixes that
    (GPUs read the shared weight directly and have nothing to refresh)."""
    from vllm.platforms import current_platform

    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if current_platform.is_cpu() and head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _kv_storages(worker) -> list[torch.UntypedStorage]:
    """The backing buffers of a worker's paged KV cache (each layer's cache is a view of one)."""
    from .vllm_kv import layer_caches

    seen: dict[int, torch.UntypedStorage] = {}
    for cache in layer_caches(worker.vllm_config.compilation_config.static_forward_context):
        st = cache.untyped_storage()
        seen.setdefault(st.data_ptr(), st)
    return list(seen.values())


def free_kv_cache(worker) -> int:
    """Run on every worker by ``collective_rpc`` where vLLM has no sleep mode: release the KV cache's
    memory (the views keep their shapes; nothing may read them until ``allocate_kv_cache``)."""
    worker.dora_kv_sizes = [(st, st.nbytes()) for st in _kv_storages(worker)]
    for st, _ in worker.dora_kv_sizes:
        st.resize_(0)
    return sum(n for _, n in worker.dora_kv_sizes)


def allocate_kv_cache(worker) -> None:
    """Undo ``free_kv_cache``: the same buffers, re-allocated and zeroed (as vLLM allocates them)."""
    for st, n in worker.dora_kv_sizes:
        st.resize_(n)
        st.fill_(0)
    worker.dora_kv_sizes = []


def hf_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


_open_cores = 0  # in-process vLLM engine cores open in this process


def own_shutdown(client) -> weakref.finalize:
    """Take over the shutdown of an in-process engine client (``LLMEngine.engine_core``); returns the finalizer
    that shuts it down, once, when called or when the client is collected.

    vLLM keeps two things process-wide that every in-process engine core here uses: the parallel groups, which
    ``EngineCore.shutdown`` destroys, and the worker-side KV connector, which an in-process worker's shutdown
    ends. Closing (or collecting) one instance with vLLM's own shutdown broke every other: the next step failed
    ("pipeline model parallel group is not initialized"), or migrated KV silently never loaded. Here only the
    process's last open core shuts down as vLLM does; an earlier one stops its scheduler and any worker
    processes of its own (a tensor-parallel instance's) and leaves the in-process worker to the collector."""
    global _open_cores
    _open_cores += 1
    client._finalizer.detach()
    client._finalizer = weakref.finalize(client, _shutdown, client.engine_core)
    return client._finalizer


def _shutdown(core) -> None:
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    global _open_cores
    _open_cores -= 1
    if _open_cores == 0:
        core.shutdown()
        return
    core.structured_output_manager.clear_backend()
    if not isinstance(core.model_executor, UniProcExecutor):
        core.model_executor.shutdown()
    core.scheduler.shutdown()
    gc.unfreeze()
