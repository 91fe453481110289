"""FSDP2 trainer backend: the Hugging Face model with every decoder layer and then the root wrapped by
``fully_shard`` over the trainer ranks' process group (gloo on CPU, NCCL on GPUs).

Invariants:
* each rank stores 1/T of every parameter, gradient and optimizer moment (DTensors sharded on dim 0);
  forward all-gathers a layer's parameters just before it runs, backward reduce-scatters its gradients;
* the reduce-scatter *sums* (divide factor 1, plain SUM): the objective already normalises by
  global counts, exactly as the replicated backend's bucketed all-reduce does, so both take the same step;
* every rank runs the same number of micro-batches (the maximum over the ranks); a rank short of data
  runs empty ones whose loss is multiplied by zero, joining the collectives without moving the weights;
* no rank ever holds the whole model on its device: rank 0 reads the checkpoint into host memory, every
  rank builds the model on the meta device, shards it, allocates only its shards and receives them
  from rank 0 (a broadcast), so a model too big for one device loads; non-persistent buffers (rotary
  frequencies) are recomputed, never taken from the meta device;
* ``shard_state_dict`` is each rank's own local shards (fully_shard splits dim 0 as torch.chunk does, the
  publish layout), under Hugging Face names (fully_shard keeps the module's parameter names): publishing
  gathers nothing. ``full_state_dict`` all-gathers every parameter (checkpoints, export).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .backend import check_fit, detached_copy, load_shard_local_state, local_shard, shard_local_state, unstepped_state
from .lora import LoraSpec, attach, check_adapter, hf_name, refuse_adapter, saved_name
from .publish import piece, rows
from .replicated import ReplicatedBackend


def _shard(model: torch.nn.Module, mesh, bf16: bool = False) -> torch.nn.Module:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA, peft's wrapper's
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # a plain SUM reduce-scatter (gloo has no pre-multiplied sum)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


class FSDPBackend(ReplicatedBackend):
    """The replicated backend's objective-facing methods over a sharded model (it shares ``logits`` and
    activation checkpointing; FSDP2 casts the gathered parameters itself, so there is no autocast)."""

    whole = False

    def setup(self, model_dir: str | Path) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.dp.ensure_process_group()  # a replica group's own (train/ft.py), or every trainer rank's
        self.mesh = init_device_mesh(self.dp.device.type, (self.dp.shard_size,), mesh_dim_names=("dp_shard",))
        self.autocast = False

    def load(self, model_dir: str | Path, lora: LoraSpec | None = None) -> torch.nn.Module:
        """The sharded model: built on the meta device, sharded, its shards allocated on this rank's device
        and filled from rank 0's copy of the checkpoint (under LoRA, with rank 0's fresh adapter)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from transformers import AutoConfig, AutoModelForCausalLM

        full = {}
        if self.dp.shard_rank == 0:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            full = (attach(model, lora) if lora else model).state_dict()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
            model = attach(model, lora) if lora else model
        _shard(model, self.mesh, self.mixed_precision == "bf16")
        model.to_empty(device=self.device)
        for m in model.modules():  # non-persistent buffers are in no state dict: compute them again
            if "RotaryEmbedding" in type(m).__name__:
                model._init_weights(m)
        names = set(model.state_dict())
        set_model_state_dict(model, {k: v for k, v in full.items() if k in names},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
        return model

    def micro_batches(self, n_local: int) -> int:
        return self.dp.max_int(n_local)

    def finish_grads(self) -> None:
        """Backward reduce-scattered (summed) each micro-batch's gradients into this group's shards; what is left
        is the sum over the other replica groups, shard by shard (train/ft.py; none without replicas)."""
        grads = [p.grad for p in self.parameters()]  # none is None: backward reduce-scatters each one
        self.dp.sum_shards_([local_shard(g) for g in grads])

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in self.model.state_dict().items():
            if self.opts.lora and ".lora_" not in k:
                continue  # under LoRA: the adapter
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[saved_name(k) if self.opts.lora else k] = v.detach().cpu().clone()
        return out

    def shard_state_dict(self, rank: int, shards: int, dtype: torch.dtype,
                         base: bool = False) -> dict[str, torch.Tensor]:
        """This rank's rows of every weight; under LoRA the adapter's, and with ``base`` the frozen base's."""
        out = {}
        lora = self.opts.lora
        for k, v in self.model.state_dict().items():
            if lora and (".lora_" in k) == base:
                continue  # a version is the adapter (v0: the base)
            k = hf_name(saved_name(k)) if lora else k
            local = v.to_local() if hasattr(v, "to_local") else piece(v, rank, shards)  # a DTensor, or not sharded
            lo, hi = rows(tuple(v.shape), rank, shards)
            if len(local) != hi - lo:
                raise RuntimeError(f"fsdp: the local shard of {k} has {len(local)} rows, the publish layout "
                                   f"rows {lo}:{hi} of {tuple(v.shape)}")
            if local.numel():
                out[k] = local.detach().to("cpu", dtype, copy=True).contiguous()
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.opts.lora:
            return self.load_adapter(state)
        refuse_adapter(state)
        names = set(self.model.state_dict())
        check_fit(sorted(names - set(state)), sorted(set(state) - names))
        set_model_state_dict(self.model, {k: v for k, v in state.items() if k in names},
                             options=StateDictOptions(full_state_dict=True, strict=False))

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """An adapter (``full_state_dict``'s names) into the sharded adapter."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        mine = {saved_name(k): (k, tuple(v.shape)) for k, v in self.model.state_dict().items() if ".lora_" in k}
        check_adapter({name: shape for name, (_, shape) in mine.items()}, state)
        set_model_state_dict(self.model, {mine[k][0]: v for k, v in state.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False))

    def local_state(self, opt: torch.optim.Optimizer) -> dict:
        return shard_local_state(self.model, opt)

    def load_local_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        load_shard_local_state(self.model, opt, state, self.device)

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        fresh = unstepped_state(opt, [n for n, p in self.model.named_parameters() if p.requires_grad])
        if fresh is not None:  # every rank alike: none has stepped
            return fresh
        state = get_optimizer_state_dict(self.model, opt, options=StateDictOptions(full_state_dict=True))
        return detached_copy(state)

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if state["state"]:  # else it had not stepped: nor has this one
            set_optimizer_state_dict(self.model, opt, state, options=StateDictOptions(full_state_dict=True))
