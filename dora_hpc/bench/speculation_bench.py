"""``dora-hpc bench speculation``: what speculative decoding (engine.speculation) buys the built-in engine on a
run's own prompts, by method and batch size.

Each case is a run config: its task's first ``prompts`` prompts, G samples each (batch.group_size), its
sampling settings, decoded twice -- epoch 1 and epoch 2 of the same prompts (groups g and g + task.size),
as an RL run meets them -- on one engine at ``max_num_seqs`` of 4, 16 and 64. The methods run interleaved
(none, ngram, group, none, ...), each on a fresh engine; medians are reported. Figures: tokens/s, and from
the engine's counters (hardware-independent) the drafted and accepted tokens and tokens per target forward,
in all, by epoch and by the step's decode batch (measure/speculation.py, the same definition as analyze's),
and the share of responses identical to decoding without drafts (the rest differ by float rounding, as two
batch layouts do).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from ..config import load_config
from ..engine.draft import METHODS
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from ..measure.speculation import speculation_figures

CASES = {"smollm2-addition": ("configs/smollm2-addition.yaml", ["sampling.max_tokens=192"]),
         "tiny": ("configs/tiny-cpu.yaml", [])}
BATCHES = (4, 16, 64)


def requests(cfg, model_dir: Path, prompts: int) -> tuple[list[tuple[int, list[int], int]], bool]:
    """(request id, prompt, max_tokens) of two epochs of the task's first ``prompts`` prompts, G samples each,
    and whether the task ignores EOS."""
    from ..data.tasks import make_task
    from ..engine.spec import read_spec

    task = make_task(cfg, read_spec(model_dir).vocab_size, model_dir)
    size, g_size = cfg.task.size, cfg.batch.group_size
    out = []
    for epoch in range(2):
        for p in range(prompts):
            g = p + epoch * size
            out += [(g * g_size + i, task.prompt(g), task.max_tokens(g * g_size + i)) for i in range(g_size)]
    return out, bool(getattr(task, "ignore_eos", False))


def decode(model, cfg, reqs, method: str, batch: int, draft_tokens: int, ignore_eos: bool = False) -> dict:
    """One engine decoding ``reqs`` with at most ``batch`` running at once; its figures and responses."""
    e = cfg.engine
    blocks = max(-(-(len(p) + n) // e.block_size) for _, p, n in reqs) * batch + 8
    engine = Engine(model, kv_blocks=blocks, block_size=e.block_size, max_num_seqs=batch,
                    max_batched_tokens=max(e.max_batched_tokens, batch * (draft_tokens + 1)), seed=cfg.seed,
                    speculation=method, draft_tokens=draft_tokens)
    s = cfg.sampling
    rows: dict[str, list[int]] = {"decodes": [], "drafted": [], "accepted": [], "epoch": []}
    responses, half, t = {}, len(reqs) // 2, time.perf_counter()
    for epoch, part in enumerate((reqs[:half], reqs[half:])):  # epoch 2 starts once epoch 1 is done
        for rid, prompt, n in part:
            engine.add(rid, prompt, SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=n,
                                                      ignore_eos=ignore_eos), 0)
        while engine.has_work():
            before = dict(engine.counts)
            for f in engine.step():
                responses[f.req_id] = f.response
            for c, k in (("decodes", "decodes"), ("drafted", "drafted_tokens"), ("accepted", "accepted_tokens")):
                rows[c].append(engine.counts[k] - before[k])
            rows["epoch"].append(epoch)
    seconds = time.perf_counter() - t
    steps = {c: np.array(v) for c, v in rows.items()}
    tokens = sum(len(r) for r in responses.values())
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "engine_steps": len(rows["epoch"]),
            **speculation_figures(steps),
            "by_epoch": {str(ep + 1): {k: v for k, v in speculation_figures(
                {c: a[steps["epoch"] == ep] for c, a in steps.items()}).items() if k != "by_batch"}
                for ep in range(2)}, "responses": responses}


def bench_speculation(out: Path, cases: list[str], prompts: int = 8, repeats: int = 3, draft_tokens: int = 4,
                      console=None) -> dict:
    import torch
    from rich.progress import Progress

    from ..engine.model import load_model
    from ..launch.local import resolve_model

    methods = list(METHODS)
    result: dict = {"torch_threads": torch.get_num_threads(), "repeats": repeats, "prompts": prompts,
                    "draft_tokens": draft_tokens, "cases": {}}
    with Progress(console=console, transient=True) as bar:
        job = bar.add_task("speculation bench", total=len(cases) * len(BATCHES) * repeats * len(methods))
        for name in cases:
            path, sets = CASES[name]
            cfg = load_config(path, sets)
            model_dir = resolve_model(cfg)
            model = load_model(model_dir)
            reqs, ignore_eos = requests(cfg, model_dir, prompts)
            rows = {}
            for batch in BATCHES:
                runs: dict[str, list[dict]] = {m: [] for m in methods}
                for _ in range(repeats):
                    for m in methods:
                        runs[m].append(decode(model, cfg, reqs, m, batch, draft_tokens, ignore_eos))
                        bar.update(job, advance=1, description=f"speculation bench: {name} b{batch} {m}")
                base = runs["none"][0]["responses"]
                rows[f"b{batch}"] = row = {}
                for m, rs in runs.items():
                    first = rs[0]
                    row[m] = {k: v for k, v in first.items() if k not in ("responses", "tokens_per_s")}
                    row[m]["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rs)
                    row[m]["speedup"] = statistics.median(r["tokens_per_s"] / n["tokens_per_s"]
                                                          for r, n in zip(rs, runs["none"], strict=True))
                    row[m]["same_responses"] = sum(first["responses"][i] == base[i] for i in base) / len(base)
                if console:
                    console.print(f"{name} b{batch}: " + "; ".join(
                        f"{m} {r['tokens_per_s']:,.0f} tok/s ({r['speedup']:.2f}x), {r['tokens_per_forward']:.2f} "
                        f"tok/forward, acceptance {r['acceptance']:.2f}" for m, r in row.items()))
            result["cases"][name] = {"config": path, "set": sets, "group_size": cfg.batch.group_size,
                                     "temperature": cfg.sampling.temperature, "batches": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "speculation.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    fig, axes = plt.subplots(2, len(cases), figsize=(5 * len(cases), 7), squeeze=False)
    for col, (name, case) in enumerate(cases.items()):
        batches = list(case["batches"])
        x = np.arange(len(batches))
        for i, m in enumerate(METHODS[1:]):
            tpf = [case["batches"][b][m]["tokens_per_forward"] for b in batches]
            spd = [case["batches"][b][m]["speedup"] for b in batches]
            axes[0][col].bar(x + 0.35 * i, tpf, 0.35, label=m)
            axes[1][col].bar(x + 0.35 * i, spd, 0.35, label=m)
        for row, label in ((0, "tokens per target forward"), (1, "tokens/s against none (median)")):
            ax = axes[row][col]
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(x + 0.175, [f"max_num_seqs {b[1:]}" for b in batches])
            ax.set_ylabel(label)
            ax.legend()
        axes[0][col].set_title(f"{name} (T={case['temperature']}, G={case['group_size']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
