"""The replicated trainer backend (``torch``): the whole model and optimizer on every trainer rank;
gradients are summed over the ranks in flat buckets (``DataParallel.sum_grads_``), so the replicas stay
bit-identical. Keeps every invariant of backend.py's interface.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .backend import TrainBackend, check_fit, detached_copy, unstepped_state
from .lora import (
    LoraSpec,
    adapter_state,
    attach,
    hf_name,
    load_adapter_state,
    published_adapter,
    refuse_adapter,
)
from .publish import shard_of


class ReplicatedBackend(TrainBackend):
    whole = True

    def setup(self, model_dir: str | Path) -> None:
        # bf16: float32 weights, gradients and Adam state; the forward and backward compute in bfloat16
        self.autocast = self.mixed_precision == "bf16"

    def load(self, model_dir: str | Path, lora: LoraSpec | None = None) -> torch.nn.Module:
        """The whole float32 model on this rank's device."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return (attach(model, lora) if lora else model).to(self.device)

    def loaded(self) -> None:
        if self.opts.activation_checkpointing:  # keep each layer's input only; recompute the rest in backward
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, reference: bool = False, keep: int = 0) -> torch.Tensor:
        """The LM head runs on the kept positions only (``logits_to_keep``: 0 keeps all)."""
        model = self.ref if reference else self.model
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), logits_to_keep=keep)
        return out.logits.float()

    def prefix_logits(self, prompt_ids: torch.Tensor, prompt_attn: torch.Tensor, index: torch.Tensor,
                      tail_ids: torch.Tensor, tail_attn: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """The prompts' forward once, its KV cache then selected per sample (a differentiable gather: each
        prompt's gradient sums over its samples) and extended by the tails."""
        from transformers import DynamicCache

        model, dev = self.ref if reference else self.model, self.device
        prompt_attn, index, tail_attn = prompt_attn.to(dev), index.to(dev), tail_attn.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = model(input_ids=prompt_ids.to(dev), attention_mask=prompt_attn,
                        position_ids=(prompt_attn.cumsum(1) - 1).clamp(min=0), cache=DynamicCache(), use_cache=True,
                        logits_to_keep=1)
            cache = out.cache
            if cache is None:  # a checkpointed layer in training turns the cache off (config refuses both)
                raise ValueError("train.shared_prompt does not work with activation checkpointing")
            cache.batch_select_indices(index)
            start = prompt_attn.sum(1)[index][:, None]
            tail = model(input_ids=tail_ids.to(dev), attention_mask=torch.cat([prompt_attn[index], tail_attn], 1),
                         position_ids=start + torch.arange(tail_ids.shape[1], device=dev)[None], cache=cache,
                         use_cache=True)
        return torch.cat([out.logits[index], tail.logits], 1).float()

    def micro_batches(self, n_local: int) -> int:
        """Replicas need not agree: each runs the micro-batches it has data for."""
        return n_local

    def finish_grads(self) -> None:
        self.dp.sum_grads_(self.parameters())

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.opts.lora:
            return adapter_state(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def published(self, base: bool = False) -> dict[str, torch.Tensor]:
        """What a version is, whole (live tensors): the weights; under LoRA the adapter, and with ``base`` the
        frozen base's weights (version 0, whose adapter is the identity)."""
        lora = self.opts.lora
        if lora is None:
            return self.model.state_dict()
        if base:
            return {hf_name(k): t for k, t in self.model.state_dict().items() if ".lora_" not in k}
        return published_adapter(self.model)

    def shard_state_dict(self, rank: int, shards: int, dtype: torch.dtype,
                         base: bool = False) -> dict[str, torch.Tensor]:
        return shard_of(self.published(base), rank, shards, dtype)  # copies this rank's pieces only

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.opts.lora:
            return load_adapter_state(self.model, state)
        refuse_adapter(state)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        check_fit(missing, unexpected)

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = unstepped_state(opt, [n for n, p in self.model.named_parameters() if p.requires_grad])
        return fresh or detached_copy(get_optimizer_state_dict(self.model, opt))

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if state["state"]:  # else it had not stepped: nor has this one
            set_optimizer_state_dict(self.model, opt, state)


