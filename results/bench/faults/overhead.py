"""Issue 56: what fault-tolerant trainer replicas cost when nothing fails. configs/tiny-cpu.yaml with two
trainer ranks, as data-parallel ranks (``train.replicas: 1``: one gradient all-reduce over gloo) and as two
torchft replicas (``train.replicas: 2``: a quorum at every step's start, the all-reduce through torchft's
Manager, every trajectory sent to both), alternating A B A B on the local launcher; trained tokens/s from
each run's logs (``analyze``), the ratio of each pair and their median.

    .venv/bin/python results/bench/faults/overhead.py [PAIRS] > results/bench/faults/overhead.json

With ``--groups``, replica groups of FSDP2 ranks instead: four trainer ranks sharding one model (``train.replicas:
1``) against two groups of two (``train.replicas: 2``, HSDP).

    .venv/bin/python results/bench/faults/overhead.py [PAIRS] --groups > results/bench/faults/overhead-groups.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dora_hpc.analysis.basic import analyze

REPO = Path(__file__).resolve().parents[3]
SETTINGS = ["cluster.trainer_ranks=2", "train.max_steps=16", "train.checkpoint_every=0"]
CASES = {"data parallel": ["train.replicas=1"], "replicas": ["train.replicas=2"]}
GROUPS = ["cluster.trainer_ranks=4", "train.backend=fsdp", "train.max_steps=16", "train.checkpoint_every=0"]


def one(case: str, run_dir: Path, settings: list[str]) -> dict:
    sets = [x for kv in (*settings, *CASES[case]) for x in ("--set", kv)]
    subprocess.run([sys.executable, "-m", "dora_hpc.cli", "run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir),
                    *sets], cwd=REPO, capture_output=True, text=True, timeout=900, check=True)
    a = analyze(run_dir)
    assert a["steps"] == 16 and not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups")), a
    return {"trained_tokens_per_s": a["throughput_tokens_per_s"], "trainer_wait_fraction": a["trainer_wait_fraction"]}


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--groups"]
    settings = GROUPS if "--groups" in sys.argv else SETTINGS
    pairs = int(args[0]) if args else 3
    root = Path(tempfile.mkdtemp(prefix="ft-overhead-"))
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for i in range(pairs):
        for case in CASES:
            runs[case].append(one(case, root / f"{i}-{case.replace(' ', '-')}", settings))
            print(f"pair {i} {case}: {runs[case][-1]['trained_tokens_per_s']:,.0f} trained tokens/s", file=sys.stderr,
                  flush=True)
    ratios = [r["trained_tokens_per_s"] / d["trained_tokens_per_s"]
              for r, d in zip(runs["replicas"], runs["data parallel"], strict=True)]
    json.dump({"what": __doc__.split("\n\n")[0], "settings": settings, "cases": CASES, "runs": runs,
               "replicas_over_data_parallel": ratios, "median_ratio": statistics.median(ratios)}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
