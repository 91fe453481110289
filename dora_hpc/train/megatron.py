"""megatron-core trainer backend: the policy as megatron-core's GPTModel (local layer spec: no
TransformerEngine needed), tensor-parallel over groups of trainer ranks, converted from and to Hugging Face
weights by ``mbridge`` (Qwen2 and Llama families).

Invariants:
* the trainer ranks form TP groups of ``tensor_parallel`` consecutive ranks (megatron's parallel_state);
  a TP group is one data shard: each of its ranks receives its own groups (routing is unchanged) and the
  group trains on their union (``gather_batch``), so every TP rank runs the same micro-batches; the
  gradients of the TP groups (data-parallel replicas) are summed like the replicated backend's; under
  fault-tolerant replicas (``train.replicas``, train/ft.py) a replica group is one TP group, and each rank's
  gradient shards are summed with the same rank's of the other groups (``sum_shards_``);
* logits are gathered over the vocabulary (``parallel_output=False``), so the objective is the same code
  for every backend; its backward splits the gradient back to the vocab shards;
* sequence parallelism is off, so parameters that are not TP-sharded (norms) get identical gradients on
  every TP rank; the gradient norm counts each sharded parameter's shards once and each replicated one once;
* ``full_state_dict`` and ``optimizer_state`` gather the TP shards and convert them to Hugging Face names
  and layouts (fused QKV and gate/up split back), so a checkpoint written under megatron resumes under
  torch or fsdp and back; ``load_*`` convert and split the other way;
* ``shard_state_dict`` converts one parameter at a time (gathered over its TP group) and keeps this rank's
  rows of it in the publish layout (megatron's own TP split does not map onto Hugging Face rows: a fused
  QKV interleaves the heads), so publishing never holds more than one whole parameter;
* on CPU (gloo) a few shims stand in for CUDA-only pieces: torch.cuda.current_device names the CPU, the
  model-parallel CUDA RNG tracker is a no-op (dropout is 0 in these models), activation recompute
  saves and restores only the CPU's RNG state, and fused kernels are off.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .backend import TrainBackend, check_fit, load_shard_local_state, shard_local_state
from .lora import LoraError, LoraSpec
from .publish import shard_of


def _cpu_shims() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    class NoRNGTracker:  # megatron forks a CUDA RNG state around dropout and TP-sharded init
        def fork(self, name: str = "model-parallel-rng"):
            return contextlib.nullcontext()

        def add(self, name: str, seed: int) -> None:
            pass

        def get_states(self) -> dict:
            return {}

        def set_states(self, states: dict) -> None:
            pass

        def reset(self) -> None:
            pass

        def is_initialized(self) -> bool:
            return True

    torch.cuda.current_device = lambda: "cpu"  # megatron places new tensors on the "current CUDA device"
    mrandom._CUDA_RNG_STATE_TRACKER = NoRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # activation recompute saves and restores RNG states: the CPU's is all there is
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def local_spec_bridge(hf_config):
    """mbridge's bridge for this HF model, adapted to megatron-core's local layer spec (separate norm
    modules instead of TransformerEngine's fused norm+linear), float32, no sequence parallelism."""
    import mbridge  # noqa: F401 - importing it registers the model bridges
    from mbridge.core.bridge import _MODEL_REGISTRY

    if hf_config.model_type not in ("qwen2", "llama"):
        raise ValueError(f"train.backend=megatron: model type {hf_config.model_type!r} is not supported "
                         "(qwen2, llama)")
    if not hasattr(hf_config, "rope_theta"):  # transformers 5 keeps it in rope_parameters
        hf_config.rope_theta = hf_config.rope_parameters["rope_theta"]
    base = _MODEL_REGISTRY[hf_config.model_type]

    class LocalSpecBridge(base):
        _MLP_MAPPING = {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
                        **base._MLP_MAPPING}
        _OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}

    bridge = LocalSpecBridge(hf_config, dtype=torch.float32)
    bridge.set_extra_args(sequence_parallel=False, use_cpu_initialization=not torch.cuda.is_available(),
                          masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                          bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                          persist_layer_norm=False)
    return bridge


class MegatronBackend(TrainBackend):
    def setup(self, model_dir: str | Path) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from transformers import AutoConfig

        dp = self.dp
        dp.ensure_process_group()
        # the trainer ranks, or a fault-tolerant replica group's (train/ft.py): config.py checks that it divides them
        self.tp = self.opts.tensor_parallel or dp.shard_size
        on_gpu = dp.collectives == "nccl"
        if not on_gpu:
            _cpu_shims()
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        if on_gpu:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(int(torch.initial_seed()) % (2**31))
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.dp_group = mpu.get_data_parallel_group()
        self.replicas = dist.get_world_size(self.dp_group)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.bridge = local_spec_bridge(self.hf_config)
        if self.opts.activation_checkpointing:  # megatron's full recompute, one layer per checkpoint
            self.bridge.set_extra_args(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

    def loaded(self) -> None:
        self.global_names = self.bridge._weight_name_mapping_mcore_local_to_global(self.model)
        self.params = dict(self.model.named_parameters())
        # each parameter's Hugging Face tensors (fused QKV and gate/up are several)
        self.hf_names = {n: self.bridge._weight_name_mapping_mcore_to_hf(self.global_names[n]) for n in self.params}

    def load(self, model_dir: str | Path, lora: LoraSpec | None = None) -> torch.nn.Module:
        if lora is not None:  # config.py refuses it first
            raise LoraError("train.lora is for the torch and fsdp backends")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        cfg, hf = self.bridge.config, self.hf_config
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
                             normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm),
                         vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
                         position_embedding_type="rope", rotary_base=hf.rope_theta,
                         share_embeddings_and_output_weights=hf.tie_word_embeddings, parallel_output=False)
        model.to(self.device)
        self.bridge.load_weights([model], str(model_dir))
        return model

    # -- the step ------------------------------------------------------------------------------------
    @property
    def counts_metrics(self) -> bool:
        return self.tp_rank == 0  # the TP ranks compute the same loss; one of them reports it

    def gather_batch(self, samples: list) -> list:
        if self.tp == 1:
            return samples
        import torch.distributed as dist

        shares: list = [None] * self.tp
        dist.all_gather_object(shares, samples, group=self.tp_group)
        return [s for share in shares for s in share]

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, reference: bool = False, keep: int = 0) -> torch.Tensor:
        """Right-padded batches: a causal mask keeps every real token's logits independent of the padding.
        GPTModel's output layer runs on every position; ``keep`` slices its result."""
        model = self.ref if reference else self.model
        b, n = ids.shape
        pos = torch.arange(n, device=self.device)[None].expand(b, -1)
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=self.device), 1)[None, None]
        out = model(ids.to(self.device), pos, causal)
        return (out[:, -keep:] if keep else out).float()

    def micro_batches(self, n_local: int) -> int:
        """TP peers hold the same union of samples; replicas (data-parallel) sum gradients after backward."""
        return n_local

    def finish_grads(self) -> None:
        """Sum over megatron's data-parallel groups; under fault-tolerant replicas (one TP group each) over the
        replica groups instead, each rank's TP shard with the same shard of the others (train/ft.py)."""
        if self.replicas > 1:
            self.dp.sum_grads_(self.parameters(), group=self.dp_group)
        params = self.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.dp.sum_shards_([p.grad for p in params])

    def local_state(self, opt: torch.optim.Optimizer) -> dict:
        return shard_local_state(self.model, opt)

    def load_local_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        load_shard_local_state(self.model, opt, state, self.device)

    def clip_grad_norm(self, max_norm: float) -> float:
        import torch.distributed as dist

        grads = [(p, p.grad) for p in self.parameters() if p.grad is not None]
        sharded = sum((g.float().norm() ** 2 for p, g in grads if getattr(p, "tensor_model_parallel", False)),
                      torch.zeros((), device=self.device))
        replicated = sum((g.float().norm() ** 2 for p, g in grads
                          if not getattr(p, "tensor_model_parallel", False)), torch.zeros((), device=self.device))
        if self.tp > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        total = float(torch.sqrt(sharded + replicated))
        coef = min(1.0, max_norm / (total + 1e-6))
        for _, g in grads:
            g.mul_(coef)
        return total

    # -- conversion to and from Hugging Face names -----------------------------------------------------
    def _to_hf(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors shaped like this rank's parameters (weights or optimizer moments) -> whole tensors under
        Hugging Face names, on CPU (an all-gather over the TP group)."""
        return {n: x.detach().to("cpu", copy=True) for n, x in self._hf_items(local)}

    def _hf_items(self, local: dict[str, torch.Tensor]):
        """(Hugging Face name, whole tensor) one parameter at a time: every TP rank takes part in each
        parameter's all-gather, and only one parameter is ever whole at once."""
        import torch.distributed as dist

        for name, p in self.params.items():
            t = local[name].detach()
            if self.tp > 1 and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(parts, t.contiguous(), group=self.tp_group)
                t = self.bridge._weight_merge_across_tp(self.global_names[name], parts, p)
            yield from zip(*self.bridge._weight_to_hf_format(self.global_names[name], t), strict=True)

    def _from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole Hugging Face tensors -> this rank's shard of each parameter (no communication)."""
        out = {}
        for name, p in self.params.items():
            g = self.global_names[name]
            parts = [hf[n] for n in self.hf_names[name]]
            whole = self.bridge._weight_to_mcore_format(g, parts)
            out[name] = self.bridge._weight_split_across_tp(g, whole, p, self.tp)[self.tp_rank].to(self.device)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self._to_hf(self.params)
        if self.hf_config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # as the torch backend has it
        return state

    def shard_state_dict(self, rank: int, shards: int, dtype: torch.dtype,
                         base: bool = False) -> dict[str, torch.Tensor]:
        out = shard_of(self._hf_items(self.params), rank, shards, dtype)
        if self.hf_config.tie_word_embeddings and "model.embed_tokens.weight" in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()  # as full_state_dict has it
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = {h for names in self.hf_names.values() for h in names}
        if self.hf_config.tie_word_embeddings:
            expected.add("lm_head.weight")
        check_fit(sorted(expected - set(state)), sorted(set(state) - expected))
        with torch.no_grad():
            for name, t in self._from_hf(state).items():
                self.params[name].copy_(t)

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        sd = opt.state_dict()
        names = list(self.params)  # the optimizer's parameter order
        hyper = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
        all_hf = [h for n in names for h in self.hf_names[n]]
        if not sd["state"]:
            return {"state": {}, "param_groups": [{**hyper, "params": all_hf}]}
        moments = [k for k in sd["state"][0] if k != "step"]
        per_moment = {m: self._to_hf({n: sd["state"][i][m] for i, n in enumerate(names)}) for m in moments}
        state = {h: {"step": sd["state"][i]["step"].clone(), **{m: per_moment[m][h] for m in moments}}
                 for i, n in enumerate(names) for h in self.hf_names[n]}
        return {"state": state, "param_groups": [{**hyper, "params": all_hf}]}

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        names = list(self.params)
        group = {**{k: v for k, v in state["param_groups"][0].items() if k != "params"},
                 "params": list(range(len(names)))}
        local: dict[int, dict] = {}
        if state["state"]:
            moments = [k for k in next(iter(state["state"].values())) if k != "step"]
            per_moment = {m: self._from_hf({h: s[m] for h, s in state["state"].items()}) for m in moments}
            for i, n in enumerate(names):
                first = self.hf_names[n][0]
                local[i] = {"step": state["state"][first]["step"], **{m: per_moment[m][n] for m in moments}}
        opt.load_state_dict({"state": local, "param_groups": [group]})
