"""Metric sinks on one real local run: TensorBoard scalars equal the HDF5 train-steps table step by step,
through a SIGTERM, a crash and two resumes; W&B offline, beside it, writes a run dir per attempt, every one
continuing the same run."""

import importlib.util
import math
import os
import signal
import subprocess

import pytest
from test_resume import BASE, CLI, REPO, checkpoints, finish, resume, wait_for

from dora_hpc.runtime.metrics import NOT_SCALARS
from dora_hpc.store.shards import TRAIN_STEPS, read_table

TB = ["--set", "metrics.tensorboard=true"]


def launch(run_dir, *args) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "run", *args, "--run-dir", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def train_shards(run_dir) -> int:
    return len(list(run_dir.glob("train-*.h5")))


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


WANDB = ["--set", "metrics.wandb.project=dora-hpc-tests", "--set", "metrics.wandb.mode=offline"]


@pytest.mark.slow
def test_tensorboard_scalars_equal_the_train_steps_table_and_wandb_continues_one_run_through_preemption_and_a_crash(
        tmp_path):
    run_dir, steps = tmp_path / "tb", 10
    wandb = importlib.util.find_spec("wandb") is not None  # a dev extra; without it TensorBoard alone
    # attempt 0: SIGTERM to the whole process group commits the current step (exit 3)
    proc = launch(run_dir, "configs/tiny-cpu.yaml", "--set", f"train.max_steps={steps}", *BASE, *TB,
                  *(WANDB if wandb else []))
    wait_for(lambda: train_shards(run_dir) >= 3)
    os.killpg(proc.pid, signal.SIGTERM)
    err = finish(proc, 120)
    assert proc.returncode == 3, err[-3000:]
    first = checkpoints(run_dir)[-1]
    # attempt 1: resumed, then killed outright after a step past its next checkpoint: the sinks saw steps
    # that attempt 2 trains again
    proc = launch(run_dir, "--resume")
    wait_for(lambda: checkpoints(run_dir)[-1] > first)
    at = train_shards(run_dir)
    wait_for(lambda: train_shards(run_dir) > at)
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc, 60)
    p = resume(run_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "metrics sink" not in p.stderr  # no sink failed
    if wandb:  # one offline run dir per attempt, all under the run id of the first
        wid = (run_dir / "wandb-run-id").read_text().strip()
        runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{wid}"))
        assert len(runs) == 3 and list(runs[0].glob("*.wandb")) and list(runs[2].glob("*.wandb")), runs

    rows = read_table(run_dir, "train", "steps", list(TRAIN_STEPS))
    last = {}  # step -> the row of its latest attempt: the lineage the final weights come from
    for i in sorted(range(len(rows["step"])), key=lambda i: rows["attempt"][i]):
        last[int(rows["step"][i])] = i
    assert sorted(last) == list(range(steps)) and len(rows["step"]) > steps  # some steps were trained twice
    got = scalars(run_dir)
    columns = [c for c in TRAIN_STEPS if c not in NOT_SCALARS]
    assert {f"train/{c}" for c in columns} <= set(got)
    for c in columns:
        series = got[f"train/{c}"]
        assert [s for s, _ in series] == list(range(steps)), (c, series)  # every step once, in order
        for s, value in series:
            want = float(rows[c][last[s]])
            assert (math.isnan(want) and math.isnan(value)) or math.isclose(value, want, rel_tol=1e-6,
                                                                             abs_tol=1e-6), (c, s, value, want)
    for tag in ("rollout/tokens_per_s", "rollout/step_interval_s", "rollout/versions_live", "staleness/max"):
        assert [s for s, _ in got[tag]] == list(range(steps)), tag
    assert max(v for _, v in got["staleness/max"]) <= 2
    # what the trainer waited for (Policy.train_wait) adds up to at most each step's interval
    waits = [got[f"trainer_wait/{w}_s"] for w in ("capacity", "tail", "window")]
    for s, interval in got["rollout/step_interval_s"]:
        total = sum(dict(series)[s] for series in waits)
        assert 0 <= total <= interval + 1e-3, (s, total, interval)
    assert sum(v for series in waits for _, v in series) > 0
    # tokens/s is what finished between two published steps: 0 when a step trains on groups that were
    # already complete (buffered, or read back from the shards on resume) with nothing finishing meanwhile
    rates = [v for _, v in got["rollout/tokens_per_s"]]
    assert min(rates) >= 0 and max(rates) > 0, rates


def test_a_sink_that_fails_warns_once_and_the_run_goes_on(tmp_path, capsys):
    from dora_hpc.config import load_config
    from dora_hpc.runtime.metrics import Sinks

    (tmp_path / "tensorboard").write_text("a file where the event directory should be")
    sinks = Sinks(load_config("configs/tiny-cpu.yaml", ["metrics.tensorboard=true"]), tmp_path, 0, "r")
    sinks.log(0, {"train/loss": 1.0})
    sinks.log(1, {"train/loss": 1.0})
    sinks.close()
    assert sinks.sinks == []
    err = capsys.readouterr().err
    assert err.count("metrics sink tensorboard failed and is switched off") == 1, err
