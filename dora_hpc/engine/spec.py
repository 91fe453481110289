"""What the engine needs to know of a Hugging Face model folder, read without torch or transformers.

Invariant: ``read_spec(folder)`` equals ``ModelSpec.from_hf(AutoConfig.from_pretrained(folder))``. A
config.json that names every field ModelSpec needs and no RoPE scaling (any folder transformers saved:
ours, SmolLM2's) is read as JSON, with transformers' own defaults for the optional fields; any other goes
through AutoConfig, which fills the model type's defaults. Importing transformers costs seconds of CPU,
once per rank at start-up, which the rollout ranks and the launcher otherwise never need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace


class ModelLoadError(RuntimeError):
    """A checkpoint folder that cannot be loaded; the message names the file or tensor."""


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool
    eos_token_id: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg) -> ModelSpec:
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ModelLoadError(f"rope_type {rope['rope_type']!r} is not supported (only default RoPE)")
        bias = getattr(cfg, "attention_bias", None)
        if bias is None:
            bias = cfg.model_type == "qwen2"
        eos = cfg.eos_token_id
        eos = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)
        heads = cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(theta), attention_bias=bool(bias),
            tie_word_embeddings=bool(cfg.tie_word_embeddings), eos_token_id=eos,
        )


# the fields from_hf reads without a default of its own: with all of them, config.json alone is enough
REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "rms_norm_eps", "tie_word_embeddings", "eos_token_id")


def load_hf_config(folder: str | Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{Path(folder) / 'config.json'}: {e}") from None


def read_spec(folder: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face folder (config.json + weights); ModelLoadError names what is wrong."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if isinstance(raw, dict) and all(k in raw for k in REQUIRED) and not raw.get("rope_scaling"):
        return ModelSpec.from_hf(SimpleNamespace(**raw))
    return ModelSpec.from_hf(load_hf_config(folder))
