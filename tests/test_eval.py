"""``dora-hpc eval`` on the tiny model: held-out prompts, deterministic greedy scores, clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dora_hpc.config import load_config
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.evaluate import EVAL_SEED_OFFSET, Target, evaluate, heldout

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dora_hpc.cli"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_greedy_eval_is_deterministic_and_the_prompts_are_held_out(tmp_path):
    model = build_tiny_model()
    cfg = load_config("configs/tiny-cpu.yaml")
    a, b = (evaluate(Target(cfg, model, None, None, "tiny"), n=6, samples=2) for _ in range(2))
    assert a["greedy"] == b["greedy"] and a["sampled"] == b["sampled"]
    assert a["n"] == 6 and a["eval_seed"] == cfg.seed + EVAL_SEED_OFFSET
    assert 0 <= a["greedy"]["mean_reward"] <= 1 and a["greedy"]["responses"] == 6 and a["sampled"]["responses"] == 12
    _, prompts, _ = heldout(cfg, model, 512, 6, 10_000)
    from dora_hpc.data.tasks import make_task

    train = {tuple(make_task(cfg, 512, model).prompt(g)) for g in range(10_000)}
    assert not train.intersection(tuple(p) for _, p in prompts)


def test_a_jsonl_eval_skips_every_row_the_run_trains_on(tmp_path):
    """The held-out file shares a row with the training file: that row is skipped (and counted)."""
    rows = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[2:]))
    model = build_tiny_model()
    cfg = load_config("configs/tiny-cpu.yaml", ["task.name=jsonl", f"task.path={tmp_path / 'train.jsonl'}",
                                                f"task.eval_path={tmp_path / 'eval.jsonl'}", "sampling.max_tokens=4"])
    task, prompts, skipped = heldout(cfg, model, 512, 10, 10_000)
    assert skipped == 1 and [task.question(g) for g, _ in prompts] == [r["question"] for r in rows[3:]]
    with pytest.raises(ValueError, match="does not exist"):  # an eval file that is not there
        heldout(load_config("configs/tiny-cpu.yaml", ["task.name=jsonl", f"task.path={tmp_path / 'train.jsonl'}",
                                                      f"task.eval_path={tmp_path / 'nope.jsonl'}"]), model, 512, 10, 10)
    with pytest.raises(ValueError, match="task.eval_path"):
        heldout(load_config("configs/tiny-cpu.yaml", ["task.name=jsonl", f"task.path={tmp_path / 'train.jsonl'}"]),
                model, 512, 10, 10_000)


def test_eval_of_a_missing_model_or_step_exits_2_in_one_line(tmp_path):
    p = cli("eval", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "neither a run directory" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    run_dir = tmp_path / "run"
    assert cli("prepare", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir)).returncode == 0
    p = cli("eval", str(run_dir), "--step", "3")
    assert p.returncode == 2 and "no checkpoint step-3" in p.stderr and "Traceback" not in p.stderr
    p = cli("eval", str(run_dir))
    assert p.returncode == 2 and "no checkpoint yet" in p.stderr
    p = cli("eval", str(run_dir), "--step", "0", "--n", "3", "--samples", "0", "--json", str(tmp_path / "e.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads((tmp_path / "e.json").read_text())
    assert out["step"] == 0 and out["n"] == 3 and "sampled" not in out
