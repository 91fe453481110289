"""Issue 47, item 4: what one lost rollout instance costs a run under Slurm, fenced-and-continue
(``slurm.fence_rollout: true``) against requeue-and-resume (``false``), for the same kill at the same step,
on the namespaced local cluster (NETNS=1 NNODES=5 bash slurm/start_local_slurm.sh). With ``--trainer``
(issue 56): what one lost trainer costs, two fault-tolerant replicas (``train.replicas: 2``: the other takes
the steps) against two data-parallel trainer ranks (the job requeues); rank 2, a trainer, is killed.

Each run: configs/tiny-cpu.yaml, one plain job over 4 nodes (orchestrator and trainer on the first, one
rollout instance on each of the others), a checkpoint every 5 steps; when the run has trained 8 steps,
SIGKILL rank 3 (a rollout rank). The cases alternate (fence, requeue, fence, requeue, ...), so each pair
sees the same machine. Every figure comes from the run's own logs: a step's wall time is its attempt's
start (attempts.jsonl) plus its ``t_end``; a step trained twice (requeue) counts once, in the attempt that
kept it (the last).

    .venv/bin/python results/bench/faults/measure.py [REPEATS] > results/bench/faults/faults.json
    .venv/bin/python results/bench/faults/measure.py [REPEATS] --trainer > results/bench/faults/trainer.json
    .venv/bin/python results/bench/faults/plot.py   # faults.png from faults.json
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dora_hpc.analysis.basic import analyze
from dora_hpc.store.shards import ShardError, read_table

REPO = Path(__file__).resolve().parents[3]
STEPS, KILL_AT, RANK = 30, 8, 3
SETTINGS = [f"train.max_steps={STEPS}", "batch.tbs=4", "batch.rbs=6", "cluster.rollout_instances=3",
            "slurm.heterogeneous=false", "slurm.trainer.nodes=4", "train.checkpoint_every=5", "slurm.time_min=30"]
CASES = {"fenced": ["slurm.fence_rollout=true"], "requeued": ["slurm.fence_rollout=false"]}
if "--trainer" in sys.argv:  # two trainers: fault-tolerant replicas against data-parallel ranks
    sys.argv.remove("--trainer")
    RANK = 2
    CASES = {"fenced": ["cluster.trainer_ranks=2", "train.replicas=2"], "requeued": ["cluster.trainer_ranks=2"]}


def submit(run_dir: Path, case: str) -> str:
    sets = [x for kv in (*SETTINGS, *CASES[case]) for x in ("--set", kv)]
    p = subprocess.run([sys.executable, "-m", "dora_hpc.cli", "submit", "configs/tiny-cpu.yaml", "--run-dir",
                        str(run_dir), *sets], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    return re.search(r"submitted job (\d+)", p.stdout).group(1)


def state(job: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True).stdout
    return out.split()[-1] if out.split() else "PENDING"


def steps_trained(run_dir: Path) -> int:
    try:
        return len(read_table(run_dir, "train", "steps", ["step"])["step"])
    except ShardError:
        return 0


def wait(cond, job: str, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end or state(job) in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            raise SystemExit(f"job {job}: {what} did not happen ({state(job)})")
        time.sleep(0.5)


def timeline(run_dir: Path) -> list[dict]:
    """Every step trained, in every attempt: its wall end (every rank logs seconds since the run's t0 in
    launch.json, in every attempt), tokens and attempt, and whether the run kept it (a step trained twice:
    the last attempt's)."""
    t0 = json.loads((run_dir / "launch.json").read_text())["t0"]
    t = read_table(run_dir, "train", "steps", ["step", "t_end", "tokens", "attempt"])
    rows = [{"step": int(s), "wall": t0 + float(e), "tokens": int(n), "attempt": int(a)}
            for s, e, n, a in zip(t["step"], t["t_end"], t["tokens"], t["attempt"], strict=True)]
    last = {r["step"]: max(x["attempt"] for x in rows if x["step"] == r["step"]) for r in rows}
    return sorted(({**r, "kept": r["attempt"] == last[r["step"]]} for r in rows), key=lambda r: r["wall"])


def one(case: str, root: Path) -> dict:
    run_dir = root / case
    job = submit(run_dir, case)
    try:
        wait(lambda: steps_trained(run_dir) >= KILL_AT, job, 600, f"{KILL_AT} steps")
        pid = int((run_dir / "pids" / f"rank-{RANK}").read_text())
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        wait(lambda: state(job) == "COMPLETED", job, 900, "completion")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    (run_dir / "killed_at").write_text(repr(t_kill))
    return figures(run_dir, job, t_kill)


def figures(run_dir: Path, job: str, t_kill: float) -> dict:
    """The run's figures around the kill at wall time ``t_kill``, from its logs."""
    rows = timeline(run_dir)
    a = analyze(run_dir)
    inv = {k: a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups", "staleness_over_k",
                                           "mixed_version_trajectories")}
    assert a["steps"] == STEPS and not any(inv.values()), (run_dir, a["steps"], inv)
    before = [r for r in rows if r["wall"] <= t_kill]
    done = {r["step"] for r in before}
    rate = sum(r["tokens"] for r in before[2:]) / (before[-1]["wall"] - before[1]["wall"])  # steady, pre-kill
    # what a run without the kill still had to train at that moment, at the rate it was training
    left = sum(r["tokens"] for r in rows if r["kept"] and r["step"] not in done)
    end = max(r["wall"] for r in rows)
    return {"job": job, "attempts": len((run_dir / "attempts.jsonl").read_text().splitlines()),
            "t_kill": t_kill, "steps_before_kill": len(done), "steps_trained": len(rows),
            "steps_redone": len(rows) - STEPS, "tokens_per_s_before": rate,
            "tokens_per_s_after": sum(r["tokens"] for r in rows if r["wall"] > t_kill) / (end - t_kill),
            "kill_to_end_s": end - t_kill,
            "kill_to_next_step_s": min(r["wall"] for r in rows if r["wall"] > t_kill) - t_kill,
            "lost_s": end - t_kill - left / rate,  # against the same run without the kill
            "timeline": [{**r, "since_kill": r["wall"] - t_kill} for r in rows]}


def main() -> None:
    """``measure.py [REPEATS]``: run; ``measure.py --again ROOT``: the figures of runs already made under ROOT."""
    again = sys.argv[1] == "--again" if len(sys.argv) > 1 else False
    repeats = len(list(Path(sys.argv[2]).iterdir())) if again else int(sys.argv[1]) if len(sys.argv) > 1 else 2
    root = Path(sys.argv[2]) if again else Path(tempfile.mkdtemp(prefix="faults-"))
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for i in range(repeats):
        for case in CASES:
            if again:
                d = root / str(i) / case
                job = next((d / "slurm").glob("*_submission.sh")).name.split("_")[0]
                runs[case].append(figures(d, job, float((d / "killed_at").read_text())))
            else:
                runs[case].append(one(case, root / str(i)))
            print(f"repeat {i} {case}: lost {runs[case][-1]['lost_s']:.1f} s", file=sys.stderr, flush=True)
    keys = ("lost_s", "kill_to_end_s", "kill_to_next_step_s", "tokens_per_s_before", "tokens_per_s_after",
            "steps_redone", "attempts")
    med = {c: {k: statistics.median(r[k] for r in runs[c]) for k in keys} for c in CASES}
    json.dump({"what": __doc__.split("\n\n")[0], "settings": SETTINGS, "cases": CASES,
               "kill": {"rank": RANK, "at_step": KILL_AT},
               "medians": med,
               "requeued_over_fenced_lost_s": statistics.median(
                   r["lost_s"] / f["lost_s"] for r, f in zip(runs["requeued"], runs["fenced"], strict=True)),
               "runs": runs}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
