"""``dora-hpc bench engine``: tokens/s of the built-in engine vs transformers' ``generate``.

Two workloads on the same model and prompts: equal lengths (batch 1/16/64, every request generates
the same number of tokens) and a rollout-like long-tailed mix (64 requests, lognormal lengths with
p99/p50 >= 10, each request stops at its own length). Static batching (``generate``) must run the
whole batch to its longest request, so its useful tokens/s counts only the tokens each request
asked for. Runs alternate A B A B ... in one process; medians are reported.
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
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        engine.add(i, p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True), 0)
    t = time.perf_counter()
    done = 0
    while engine.has_work():
        done += sum(len(f.output) for f in engine.step())
    assert done == sum(lens)
    return done / (time.perf_counter() - t)


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
    for name, folder in models.items():
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        rows = {}
        for kind, batch in cases:
            prompts, lens = workload(kind, vocab, batch)
            run_builtin(folder, prompts[:1], [4])  # warm up both
            run_hf(hf, prompts[:1], [4])
            a, b = [], []
            for _ in range(repeats):  # interleaved A B A B
                a.append(run_builtin(folder, prompts, lens))
                b.append(run_hf(hf, prompts, lens))
            key = f"{kind}-b{batch}"
            rows[key] = {"builtin_tokens_per_s": statistics.median(a), "hf_generate_tokens_per_s": statistics.median(b),
                         "ratio": statistics.median(x / y for x, y in zip(a, b, strict=True)),
                         "useful_tokens": sum(lens), "p50_len": float(np.median(lens)),
                         "p99_len": float(np.percentile(lens, 99)), "max_len": max(lens)}
            if console:
                r = rows[key]
                console.print(f"{name} {key}: built-in {r['builtin_tokens_per_s']:,.0f} tok/s, HF generate "
                              f"{r['hf_generate_tokens_per_s']:,.0f} tok/s -> {r['ratio']:.2f}x")
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
        ax.bar(x - 0.2, [rows[k]["builtin_tokens_per_s"] for k in keys], 0.4, label="built-in engine")
        ax.bar(x + 0.2, [rows[k]["hf_generate_tokens_per_s"] for k in keys], 0.4, label="HF generate")
        for i, k in enumerate(keys):
            ax.annotate(f"{rows[k]['ratio']:.1f}x", (i, max(rows[k]["builtin_tokens_per_s"],
                                                             rows[k]["hf_generate_tokens_per_s"])),
                        ha="center", va="bottom", fontsize=9)
        ax.set_xticks(x, keys)
        ax.set_ylabel("useful generated tokens / s (CPU)")
        ax.set_title(f"{name}: built-in engine vs transformers generate")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
