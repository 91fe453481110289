"""Trainer backends: where the policy's weights live and how the trainer ranks' gradients meet. The GRPO
objective (grpo.py) is written once against ``TrainBackend``; ``build_backend`` builds one by name from
``BACKENDS`` (the one place a backend plugs in). Every backend goes through ``TrainBackend.__init__``;
the configuration's checks (which backend takes tensor parallelism or bf16) live in config.py alone.

* ``torch``: every trainer rank holds the whole model and optimizer; gradients are summed over the ranks
  in flat buckets (``DataParallel.sum_grads_``), so replicas stay bit-identical; see replicated.py;
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state are
  sharded over the trainer ranks (gloo on CPU, NCCL on GPUs); see fsdp.py;
* ``megatron``: megatron-core's GPTModel, tensor-parallel over the trainer ranks; see megatron.py.

Invariants every backend keeps:
* ``shard_state_dict`` returns this trainer rank's pieces of every weight (train/publish.py's layout) under
  its Hugging Face name, on CPU in the publish dtype, without any rank holding the whole model; publishing
  and the rollout engines never see a backend's own shard or name. ``full_state_dict`` returns every
  weight whole, on every trainer rank: for checkpoints and export only;
* ``logits`` returns full-vocabulary float logits [B, keep, V] of the last ``keep`` positions (all L when
  ``keep`` is 0) of this rank's micro-batch, on the device the backend computes on (the objective follows
  them there);
* sharded backends communicate inside forward and backward, so every trainer rank runs the same number
  of micro-batches in a step (``micro_batches`` agrees on it; a rank short of data runs empty ones);
* after the last backward every rank holds, for the parameters it owns, the gradient of the *global* loss
  (the objective normalises by global counts; backends sum, they never average);
* ``optimizer_state`` is the whole optimizer state keyed by parameter name (on every rank), so a
  checkpoint does not depend on how many ranks wrote it;
* under LoRA (``BackendOptions.lora``) ``full_state_dict`` and ``load_full_state_dict`` are the adapter's weights
  (lora.py ``adapter_state``: a checkpoint), and ``shard_state_dict`` the version as engines take it: the adapter
  under the engines' names (with ``base``: the frozen base, version 0).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .dp import DataParallel
from .lora import LoraSpec

BackendName = Literal["torch", "fsdp", "megatron"]
# name -> "module:class"; imported when chosen (megatron-core is an optional extra)
BACKENDS: dict[str, str] = {"torch": "dora_hpc.train.replicated:ReplicatedBackend",
                            "fsdp": "dora_hpc.train.fsdp:FSDPBackend",
                            "megatron": "dora_hpc.train.megatron:MegatronBackend"}


@dataclass(frozen=True)
class BackendOptions:
    """``activation_checkpointing``: every decoder layer keeps only its input for backward and recomputes
    the rest (memory grows with layers x tokens instead of everything; the gradient is the same).
    ``mixed_precision="bf16"``: float32 master weights, gradients and optimizer state, bfloat16 compute.
    ``tensor_parallel``: megatron's TP size (default: every trainer rank). ``reference``: also hold the
    frozen initial weights, for a KL penalty. ``lora``: train a LoRA adapter on the policy (lora.py); the
    reference stays the base model (an adapter starts at zero)."""
    reference: bool = False
    activation_checkpointing: bool = False
    mixed_precision: Literal["no", "bf16"] = "no"
    tensor_parallel: int | None = None
    lora: LoraSpec | None = None


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX); without, torch emulates it."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(p() for p in probes if p is not None) or all(p is None for p in probes)


class TrainBackend:
    """The interface. ``__init__`` is the one constructor path: ``setup`` (process groups, meshes, the
    backend's own configuration), then ``load`` for the policy (in train mode) and, when asked, the
    frozen reference, then ``loaded``."""

    whole = False  # every trainer rank holds the whole model (a replica)

    def __init__(self, model_dir: str | Path, dp: DataParallel, opts: BackendOptions = BackendOptions()) -> None:
        self.dp, self.opts, self.device = dp, opts, dp.device
        self.mixed_precision = opts.mixed_precision
        if self.mixed_precision == "bf16" and self.device.type == "cpu" and not cpu_has_bf16() and dp.lead:
            print("dora-hpc: warning: train.mixed_precision=bf16 on a CPU without bfloat16 instructions (AVX512-BF16 "
                  "or AMX): each train step runs many times slower than in float32 (about 20x on an AVX2 EPYC); set "
                  "train.mixed_precision=no", file=sys.stderr, flush=True)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.setup(model_dir)
        self.model = self.load(model_dir, opts.lora)
        self.model.train()
        self.ref = None
        if opts.reference:
            self.ref = self.load(model_dir).eval()
            self.ref.requires_grad_(False)
        self.loaded()

    # -- what a backend provides -----------------------------------------------------------------
    def setup(self, model_dir: str | Path) -> None:
        """Before any model is built."""

    def load(self, model_dir: str | Path, lora: LoraSpec | None = None) -> torch.nn.Module:
        """The model in train mode's dtype on this rank, with a fresh ``lora`` adapter attached where given."""
        raise NotImplementedError

    def loaded(self) -> None:
        """After the policy (and reference) are built."""

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trained parameters (under LoRA, the adapter's alone)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def counts_metrics(self) -> bool:
        """Whether this rank's share of the step's metrics is summed (tensor-parallel peers repeat theirs)."""
        return True

    def gather_batch(self, samples: list) -> list:
        """The samples this rank trains on, given the ones it received (TP peers train on their union)."""
        return samples

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, reference: bool = False, keep: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def prefix_logits(self, prompt_ids: torch.Tensor, prompt_attn: torch.Tensor, index: torch.Tensor,
                      tail_ids: torch.Tensor, tail_attn: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """Logits [B, 1 + Lt, V] of B samples that continue P distinct prompts (``prompt_ids`` [P, Lp], padded on
        the left; sample b continues prompt ``index[b]`` with ``tail_ids[b]``, padded on the right): row 0 is
        the prompt's last position, row j the tail's j-th token. Each prompt is computed once."""
        raise NotImplementedError(f"{type(self).__name__} does not compute shared prompts once")

    def micro_batches(self, n_local: int) -> int:
        """How many micro-batches this rank runs, given it has data for ``n_local``."""
        raise NotImplementedError

    def finish_grads(self) -> None:
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> float:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def shard_state_dict(self, rank: int, shards: int, dtype: torch.dtype,
                         base: bool = False) -> dict[str, torch.Tensor]:
        """This rank's pieces of the version (``base``: of the frozen base under LoRA: version 0 where versions are
        adapters)."""
        raise NotImplementedError

    def published(self, base: bool = False) -> dict[str, torch.Tensor]:
        """A ``whole`` backend's version, whole, as ``shard_state_dict`` cuts it (a replica checks its neighbour's
        shard with it)."""
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        raise NotImplementedError

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        raise NotImplementedError

    def local_state(self, opt: torch.optim.Optimizer) -> dict:
        """This rank's part of the weights and the optimizer, with no collective (a replica recovering from a
        live one takes it rank for rank, train/ft.py): a whole backend's is its checkpoint state."""
        return {"weights": self.full_state_dict(), "optimizer": self.optimizer_state(opt)}

    def load_local_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        """``local_state`` of the same rank of another replica group."""
        self.load_full_state_dict(state["weights"])
        self.load_optimizer_state(opt, state["optimizer"])


def unstepped_state(opt: torch.optim.Optimizer, names: list[str]) -> dict | None:
    """An optimizer that has not stepped yet has no state to keep: its hyper-parameters alone (None once it
    has stepped). torch.distributed.checkpoint's getter would make one by stepping at lr 0, which Adam counts
    in its bias correction: the first real step would then move every weight by 0.74 lr instead of lr."""
    if opt.state:
        return None
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return {"state": {}, "param_groups": [{**hyper, "params": names}]}


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


def build_backend(name: BackendName, model_dir: str | Path, dp: DataParallel,
                  opts: BackendOptions = BackendOptions()) -> TrainBackend:
    if name not in BACKENDS:
        raise ValueError(f"train.backend: unknown trainer backend {name!r} ({', '.join(BACKENDS)})")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(model_dir, dp, opts)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor is its own)."""
    return t.to_local() if hasattr(t, "to_local") else t


def shard_local_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """A sharded backend's ``local_state`` (FSDP2's DTensor shards, megatron's TP shards): this rank's part of
    each trained parameter and of its optimizer state, by parameter name, with no collective."""
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return {"weights": {n: local_shard(p).detach().to("cpu", copy=True) for n, p in trained.items()},
            "optimizer": {n: {k: local_shard(v).detach().to("cpu", copy=True) for k, v in opt.state[p].items()}
                          for n, p in trained.items() if p in opt.state}}


def load_shard_local_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict,
                           device: torch.device) -> None:
    """``shard_local_state`` of the same rank of another replica group: an optimizer entry shaped like a DTensor
    parameter's shard (Adam's moments) is sharded as the parameter is; the others (its step count, or every entry
    of a plain parameter) are plain. This rank's own optimizer state is replaced whole."""
    from torch.distributed.tensor import DTensor

    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(state["weights"]) != set(trained):
        raise RuntimeError("a recovered replica state does not fit this model's trained parameters")
    with torch.no_grad():
        for n, p in trained.items():
            local_shard(p).copy_(state["weights"][n])
    for p in trained.values():  # a parameter the source has no moments for (it had not stepped) has none here
        opt.state.pop(p, None)
    for n, entries in state["optimizer"].items():
        p = trained[n]
        for k, v in entries.items():
            v = v.to(device)
            if isinstance(p, DTensor) and v.shape == local_shard(p).shape:
                v = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            opt.state[p][k] = v
