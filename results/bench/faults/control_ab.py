"""Control messages over gloo links (this tree) against over MPI (a git ref before them), on the README run:
pairs A B on one host, throughput and invariants from `dora-hpc analyze`. Writes JSON to stdout.

    .venv/bin/python results/bench/faults/control_ab.py 5011764 5 > results/bench/faults/control-plane.json

The ref is checked out into a temporary worktree and run from there with this .venv's Python (its code on
PYTHONPATH ahead of the installed package); both arms run configs/tiny-cpu.yaml unchanged.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PY = REPO / ".venv" / "bin" / "python"
INVARIANTS = ("mixed_version_trajectories", "staleness_over_k", "lost_groups", "duplicate_groups", "split_groups")


def one(tree: Path, run_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([PY, "-m", "dora_hpc.cli", "run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir)], cwd=tree,
                   env=env, check=True, capture_output=True, timeout=600)
    out = run_dir / "a.json"
    subprocess.run([PY, "-m", "dora_hpc.cli", "analyze", str(run_dir), "--json", str(out)], cwd=tree, env=env,
                   check=True, capture_output=True, timeout=300)
    a = json.loads(out.read_text())
    return {"throughput_tokens_per_s": round(a["throughput_tokens_per_s"], 1),
            "mean_staleness": round(a["staleness"]["mean"], 3),
            "invariants_nonzero": sum(1 for k in INVARIANTS if a["invariants"][k])}


def main(ref: str, pairs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), ref], cwd=REPO, check=True, capture_output=True)
        try:
            runs = []
            for p in range(1, pairs + 1):
                for arm, tree in (("mpi", old), ("gloo links", REPO)):
                    r = one(tree, Path(tmp) / f"{arm.replace(' ', '-')}-{p}")
                    runs.append({"pair": p, "control": arm, **r})
                    print(f"pair {p} {arm}: {r}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
    tput = {arm: [r["throughput_tokens_per_s"] for r in runs if r["control"] == arm] for arm in ("mpi", "gloo links")}
    ratios = [g / m for g, m in zip(tput["gloo links"], tput["mpi"], strict=True)]
    return {"what": "the README run (configs/tiny-cpu.yaml, local launcher, one host, 2 cores): control messages over "
                    f"MPI (git {ref}) against over gloo links (this tree), {pairs} pairs A B, throughput from "
                    "dora-hpc analyze",
            "runs": runs, "ratios_links_over_mpi": [round(x, 3) for x in ratios],
            "median_ratio": round(statistics.median(ratios), 3),
            "median_tokens_per_s": {arm: statistics.median(v) for arm, v in tput.items()}}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2])), indent=1))
