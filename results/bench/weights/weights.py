"""Weights at cluster scale, measured on SmolLM2-135M (issue: sharded kept versions, sparse-delta publishing).

  python results/bench/weights/weights.py bytes  --work /tmp/w   # 30 steps of the addition run, bf16 publish
  python results/bench/weights/weights.py memory --work /tmp/w --old /path/to/old/checkout
  python results/bench/weights/weights.py report --work /tmp/w   # -> summary.json, weights.png here

``bytes``: every load from the trainers logs the bytes that arrived and what the same pieces whole would have
been (``weight_load`` ops: ``delta_pieces=d/n whole_bytes=B``); the ratio per step is their quotient.
``memory``: DORA K=3 with 2 trainer ranks (fsdp, megatron), 6 steps, each trainer rank's peak resident memory
(VmHWM, sampled from /proc while the run goes) under the code before this change (``--old``: every rank kept
K+2 whole float32 copies) and after it, publishing in float32 (the engine's dtype) and in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ADDITION = ["configs/smollm2-addition.yaml"]
MEMORY_SETS = ["cluster.trainer_ranks=2", "dora.k=3", "train.max_steps=6", "train.mixed_precision='no'",
               "train.checkpoint_every=0"]


def run(code: Path, run_dir: Path, sets: list[str], sample: bool = False) -> dict:
    """One run of the addition config from checkout ``code``; with ``sample``, each rank's peak RSS."""
    cmd = [sys.executable, "-m", "dora_hpc.cli", "run", *ADDITION, "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(code)}
    peaks: dict[int, int] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for f in (run_dir / "pids").glob("rank-*") if (run_dir / "pids").is_dir() else []:
                try:
                    status = Path(f"/proc/{f.read_text().strip()}/status").read_text()
                except (OSError, ValueError):
                    continue
                kb = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), 0)
                rank = int(f.name.split("-")[1])
                peaks[rank] = max(peaks.get(rank, 0), kb * 1024)
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    if sample:
        t.start()
    t0 = time.time()
    p = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=3600)
    done.set()
    if p.returncode != 0:
        raise SystemExit(f"{run_dir}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return {"wall_s": time.time() - t0, "peak_rss_bytes": {str(k): v for k, v in sorted(peaks.items())}}


def cmd_bytes(work: Path) -> None:
    out = run(REPO, work / "bytes", ["train.publish_dtype=bfloat16"])
    (work / "bytes.json").write_text(json.dumps(out, indent=2))


def cmd_memory(work: Path, old: Path, backends: list[str]) -> None:
    """Rows for ``backends`` replace theirs in memory.json (megatron runs TP=1 x DP=2: SmolLM2's 9 heads do
    not split over 2 TP ranks)."""
    path = work / "memory.json"
    rows = [r for r in (json.loads(path.read_text()) if path.exists() else []) if r["backend"] not in backends]
    for backend in backends:
        for label, code, extra in (("before (whole float32 copies)", old, []),
                                   ("after, float32 shards", REPO, ["train.publish_dtype=float32"]),
                                   ("after, bfloat16 shards", REPO, ["train.publish_dtype=bfloat16"])):
            name = f"{backend}-{label.split()[0].rstrip(',')}-{'bf16' if 'bfloat16' in label else 'f32'}"
            tp = ["train.tensor_parallel=1"] if backend == "megatron" else []
            got = run(code, work / name, [*MEMORY_SETS, f"train.backend={backend}", *tp, *extra], sample=True)
            rows.append({"backend": backend, "code": label, "run": name, **got})
            print(json.dumps(rows[-1]), flush=True)
            path.write_text(json.dumps(rows, indent=2))


def load_ratios(run_dir: Path) -> list[dict]:
    sys.path.insert(0, str(REPO))
    from dora_hpc.store.shards import read_table

    ops = read_table(run_dir, "events", "ops", with_rank=True)
    rows = []
    for kind, peer, v, got, detail, rank in zip(ops["kind"], ops["peer"], ops["version"], ops["bytes"], ops["detail"],
                                                ops["rank"], strict=True):
        if kind == "weight_load" and int(peer) == -1:
            fields = dict(x.split("=") for x in str(detail).split()[1:])
            d, n = map(int, fields["delta_pieces"].split("/"))
            rows.append({"version": int(v), "rank": int(rank), "bytes": int(got),
                         "whole_bytes": int(fields["whole_bytes"]), "delta_pieces": d, "pieces": n})
    return sorted(rows, key=lambda r: (r["version"], r["rank"]))


def cmd_report(work: Path) -> None:
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = load_ratios(work / "bytes")
    by_version: dict[int, list[float]] = {}
    for r in loads:
        if r["delta_pieces"]:  # a load against a base the instance held (first loads come whole)
            by_version.setdefault(r["version"], []).append(r["bytes"] / r["whole_bytes"])
    per_step = {v: statistics.median(x) for v, x in sorted(by_version.items())}
    memory = json.loads((work / "memory.json").read_text()) if (work / "memory.json").exists() else []
    summary = {"bytes": {"run": "configs/smollm2-addition.yaml --set train.publish_dtype=bfloat16 (30 steps)",
                         "loads_from_trainers": len(loads), "delta_loads": sum(len(x) for x in by_version.values()),
                         "ratio_by_version": per_step,
                         "ratio_median": statistics.median(per_step.values()) if per_step else None,
                         "ratio_min": min(per_step.values(), default=None),
                         "ratio_max": max(per_step.values(), default=None), "loads": loads},
               "memory": memory}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(list(per_step), list(per_step.values()), "o-")
    axes[0].set(xlabel="version loaded", ylabel="delta bytes / whole bytes", ylim=(0, 1.05),
                title="SmolLM2-135M addition, bf16 publish")
    if memory:
        short = {"before (whole float32 copies)": "before", "after, float32 shards": "f32 shards",
                 "after, bfloat16 shards": "bf16 shards"}
        labels = [f"{m['backend']}\n{short[m['code']]}" for m in memory]
        peaks = [max(m["peak_rss_bytes"][r] for r in ("1", "2")) / 2**30 for m in memory]
        axes[1].bar(range(len(memory)), peaks)
        axes[1].set_xticks(range(len(memory)), labels, fontsize=7)
        axes[1].set(ylabel="peak RSS of a trainer rank, GiB", title="DORA K=3, 2 trainer ranks")
    fig.tight_layout()
    fig.savefig(HERE / "weights.png", dpi=120)
    print(json.dumps({k: v for k, v in summary["bytes"].items() if k != "loads"}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["bytes", "memory", "report"])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--old", type=Path, help="a checkout of the code before sharded versions (memory)")
    ap.add_argument("--backends", default="fsdp,megatron", help="memory: the trainer backends to measure")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    {"bytes": lambda: cmd_bytes(a.work), "memory": lambda: cmd_memory(a.work, a.old, a.backends.split(",")),
     "report": lambda: cmd_report(a.work)}[a.what]()


if __name__ == "__main__":
    main()
