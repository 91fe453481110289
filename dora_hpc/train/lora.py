"""LoRA (``train.lora``): the trainer trains low-rank adapters through peft; the model folder's weights stay frozen.

Invariants:
* only the adapters' parameters are trainable; the optimizer holds only them;
* ``adapter_state``: the adapter's weights under peft's saved names (``base_model.model.<HF module>.lora_A.weight``),
  what a checkpoint keeps: with the run's model folder and its ``train.lora`` they are the whole policy;
* ``published_adapter``: the adapter under the names the engines take (``<HF module>.lora_A.weight``,
  engine/lora.py): what a version is (every instance holds the base once and each live version's adapter);
* ``merged_model``: the model folder's model with an adapter merged by peft, a plain model (``export --merged``);
* a ``train.lora`` that cannot run raises LoraError naming the key (``target_modules`` that match no module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a model does: a bad argument fails before it
    import torch

ADAPTER = "default"  # peft's name for the one adapter a policy has
SUFFIXES = (".lora_A.weight", ".lora_B.weight")  # how every LoRA weight's name ends, peft's and the engine's


class LoraError(ValueError):
    """A ``train.lora`` that does not fit the model, or weights of the other kind (adapter against full)."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: tuple[str, ...] | str  # module names, or peft's "all-linear" (every linear but the output head)
    dropout: float = 0.0

    @classmethod
    def of(cls, cfg) -> LoraSpec | None:
        """``train.lora`` of a RunConfig (None: full fine-tuning)."""
        lo = cfg.train.lora
        if lo is None:
            return None
        mods = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
        return cls(lo.rank, lo.alpha, mods, lo.dropout)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def attach(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """``model`` with a fresh adapter (B = 0: the policy equals the base) and only the adapter trainable."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    mods = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    try:
        with warnings.catch_warnings():  # transformers' deprecation notes on what peft asks of it
            warnings.simplefilter("ignore", FutureWarning)
            out = get_peft_model(model, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=mods,
                                                   lora_dropout=spec.dropout, bias="none"))
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        first = str(e).splitlines()[0]
        raise LoraError(f"train.lora.target_modules {spec.target_modules!r}: {first}") from None
    for name, m in out.get_base_model().named_modules():
        if isinstance(m, LoraLayer) and spec.rank > min(m.in_features, m.out_features):
            raise LoraError(f"train.lora.rank {spec.rank} exceeds {name}'s smaller side "
                            f"({m.in_features} x {m.out_features}): a low-rank update must be lower")
    return out


def check(model_dir, spec: LoraSpec) -> None:
    """Raise LoraError where ``spec`` cannot adapt the model folder's model (built on the meta device: no weights
    are read), before any process starts."""
    import torch
    from peft.tuners.lora import LoraLayer
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = attach(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)), spec)
    odd = [n for n, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)
           and (n.endswith("lm_head") or not isinstance(m.get_base_layer(), nn.Linear))]
    if odd:  # the engines adapt the decoder's linears (engine/lora.py)
        raise LoraError(f"train.lora.target_modules {spec.target_modules!r}: the engines adapt the decoder's "
                        f"linear layers only, not {odd[0]}")


def is_adapter(state: dict) -> bool:
    """Whether ``state`` is a LoRA adapter's weights: every name a lora_A or lora_B weight, under peft's saved
    names (a checkpoint's) or the engine's (a published version's, engine/lora.py)."""
    return bool(state) and all(k.endswith(SUFFIXES) for k in state)


def refuse_adapter(state: dict) -> None:
    """Weights for a model without ``train.lora`` must not be an adapter's."""
    if is_adapter(state):
        raise LoraError("the weights are a LoRA adapter's: a train.lora checkpoint does not resume or load without "
                        "train.lora (set it as the run had it)")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``state`` (``adapter_state``'s names) into ``model``'s adapter; an adapter of another rank or other modules,
    or a whole model's weights, raise LoraError."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    check_adapter({k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}, state)
    set_peft_model_state_dict(model, state)


def check_adapter(want: dict[str, tuple[int, ...]], state: dict[str, torch.Tensor]) -> None:
    """``state`` is an adapter of exactly the shapes ``want`` (saved names), or LoraError says what it is."""
    if not is_adapter(state):
        raise LoraError("the weights are a whole model's, not a LoRA adapter: a full fine-tuning checkpoint does not "
                        "resume or load under train.lora")
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        odd = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise LoraError(f"the adapter does not fit this train.lora (rank or target_modules differ): "
                        f"{len(odd)} tensors, first {odd[0]} {got.get(odd[0])} against {want.get(odd[0])}")


def published_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's live tensors under the engine's names (``<HF module>.lora_A.weight``)."""
    return {hf_name(saved_name(k)): t for k, t in model.state_dict().items() if ".lora_" in k}


def saved_name(fqn: str) -> str:
    """An adapter parameter's name in ``adapter_state`` (peft's saved name) from its module path."""
    return fqn.replace(f".{ADAPTER}.", ".")


def hf_name(fqn: str) -> str:
    """A base weight's Hugging Face name from its path in the adapted model."""
    return fqn.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged_model(model_dir, spec: LoraSpec, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model folder's model with ``adapter`` merged into its weights (float32, CPU): a plain HF model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = attach(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), spec)
    load_adapter_state(model, adapter)
    return model.merge_and_unload()
