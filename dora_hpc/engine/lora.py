"""LoRA adapters resident on the built-in engine, one per version, applied per request inside one batched forward.

A version under ``train.lora`` is an adapter: for each adapted linear of the decoder, A [r, in] and B [out, r],
published under ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (Hugging Face module names). The engine
keeps the model folder's weights once and every live version's adapter beside them.

Invariants:
* a linear's output for a token is base(x) + scale * B_v (A_v x), v the version of the token's request, computed as
  peft computes it (``F.linear`` twice, then the scale); a version with no adapter loaded here is the base model
  (version 0: an adapter starts with B = 0);
* a forward hook on every adapted linear adds the update row group by row group: the rows of each version present
  in the batch (``set_batch``), so requests of several versions share one forward (Punica / S-LoRA's batching,
  one matmul pair per version present rather than a fused kernel);
* an adapter that names a module the decoder lacks, or has the wrong shapes, is refused (AdapterError) before it
  touches what is resident.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..train.lora import SUFFIXES


class AdapterError(ValueError):
    """An adapter that does not fit the engine's model."""


class Adapters:
    def __init__(self, model: nn.Module, scale: float) -> None:
        self.scale = scale
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
        self.by_version: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # the current forward's (version, rows or all)
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        for name, m in self.linears.items():
            m.register_forward_hook(partial(self._hook, name))

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        pairs: dict[str, list] = {}
        for key, t in state.items():
            module, which = key.rsplit(".lora_", 1)
            if module not in self.linears:
                raise AdapterError(f"adapter of v{version}: {key} adapts no linear of the model")
            pairs.setdefault(module, [None, None])[0 if which == "A.weight" else 1] = t
        out = {}
        for module, (a, b) in pairs.items():
            lin = self.linears[module]
            if a is None or b is None or a.dim() != 2 or b.shape != (lin.out_features, a.shape[0]) \
                    or a.shape[1] != lin.in_features:
                raise AdapterError(f"adapter of v{version}: {module} needs A [r, {lin.in_features}] and B "
                                   f"[{lin.out_features}, r], got {None if a is None else tuple(a.shape)} and "
                                   f"{None if b is None else tuple(b.shape)}")
            out[module] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        self.by_version[version] = out

    def drop(self, version: int) -> None:
        self.by_version.pop(version, None)

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s adapter under its published names (empty: the base model)."""
        return {f"{m}{s}": t for m, ab in self.by_version.get(version, {}).items() for s, t in zip(SUFFIXES, ab,
                                                                                                 strict=True)}

    def set_batch(self, row_versions: list[int]) -> None:
        """The version of each row (token) of the next forward."""
        present = [v for v in dict.fromkeys(row_versions) if self.by_version.get(v)]
        if len(present) == 1 and len(set(row_versions)) == 1:
            self.groups = [(present[0], None)]
            return
        rv = torch.tensor(row_versions, device=self.device)
        self.groups = [(v, torch.nonzero(rv == v).flatten()) for v in present]

    def _hook(self, name: str, module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        for v, rows in self.groups:
            ab = self.by_version[v].get(name)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                out = out + F.linear(F.linear(x, a), b) * self.scale
            else:
                out = out.index_add(0, rows, F.linear(F.linear(x[rows], a), b) * self.scale)
        return out
