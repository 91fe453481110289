"""``dora-hpc bench engine``: tokens/s of the built-in engine vs transformers' ``generate`` (and vLLM).

Two workloads on the same model and prompts: equal lengths (batch 1/16/64, every request generates
the same number of tokens) and a rollout-like long-tailed mix (64 requests, lognormal lengths with
p99/p50 >= 10, each request stops at its own length). Static batching (``generate``) must run the
whole batch to its longest request, so its useful tokens/s counts only the tokens each request
asked for. Runs alternate A B (C) A B (C) ... in one process; medians are reported. When vLLM is
installed the vLLM backend (engine/vllm.py, one engine per model, started once) is the C column.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..engine.engine import Engine
from ..engine.sampling import SamplingParams


def workload(kind: str, vocab: int, batch: int, seed: int = 0, prompt_len: int = 32, gen: int = 64,
             median: int = 12, sigma: float = 1.1, cap: int = 256) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, vocab, size=(batch, prompt_len)).tolist()
    if kind == "equal":
        return prompts, [gen] * batch
    lens = np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(batch))), 1, cap).astype(int)
    return prompts, lens.tolist()


def run_builtin(model_dir: Path, prompts: list[list[int]], lens: list[int]) -> float:
    kv_blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, lens, strict=True)) + 8
    engine = Engine(model_dir, kv_blocks=kv_blocks, max_num_seqs=len(prompts), max_batched_tokens=4096)
    return run_backend(engine, prompts, lens)


def run_backend(engine, prompts: list[list[int]], lens: list[int]) -> float:
    """Tokens/s of a started RolloutEngine (built-in, or the vLLM backend reused across runs) on one batch."""
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        engine.add(i, p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True), engine.version)
    t = time.perf_counter()
    done = 0
    while engine.has_work():
        done += sum(len(f.response) for f in engine.step())
    assert done == sum(lens)
    return done / (time.perf_counter() - t)


def start_vllm(model_dir: Path, batch: int):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from ..engine.vllm import VllmEngine

    return VllmEngine(model_dir, kv_blocks=batch * 20, max_num_seqs=batch, max_batched_tokens=4096, version=0)


def run_hf(hf_model, prompts: list[list[int]], lens: list[int]) -> float:
    ids = torch.tensor(prompts)
    t = time.perf_counter()
    with torch.inference_mode():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=max(lens),
                          min_new_tokens=max(lens), pad_token_id=0)
    return sum(lens) / (time.perf_counter() - t)


def bench_engine(models: dict[str, Path], out: Path, repeats: int = 3, console=None) -> dict:
    from transformers import AutoModelForCausalLM

    cases = [("equal", 1), ("equal", 16), ("equal", 64), ("longtail", 64)]
    result: dict = {"torch_threads": torch.get_num_threads(), "repeats": repeats, "models": {}}
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        job = bar.add_task("engine bench", total=len(models) * len(cases))
        for name, folder in models.items():
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            vocab = hf.config.vocab_size
            rows = {}
            vllm = start_vllm(folder, max(b for _, b in cases))  # KV for the largest batch at 320 tokens each
            for kind, batch in cases:
                prompts, lens = workload(kind, vocab, batch)
                run_builtin(folder, prompts[:1], [4])  # warm up every backend
                run_hf(hf, prompts[:1], [4])
                a, b, c = [], [], []
                for _ in range(repeats):  # interleaved A B (C) A B (C)
                    a.append(run_builtin(folder, prompts, lens))
                    b.append(run_hf(hf, prompts, lens))
                    if vllm is not None:
                        c.append(run_backend(vllm, prompts, lens))
                key = f"{kind}-b{batch}"
                bar.update(job, advance=1, description=f"engine bench: {name} {key}")
                rows[key] = {"builtin_tokens_per_s": statistics.median(a),
                             "hf_generate_tokens_per_s": statistics.median(b),
                             "ratio": statistics.median(x / y for x, y in zip(a, b, strict=True)),
                             "useful_tokens": sum(lens), "p50_len": float(np.median(lens)),
                             "p99_len": float(np.percentile(lens, 99)), "max_len": max(lens)}
                if c:
                    rows[key]["vllm_tokens_per_s"] = statistics.median(c)
                    rows[key]["vllm_ratio_to_hf"] = statistics.median(z / y for z, y in zip(c, b, strict=True))
                if console:
                    r = rows[key]
                    console.print(f"{name} {key}: built-in {r['builtin_tokens_per_s']:,.0f} tok/s, HF generate "
                                  f"{r['hf_generate_tokens_per_s']:,.0f} tok/s -> {r['ratio']:.2f}x"
                                  + (f"; vLLM {r['vllm_tokens_per_s']:,.0f} tok/s ({r['vllm_ratio_to_hf']:.2f}x HF)"
                                     if c else ""))
            result["models"][name] = rows
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "engine.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        rows = result["models"][name]
        keys = list(rows)
        x = np.arange(len(keys))
        has_vllm = all("vllm_tokens_per_s" in rows[k] for k in keys)
        w = 0.27 if has_vllm else 0.4
        ax.bar(x - w / 2 - (w / 2 if has_vllm else 0), [rows[k]["builtin_tokens_per_s"] for k in keys], w,
               label="built-in engine")
        ax.bar(x + w / 2 - (w / 2 if has_vllm else 0), [rows[k]["hf_generate_tokens_per_s"] for k in keys], w,
               label="HF generate")
        if has_vllm:
            ax.bar(x + w, [rows[k]["vllm_tokens_per_s"] for k in keys], w, label="vLLM backend")
        for i, k in enumerate(keys):
            ax.annotate(f"{rows[k]['ratio']:.1f}x", (i, max(rows[k]["builtin_tokens_per_s"],
                                                             rows[k]["hf_generate_tokens_per_s"])),
                        ha="center", va="bottom", fontsize=9)
        ax.set_xticks(x, keys)
        ax.set_ylabel("useful generated tokens / s (CPU)")
        ax.set_title(f"{name}: built-in engine vs transformers generate" + (" and vLLM" if has_vllm else "")
                     + "\n(labels: built-in / HF)", fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
