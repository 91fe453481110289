"""SmolLM2-135M-Instruct on addition under DORA K=2 with LoRA, one run per (rank, seed): train 30 steps, score
the final checkpoint held out, and keep the run's figures. A (rank, seed) whose eval is here already is left
alone, so the script resumes where it stopped.

    .venv/bin/python results/bench/lora/smollm2/runs.py --ranks 1,8,32 --seeds 1,2 [--runs runs] [--set KEY=VALUE ...]

``--set``: more config settings for every run (kept in each ``.run.json`` as ``settings``), e.g.
``train.mixed_precision=no`` on a CPU without bfloat16 instructions.

Writes, per run, ``r<rank>-s<seed>.run.json`` (reward per step and ``dora-hpc analyze``'s figures) and
``r<rank>-s<seed>.eval.json`` (``dora-hpc eval --n 200``) beside this file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[3]
CLI = str(Path(sys.executable).parent / "dora-hpc")
LR = "2.0e-4"  # 10x the config's full fine-tuning lr (README: "LoRA Without Regret")
KEPT = ("reward_by_step", "multi_version_batches", "migrations", "logprob_gap", "throughput_tokens_per_s",
        "staleness", "invariants")


def one(rank: int, seed: int, runs: Path, sets: list[str]) -> None:
    name = f"r{rank}-s{seed}"
    if (HERE / f"{name}.eval.json").exists():
        print(f"{name}: kept", flush=True)
        return
    run_dir = runs / f"lora-{name}"
    subprocess.run([CLI, "run", "configs/smollm2-addition.yaml", "--run-dir", str(run_dir),
                    "--set", f"train.lora={{rank: {rank}}}", "--set", f"train.lr={LR}", "--set", f"seed={seed}",
                    "--set", "train.checkpoint_every=30", *(x for kv in sets for x in ("--set", kv))],
                   check=True, cwd=ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "analyze.json"
        subprocess.run([CLI, "analyze", str(run_dir), "--json", str(out)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        figures = json.loads(out.read_text())
    kept = {k: figures[k] for k in KEPT} | ({"settings": sets} if sets else {})
    (HERE / f"{name}.run.json").write_text(json.dumps(kept, indent=2) + "\n")
    subprocess.run([CLI, "eval", str(run_dir), "--n", "200", "--json", str(HERE / f"{name}.eval.json")],
                   check=True, cwd=ROOT)
    print(f"{name}: done", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="1,8,32")
    p.add_argument("--seeds", default="0")
    p.add_argument("--runs", default="runs", help="where the run directories go")
    p.add_argument("--set", action="append", default=[], dest="sets", help="KEY=VALUE for every run")
    a = p.parse_args()
    for seed in (int(s) for s in a.seeds.split(",")):
        for rank in (int(r) for r in a.ranks.split(",")):
            one(rank, seed, Path(a.runs).resolve(), a.sets)
