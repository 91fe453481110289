"""The prepared GPU check (run by tools/gpu_check.sh on one GPU): one section per process, each writing
``<work>/<section>.json`` with its measurements or the error that stopped it; ``summary`` merges them.

    python tools/gpu_check.py SECTION --work /tmp/dora-gpu-check [--small] [--device cpu]
    python tools/gpu_check.py summary --work /tmp/dora-gpu-check --out results/gpu

(--small --device cpu is a dry run of the script's logic on a machine without a GPU.)

Sections:
  model     write the check's model: a Qwen2.5-0.5B-shaped Qwen2 (random weights, bf16) to <work>/model
  engine    built-in engine on the GPU: generation tokens/s at batch 1, 16, 64 (128-token prompts)
  kv        KV migration between two engines on the GPU vs re-prefilling, for 4k-32k-token contexts:
            bytes, GB/s, seconds of each, and whether the greedy continuation is identical
  weights   weight publish through host memory (our MPI data plane's path): GPU->host and host->GPU GB/s
  fsdp      one FSDP2 GRPO step (NCCL, one rank) on the model: seconds and trained tokens/s
  megatron  one megatron-core GRPO step (TP=1, NCCL) on the model
  vllm      vLLM generation tokens/s at the same batch sizes (where vLLM is installed)
  runtime   a real DORA run of the tiny config with runtime.device=cuda (mpiexec: orchestrator, one
            trainer, three rollout ranks sharing the GPU): steps, invariants, migrations, verified loads

Every figure is measured after a warm-up, with torch.cuda.synchronize() around it; nothing is estimated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936)  # Qwen2.5-0.5B
SMALL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096)    # --small: a quick dry run of the script


SECTIONS = ["model", "engine", "kv", "weights", "fsdp", "megatron", "vllm", "runtime"]
DEVICE = "cuda"
DTYPE = torch.bfloat16


def model_dir(work: Path) -> Path:
    return work / "model"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - t, result


def section_model(work: Path, small: bool) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**(SMALL if small else SHAPE), max_position_embeddings=40960, tie_word_embeddings=True,
                      rope_theta=1e6, eos_token_id=0, bos_token_id=0, pad_token_id=0, dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(model_dir(work), safe_serialization=True)
    (model_dir(work) / "generation_config.json").unlink(missing_ok=True)
    return {"params": sum(p.numel() for p in model.parameters()), "config": cfg.to_dict()}


def _engine(work: Path, kv_tokens: int, model=None, **kw):
    from dora_hpc.engine.engine import Engine
    from dora_hpc.engine.model import load_model

    model = model or load_model(model_dir(work), dtype=DTYPE, device=DEVICE)
    return Engine(model, kv_blocks=kv_tokens // 16 + 1, block_size=16, **kw), model


def _generate(engine, batch: int, prompt_len: int, new: int, first_id: int) -> tuple[float, int]:
    from dora_hpc.engine.sampling import SamplingParams

    gen = torch.Generator().manual_seed(first_id)
    for i in range(batch):
        prompt = torch.randint(10, 4000, (prompt_len,), generator=gen).tolist()
        engine.add(first_id + i, prompt, SamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0), 0)
    n = 0

    def run():
        nonlocal n
        while engine.has_work():
            n += sum(len(f.response) for f in engine.step())
    s, _ = timed(run)
    return s, n


def section_engine(work: Path, small: bool) -> dict:
    engine, _ = _engine(work, 64 * 300, max_num_seqs=64, max_batched_tokens=8192)
    _generate(engine, 4, 32, 8, 10**6)  # warm-up
    rows = []
    for batch in (1, 16, 64):
        s, n = _generate(engine, batch, 128, 128, batch * 1000)
        rows.append({"batch": batch, "prompt_tokens": 128, "new_tokens": n, "seconds": s, "tokens_per_s": n / s})
    return {"dtype": str(DTYPE), "runs": rows}


def section_kv(work: Path, small: bool) -> dict:
    from dora_hpc.engine.sampling import SamplingParams

    contexts = [1024, 2048] if small else [4096, 8192, 16384, 32768]
    cap = max(contexts) + 64
    a, model = _engine(work, cap, max_num_seqs=1, max_batched_tokens=4096)
    b, _ = _engine(work, cap, model=model, max_num_seqs=1, max_batched_tokens=4096)
    c, _ = _engine(work, cap, model=model, max_num_seqs=1, max_batched_tokens=4096)
    rows = []
    for i, ctx in enumerate([contexts[0]] + contexts):  # the first is a warm-up
        rid = i
        prompt = torch.randint(10, 4000, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
        a.add(rid, prompt, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0), 0)
        while a.progress(rid)[1] < 1:
            a.step()
        t_export, (meta, kv) = timed(lambda rid=rid: a.export(rid))
        t_to_host, host = timed(lambda kv=kv: kv.to("cpu", copy=True))
        t_import, _ = timed(lambda meta=meta, host=host: b.import_(meta, host))
        t_reprefill, _ = timed(lambda meta=meta: (c.import_(meta, None), c.step()))
        outs = []
        for e in (b, c):
            while e.has_work():
                outs += [f.response for f in e.step()]
        nbytes = kv.numel() * kv.element_size()
        migrate = t_export + t_to_host + t_import
        if i:
            rows.append({"context_tokens": ctx, "kv_bytes": nbytes, "export_s": t_export, "to_host_s": t_to_host,
                         "import_s": t_import, "migrate_s": migrate, "migrate_gb_per_s": nbytes / migrate / 1e9,
                         "reprefill_s": t_reprefill, "reprefill_over_migrate": t_reprefill / migrate,
                         "continuation_identical": len(outs) == 2 and outs[0] == outs[1]})
    return {"dtype": str(DTYPE), "path": "GPU -> host -> GPU (the MPI data plane's path on one GPU)", "runs": rows}


def section_weights(work: Path, small: bool) -> dict:
    from dora_hpc.engine.model import load_model

    model = load_model(model_dir(work), dtype=DTYPE, device=DEVICE)
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=DEVICE == "cuda") for k, t in state.items()}
    rows = []
    for _ in range(3):
        d2h, _ = timed(lambda: [pinned[k].copy_(t, non_blocking=True) for k, t in state.items()])
        h2d, _ = timed(lambda: [t.copy_(pinned[k], non_blocking=True) for k, t in state.items()])
        rows.append({"d2h_s": d2h, "h2d_s": h2d, "d2h_gb_per_s": nbytes / d2h / 1e9,
                     "h2d_gb_per_s": nbytes / h2d / 1e9})
    return {"bytes": nbytes, "tensors": len(state), "runs": rows,
            "note": "one GPU: NCCL trainer->rollout broadcast needs two devices; this is the host-staged path"}


def _train(work: Path, backend: str) -> dict:
    from dora_hpc.core.trajectory import Trajectory
    from dora_hpc.train.dp import DataParallel
    from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer

    dp = DataParallel(None, collectives="nccl" if DEVICE == "cuda" else "gloo")
    mp = "bf16" if DEVICE == "cuda" and backend == "fsdp" else "no"  # megatron runs in float32
    trainer = GRPOTrainer(model_dir(work), GRPOConfig(lr=1e-6, micro_batch=4), dp=dp, backend=backend,
                          mixed_precision=mp)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for g in range(4):
        prompt = torch.randint(10, 4000, (128,), generator=gen).tolist()
        for _ in range(4):
            resp = torch.randint(10, 4000, (384,), generator=gen).tolist()
            samples.append(Trajectory(-1, g, -1, prompt, resp, (-torch.rand(384, generator=gen)).tolist(),
                                      float(torch.rand(1, generator=gen))))
    rows = []
    for _ in range(3):  # the first includes warm-up
        s, m = timed(lambda: trainer.train_step(samples))
        rows.append({"seconds": s, "tokens": m["tokens"], "trained_tokens_per_s": m["tokens"] / s,
                     "loss": m["loss"], "grad_norm": m["grad_norm"]})
    t_gather, state = timed(trainer.state_dict)
    publish = _publish(trainer, samples)
    dp.close()
    return {"backend": backend, "mixed_precision": mp, "samples": len(samples), "sequence_tokens": 512, "runs": rows,
            "gather_full_weights_s": t_gather, "publish": publish,
            "max_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None,
            "weights": len(state)}


def _publish(trainer, samples) -> dict:
    """A timed sharded publish (this rank's shard in bfloat16, as the trainer keeps each version) and a timed
    delta publish: the next step's shard against it, encoded, then applied as an instance does (bit-exact)."""
    from dora_hpc.train.publish import Delta, apply_delta, delta, shard_digest, wire_bytes

    dtype = torch.bfloat16
    t_shard, before = timed(lambda: trainer.backend.shard_state_dict(0, 1, dtype))
    trainer.train_step(samples)
    after = trainer.backend.shard_state_dict(0, 1, dtype)
    t_delta, pieces = timed(lambda: {n: delta(p, before[n]) or p for n, p in after.items()})
    t_apply, got = timed(lambda: {n: apply_delta(before[n], p) if isinstance(p, Delta) else p
                                  for n, p in pieces.items()})
    whole = sum(p.numel() * p.element_size() for p in after.values())
    sent = sum(wire_bytes(tuple(p.shape), p.values.numel() if isinstance(p, Delta) else -1, 2) for p in pieces.values())
    return {"shard_s": t_shard, "delta_encode_s": t_delta, "delta_apply_s": t_apply, "whole_bytes": whole,
            "delta_bytes": sent, "delta_ratio": sent / whole, "bit_exact": shard_digest(got) == shard_digest(after)}


def section_fsdp(work: Path, small: bool) -> dict:
    return _train(work, "fsdp")


def section_megatron(work: Path, small: bool) -> dict:
    return _train(work, "megatron")


def section_vllm(work: Path, small: bool) -> dict:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed on this machine (its wheels exceed what can be carried)"}
    from vllm import LLM, SamplingParams

    from dora_hpc.engine.sampling import SamplingParams as DoraParams
    from dora_hpc.engine.vllm import VllmEngine

    # a borrowed instance's sleep and wake (cluster.elastic): vLLM's sleep mode on CUDA, then new weights
    eng = VllmEngine(model_dir(work), kv_blocks=1024, dtype="bfloat16", gpu_memory_utilization=0.3, version=0,
                     sleepable=True)
    state = eng.weights()
    t_sleep, freed = timed(eng.sleep)
    t_wake, _ = timed(lambda: eng.load_weights(state, 1))
    eng.add(0, torch.randint(10, 4000, (64,)).tolist(), DoraParams(max_tokens=32, ignore_eos=True), 1)
    done = []
    while eng.has_work():
        done += eng.step()
    sleep = {"sleep_mode": eng.sleep_mode, "freed_bytes": freed, "sleep_s": t_sleep, "wake_and_load_s": t_wake,
             "tokens_after_wake": len(done[0].response)}
    eng.close()

    llm = LLM(str(model_dir(work)), dtype="bfloat16", gpu_memory_utilization=0.5, enforce_eager=False,
              skip_tokenizer_init=True)
    rows = []
    for batch in (1, 16, 64):
        prompts = [{"prompt_token_ids": torch.randint(10, 4000, (128,)).tolist()} for _ in range(batch)]
        sp = SamplingParams(max_tokens=128, ignore_eos=True, temperature=1.0)
        llm.generate(prompts[:1], sp)
        s, res = timed(lambda prompts=prompts, sp=sp: llm.generate(prompts, sp))
        n = sum(len(r.outputs[0].token_ids) for r in res)
        rows.append({"batch": batch, "new_tokens": n, "seconds": s, "tokens_per_s": n / s})
    return {"runs": rows, "sleep": sleep}


def section_runtime(work: Path, small: bool) -> dict:
    import shutil
    import subprocess

    from dora_hpc.analysis.basic import analyze

    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "dora_hpc.cli", "run", "configs/tiny-cpu.yaml", "--set", f"runtime.device={DEVICE}",
           "--set", "train.max_steps=4", "--set", "batch.tbs=4", "--set", "batch.rbs=6", "--run-dir", str(run_dir)]
    s, p = timed(lambda: subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=95))
    if p.returncode != 0:
        raise RuntimeError(f"dora-hpc run exited {p.returncode}: {p.stderr[-3000:]}")
    a = analyze(run_dir)
    return {"command": " ".join(cmd[1:]), "seconds": s, "steps": a["steps"], "consumed": a["consumed"],
            "invariants": {k: v for k, v in a["invariants"].items() if k != "offenders"},
            "migrations": a["migrations"], "reprefill_tokens": a["reprefill_tokens"], "weights": a["weights"],
            "staleness": a["staleness"], "gpu_binding": [line for line in p.stderr.splitlines() if "GPU" in line]}


def summary(work: Path, out: Path) -> None:
    """Merge the sections' records into <out>/gpu_check.json and print a short table."""
    records = {name: {"ok": False, "error": "no record: the section timed out or crashed (see log.txt)"}
               for name in SECTIONS}
    records.update((p.stem, json.loads(p.read_text())) for p in sorted(work.glob("*.json")))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(records, indent=1))
    for name, r in records.items():
        status = "ok" if r.get("ok") else r.get("skipped") or r.get("error", "?").splitlines()[0][:100]
        print(f"{name:9s} {r.get('wall_s', 0):7.1f} s  {status}")


def main() -> None:
    global DEVICE, DTYPE
    ap = argparse.ArgumentParser()
    ap.add_argument("section", choices=SECTIONS + ["summary"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dora-gpu-check"), help="model and per-section records")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "gpu", help="summary: where gpu_check.json goes")
    ap.add_argument("--small", action="store_true", help="a small model and short contexts (a dry run)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run without a GPU")
    args = ap.parse_args()
    if args.section == "summary":
        summary(args.work, args.out)
        return
    DEVICE, DTYPE = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    args.work.mkdir(parents=True, exist_ok=True)
    record: dict = {"section": args.section, "torch": torch.__version__, "small": args.small,
                    "device": torch.cuda.get_device_name() if DEVICE == "cuda" and torch.cuda.is_available()
                    else DEVICE}
    t = time.perf_counter()
    try:
        if DEVICE == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        record.update(globals()[f"section_{args.section}"](args.work, args.small))
        record["ok"] = "skipped" not in record
    except Exception as e:  # noqa: BLE001 - recorded, and the next section still runs
        record.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    record["wall_s"] = time.perf_counter() - t
    (args.work / f"{args.section}.json").write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({k: v for k, v in record.items() if k not in ("traceback", "config")}, default=str)[:2000])


if __name__ == "__main__":
    main()
