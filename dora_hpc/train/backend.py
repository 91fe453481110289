"""Trainer backends: where the policy's weights live and how the trainer ranks' gradients meet. The GRPO
objective (grpo.py) is written once against this interface; ``build_backend`` picks one by name.

* ``torch``: every trainer rank holds the whole model and optimizer; gradients are summed over the ranks
  in flat buckets (``DataParallel.sum_grads_``), so replicas stay bit-identical;
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state are
  sharded over the trainer ranks (gloo on CPU, NCCL on GPUs); see fsdp.py;
* ``megatron``: megatron-core's GPTModel, tensor-parallel over the trainer ranks; see megatron.py.

Invariants every backend keeps:
* ``full_state_dict`` returns every weight under its Hugging Face name, whole and on CPU, on every trainer
  rank: publishing, checksums and the rollout engines never see a shard or a backend-specific name;
* ``logits`` returns full-vocabulary float logits [B, L, V] of this rank's micro-batch, on the device the
  backend computes on (the objective follows them there);
* sharded backends communicate inside forward and backward, so every trainer rank runs the same number
  of micro-batches in a step (``micro_batches`` agrees on it; a rank short of data runs empty ones);
* after the last backward every rank holds, for the parameters it owns, the gradient of the *global* loss
  (the objective normalises by global counts; backends sum, they never average);
* ``optimizer_state`` is the whole optimizer state keyed by parameter name (on every rank), so a
  checkpoint does not depend on how many ranks wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from .dp import DataParallel

BackendName = Literal["torch", "fsdp", "megatron"]


class TrainBackend:
    """The replicated backend (``torch``): the whole model on every rank, gradients summed over the ranks."""

    def __init__(self, model_dir: str | Path, dp: DataParallel, reference: bool = False,
                 activation_checkpointing: bool = False, mixed_precision: str = "no") -> None:
        self.dp = dp
        # bf16: float32 weights, gradients and Adam state; the forward and backward compute in bfloat16
        self.mixed_precision = mixed_precision
        self.autocast = mixed_precision == "bf16"
        self.device = dp.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = self._load(model_dir)
        self.model.train()
        if activation_checkpointing:  # keep each layer's input only; recompute the rest in backward
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref = None
        if reference:  # the frozen initial weights, for a KL penalty
            self.ref = self._load(model_dir).eval()
            self.ref.requires_grad_(False)

    def _load(self, model_dir: str | Path) -> torch.nn.Module:
        """The whole float32 model on this rank's device (sharded backends load their own way)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    @property
    def counts_metrics(self) -> bool:
        """Whether this rank's share of the step's metrics is summed (tensor-parallel peers repeat theirs)."""
        return True

    def gather_batch(self, samples: list) -> list:
        """The samples this rank trains on, given the ones it received (TP peers train on their union)."""
        return samples

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, reference: bool = False) -> torch.Tensor:
        model = self.ref if reference else self.model
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device))
        return out.logits.float()

    def micro_batches(self, n_local: int) -> int:
        """How many micro-batches this rank runs, given it has data for ``n_local`` (replicas need not agree)."""
        return n_local

    def finish_grads(self) -> None:
        self.dp.sum_grads_(self.parameters())

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        check_fit(missing, unexpected)

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return detached_copy(get_optimizer_state_dict(self.model, opt))

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, opt, state)


def detached_copy(x):
    """A CPU copy of every tensor in a nested state (the optimizer's own state dict shares its tensors)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: detached_copy(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(detached_copy(v) for v in x)
    return x


def check_fit(missing: list[str], unexpected: list[str]) -> None:
    """Refuse weights that do not fit the model (a tied lm_head may be absent)."""
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise ValueError(f"checkpoint weights do not fit the model: missing {missing}, unexpected {unexpected}")


def build_backend(name: BackendName, model_dir: str | Path, dp: DataParallel, reference: bool = False,
                  tensor_parallel: int | None = None, activation_checkpointing: bool = False,
                  mixed_precision: str = "no") -> TrainBackend:
    """``activation_checkpointing``: every decoder layer keeps only its input for backward and recomputes
    the rest (memory grows with layers x tokens instead of everything; the gradient is the same).
    ``mixed_precision="bf16"``: float32 master weights, gradients and optimizer state, bfloat16 compute
    (torch: autocast; fsdp: FSDP2's MixedPrecisionPolicy, bf16 all-gathers, float32 reduce-scatters)."""
    if tensor_parallel is not None and name != "megatron":
        raise ValueError(f"train.tensor_parallel is for the megatron backend, not {name}")
    if mixed_precision not in ("no", "bf16") or (mixed_precision == "bf16" and name == "megatron"):
        raise ValueError(f"train.mixed_precision={mixed_precision!r}: 'no', or 'bf16' with the torch or fsdp "
                         "backend (megatron's needs its distributed optimizer, not wired here)")
    if name == "torch":
        return TrainBackend(model_dir, dp, reference, activation_checkpointing, mixed_precision)
    if name == "fsdp":
        from .fsdp import FSDPBackend

        return FSDPBackend(model_dir, dp, reference, activation_checkpointing, mixed_precision)
    if name == "megatron":
        from .megatron import MegatronBackend

        return MegatronBackend(model_dir, dp, reference, tensor_parallel, activation_checkpointing)
    raise ValueError(f"train.backend: unknown trainer backend {name!r} (torch, fsdp or megatron)")
