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


def scrape(port: int) -> dict[str, float]:
    """Every sample of the endpoint's text format: ``name{labels}`` -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}": s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_prometheus_sink_serves_step_records_and_the_live_state(tmp_path):
    from dora_hpc.runtime.metrics import PrometheusSink

    sink = PrometheusSink(tmp_path, 0)
    port = int((tmp_path / "prometheus-port").read_text())
    try:
        for step in (0, 1):
            sink.log(step, {"train/loss": 0.5 + step, "rollout/tokens_per_s": 100.0, "staleness/mean": 0.5,
                            "staleness/groups_at_0": 2, "staleness/groups_at_1": 2, "staleness/tokens_at_0": 30,
                            "staleness/tokens_at_1": 50, "trainer_wait/window_s": 1.5, "trainer_wait/tail_s": 0.0,
                            "instances/fenced": step, "instances/joined": 0, "rollout/instances_behind_1": 1})
        sink.live({"step": 2, "latest": 2, "instances": [[2, False, 3], [1, True, 0], [None, False, 0]],
                   "fenced": [2], "queued": {"2": 4}})
        got = scrape(port)
    finally:
        sink.close()
    assert got["dora_step{}"] == 2 and got["dora_latest_version{}"] == 2 and got["dora_versions_live{}"] == 2
    assert got["dora_train_loss{}"] == 1.5 and got["dora_rollout_tokens_per_s{}"] == 100
    assert got["dora_staleness_groups_total{staleness=1}"] == 4
    assert got["dora_staleness_tokens_total{staleness=0}"] == 60
    assert got["dora_trainer_wait_seconds_total{kind=window}"] == 3.0
    assert got["dora_instances_fenced_total{}"] == 1 and got["dora_instances_live{}"] == 2
    assert got["dora_queued_groups{version=2}"] == 4
    assert not any("instances_behind" in k for k in got)  # per-step labels that would go stale: not served


@pytest.mark.slow
def test_a_runs_prometheus_endpoint_is_scraped_while_it_trains(tmp_path):
    """``metrics.prometheus``: rank 0 serves its figures during a real run; the counts the endpoint shows
    add up to what the run's logs hold."""
    run_dir, steps = tmp_path / "prom", 20
    proc = launch(run_dir, "configs/tiny-cpu.yaml", "--set", f"train.max_steps={steps}", *BASE,
                  "--set", "metrics.prometheus=0")
    seen = []
    try:
        wait_for(lambda: (run_dir / "prometheus-port").is_file())
        port = int((run_dir / "prometheus-port").read_text())
        wait_for(lambda: seen.append(scrape(port)) or seen[-1].get("dora_step{}", 0) >= 2)
        mid = seen[-1]
        assert proc.poll() is None, "the run ended before the endpoint showed two steps"
    finally:
        err = finish(proc, 240)
    assert proc.returncode == 0, err[-3000:]
    assert mid["dora_instances_live{}"] == 3 and 1 <= mid["dora_versions_live{}"] <= 3, mid
    assert mid["dora_rollout_tokens_per_s{}"] >= 0 and "dora_train_loss{}" in mid
    trained = sum(v for k, v in mid.items() if k.startswith("dora_staleness_groups_total"))
    assert trained == 4 * mid["dora_step{}"] or trained == 4 * (mid["dora_step{}"] - 1), mid  # TBS a step
    assert "metrics sink" not in err  # no sink failed
    assert set(k for k in mid if k.startswith("dora_staleness_groups_total")) <= {
        f"dora_staleness_groups_total{{staleness={s}}}" for s in range(3)}
    assert sum(v for k, v in mid.items() if k.startswith("dora_staleness_tokens_total")) > 0
