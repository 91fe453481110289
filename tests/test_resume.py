"""Preemption and resume of real local runs (mpiexec, tiny model): SIGTERM, SIGKILL, corrupt checkpoints,
no checkpoint -- and afterwards, from the HDF5 logs alone, nothing lost, nothing twice, staleness <= K."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora_hpc.analysis.basic import analyze
from dora_hpc.launch.local import DeathWatch
from dora_hpc.store.shards import read_table

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dora_hpc.cli"]
BASE = ["--set", "batch.tbs=4", "--set", "batch.rbs=6", "--set", "train.checkpoint_every=2"]
# every test here launches real runs: all but two are `slow` (tools/test.sh --full); the README tier (tools/test.sh)
# keeps a Ctrl-C stop and its resume, and a hung and a killed rollout rank fenced


def start(run_dir: Path, mode: str, steps: int) -> subprocess.Popen:
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", f"mode={mode}", "--set", f"train.max_steps={steps}",
                 *BASE, "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(cond, timeout: float = 240) -> None:
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, "timed out"
        time.sleep(0.2)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The launcher's stderr once it ends; past ``timeout`` it is killed (its job dies with it) and the
    test fails, so no run outlives its test."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def checkpoints(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit()) if root.exists() else []


def resume(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["run", "--resume", "--run-dir", str(run_dir), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def assert_whole(run_dir: Path, steps: int, k: int) -> dict:
    a = analyze(run_dir)
    inv = a["invariants"]
    assert (inv["lost_groups"], inv["duplicate_groups"], inv["split_groups"], inv["staleness_over_k"],
            inv["mixed_version_trajectories"]) == (0, 0, 0, 0, 0), inv["offenders"]
    assert a["steps"] == steps and a["consumed"] == steps * 4 * 4  # the ledger totals of an uninterrupted run
    assert a["staleness"]["max"] <= k and a["weights"]["mismatched_loads"] == 0
    return a


@pytest.mark.slow
def test_sigterm_then_sigkill_then_resume_loses_nothing(tmp_path):
    run_dir = tmp_path / "dora"
    proc = start(run_dir, "dora", steps=10)
    wait_for(lambda: len(checkpoints(run_dir)) >= 2)
    proc.send_signal(signal.SIGTERM)  # the launcher asks rank 0 for a checkpoint ...
    time.sleep(0.5)
    proc.kill()                       # ... and is killed before or after it lands: every rank must die too
    proc.wait(timeout=30)
    ranks = [int(p.read_text()) for p in (run_dir / "pids").glob("rank-?") if p.is_file()]
    wait_for(lambda: not any(DeathWatch._alive(pid) for pid in ranks), timeout=30)
    # a checkpoint truncated on purpose is skipped with a warning naming it; the previous one is used
    newest = checkpoints(run_dir)[-1]
    weights = run_dir / "checkpoints" / f"step-{newest}" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    p = resume(run_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"skipping checkpoint {run_dir / 'checkpoints' / f'step-{newest}'}" in p.stderr
    a = assert_whole(run_dir, steps=10, k=2)
    assert a["preemption"]["attempts"] == 2 and a["preemption"]["resumed_at_steps"][0] < newest
    assert a["preemption"]["discarded_trajectories"] > 0  # the thrown-away future is in the logs, not trained on


def job_processes(launcher: int) -> list[int]:
    """The launcher, its mpiexec and mpiexec's descendants (hydra's proxy and every rank), from /proc."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [launcher], [launcher]
    while frontier:
        frontier = [pid for pid, pp in parent.items() if pp in frontier]
        found += frontier
    return found


@pytest.mark.parametrize("how,mode", [("SIGINT to the process group", "dora"),
                                      pytest.param("SIGTERM to every process", "one_step", marks=pytest.mark.slow)])
def test_a_signal_to_the_whole_job_commits_the_current_step_and_resumes(tmp_path, how, mode):
    """A terminal's Ctrl-C (SIGINT to the foreground process group), or SIGTERM to each process of the job
    (a container stop, Slurm's preemption): one stop request, a checkpoint of the step the run is at --
    with no periodic checkpoint, so it can only be that one -- exit 3, and --resume finishes the run, in
    DORA and in a barrier mode (one_step) alike."""
    run_dir = tmp_path / mode
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", f"mode={mode}", "--set", "train.max_steps=8", *BASE,
                 "--set", "train.checkpoint_every=0", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a shell's foreground job
    wait_for(lambda: len(list(run_dir.glob("train-*.h5"))) >= 3)  # the trainer writes a shard per step
    if how.startswith("SIGINT"):
        os.killpg(proc.pid, signal.SIGINT)
    else:
        everyone = job_processes(proc.pid)
        assert len(everyone) >= 7  # launcher, mpiexec, its proxy, 5 ranks
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    err = finish(proc, 120)
    assert proc.returncode == 3, err[-3000:]
    assert "died first" not in err and "stopped at checkpoint" in err, err[-3000:]
    assert "continue with: dora-hpc run --resume" in err
    stopped_at, = checkpoints(run_dir)
    assert 3 <= stopped_at < 8
    p = resume(run_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    a = assert_whole(run_dir, steps=8, k=2 if mode == "dora" else 1)
    assert a["preemption"]["resumed_at_steps"] == [stopped_at]


@pytest.mark.slow
def test_resume_without_a_checkpoint_says_so_and_starts_fresh_only_when_asked(tmp_path):
    run_dir = tmp_path / "early"
    proc = start(run_dir, "dora", steps=3)
    wait_for(lambda: (run_dir / "attempts.jsonl").exists())
    proc.kill()
    proc.wait(timeout=30)
    time.sleep(1)
    p = resume(run_dir)
    assert p.returncode == 2 and "no checkpoint under" in p.stderr and "--allow-fresh" in p.stderr
    again = subprocess.run(CLI + ["run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already holds a run" in again.stderr
    p = resume(run_dir, "--allow-fresh")
    assert p.returncode == 0, p.stderr[-3000:]
    a = assert_whole(run_dir, steps=3, k=2)
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 2 and a["preemption"]["chain"] == [1]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 20 MiB tmpfs (the tests run as root): room for the tiny model's first checkpoint (13 MiB) and
    its logs, not for a second checkpoint."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_resumably_with_every_checkpoint_intact(small_tmpfs):
    from dora_hpc.launch.local import RESUMABLE
    from dora_hpc.store import checkpoint

    run_dir = small_tmpfs / "run"
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", "train.max_steps=8", *BASE, "--run-dir", str(run_dir)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == RESUMABLE, p.stderr[-3000:]
    assert f"no space left on device writing {run_dir}/" in p.stderr and "Traceback" not in p.stderr
    assert "free space, then continue with: dora-hpc run --resume" in p.stderr
    assert checkpoint.latest(run_dir).step == 2  # the previous checkpoint still verifies
    from dora_hpc.store.shards import scan

    assert not any(scan(run_dir, kind).bad for kind in ("traj", "events", "train"))  # every *.h5 is whole
    assert not (run_dir / "checkpoints" / "step-4.tmp").exists()  # the failed checkpoint was removed
    subprocess.run(["mount", "-o", "remount,size=200m", str(small_tmpfs)], check=True)  # space freed
    p = resume(run_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    a = assert_whole(run_dir, steps=8, k=2)
    assert a["preemption"]["resumed_at_steps"] == [2]


@pytest.mark.slow
def test_a_hung_trainer_ends_the_job_naming_it_resumably(tmp_path):
    """SIGSTOP stands in for a trainer stuck in a collective or on a dead node: rank 0 hears nothing from
    it for hang_timeout_s, commits nothing it cannot vouch for and ends the job, naming the rank, with
    the resumable exit code; the last committed checkpoint stands for --resume."""
    from dora_hpc.launch.local import RESUMABLE

    run_dir = tmp_path / "dora"
    hang = ["--set", "runtime.hang_timeout_s=10", "--set", "runtime.heartbeat_s=1"]
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", "train.max_steps=8", *BASE, *hang, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(checkpoints(run_dir)) >= 1 and len(list(run_dir.glob("train-*.h5"))) >= 3)
    trainer = int((run_dir / "pids" / "rank-1").read_text())
    os.kill(trainer, signal.SIGSTOP)
    t = time.time()
    err = finish(proc, 120)
    assert proc.returncode == RESUMABLE, err[-3000:]
    assert time.time() - t < 10 + 30
    assert "rank 1 (trainer) sent nothing for" in err and "continue with: dora-hpc run --resume" in err
    wait_for(lambda: not DeathWatch._alive(trainer), timeout=30)  # the stopped rank was ended too
    assert checkpoints(run_dir)  # what --resume continues from (resuming is tested above)


def test_a_hung_and_a_killed_rollout_rank_are_fenced_and_the_run_finishes_without_them(tmp_path):
    """Two of the three rollout ranks fail in one run. SIGSTOP on rank 3 stands in for a hung GPU or node:
    rank 0 fences it after hang_timeout_s. SIGKILL on rank 4 (a crashed process, an OOM kill): the
    launcher tells rank 0 at once, which fences it without waiting for hang_timeout_s, and the survivors
    ignore mpiexec's notice of the death (SIGUSR1). Their trajectories (and any migrating away from them)
    start again on the last instance under their own tags, and the run makes every step with every
    invariant 0; analyze shows both fences and their causes."""
    run_dir = tmp_path / "dora"
    hang = ["--set", "runtime.hang_timeout_s=8", "--set", "runtime.heartbeat_s=1"]
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", "train.max_steps=10", *BASE, *hang, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(run_dir.glob("train-*.h5"))) >= 3)
    stopped = int((run_dir / "pids" / "rank-3").read_text())
    os.kill(stopped, signal.SIGSTOP)
    os.kill(int((run_dir / "pids" / "rank-4").read_text()), signal.SIGKILL)
    err = finish(proc, 240)
    assert proc.returncode == 0, err[-3000:]
    assert "rank 3 (rollout instance 1) sent nothing for" in err and "fenced" in err, err[-3000:]
    assert "rank 4 (rollout instance 2) died: fenced" in err and "died first" not in err, err[-3000:]
    wait_for(lambda: not DeathWatch._alive(stopped), timeout=30)  # the job's end took it down too
    a = assert_whole(run_dir, steps=10, k=2)
    fences = {f["rank"]: f for f in a["fenced"]}
    assert sorted(fences) == [3, 4] and fences[3]["silent_s"] >= 8 and fences[4]["cause"] == "died"
    assert fences[3]["cause"] == "hung"


@pytest.mark.slow
def test_a_rank_killed_in_the_middle_of_a_kv_migration_loses_nothing(tmp_path):
    """A fault-injection point (DORA_HPC_FAULT=die_mid_migration) kills the first rollout rank to migrate
    a request with its KV after it announced the KV and before the KV left: the destination stops
    waiting for it once rank 0 fences the dead rank, the migrating request's group is generated again,
    whole, elsewhere, and the run finishes with nothing lost or trained on twice."""
    run_dir = tmp_path / "dora"
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", "train.max_steps=6", *BASE, "--run-dir", str(run_dir)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DORA_HPC_FAULT": "die_mid_migration"})
    assert p.returncode == 0, p.stderr[-3000:]
    dead = int(re.search(r"dora-hpc: rank (\d+): injected fault: dying mid-migration", p.stdout + p.stderr).group(1))
    assert f"rank {dead} (rollout instance {dead - 2}) died: fenced" in p.stderr, p.stderr[-3000:]
    a = assert_whole(run_dir, steps=6, k=2)
    fence, = a["fenced"]
    assert fence["rank"] == dead and fence["cause"] == "died"
    ops = read_table(run_dir, "events", "ops", ["kind", "peer"])
    assert dead in ops["peer"][ops["kind"] == "migration_lost"]  # the destination stopped waiting for the KV


@pytest.mark.slow
def test_an_elastic_run_stops_at_a_signal_and_resumes_onto_a_new_allocation_without_borrowing(tmp_path):
    """Preempted with 1 trainer (hosting a borrowed instance, cluster.elastic) + 3 rollout ranks: the SIGTERM
    commits the current step (the borrowed instance's shard is flushed with the others, its parked requests
    count as pending). Resumed with 2 trainers (data-parallel) + 2 rollout ranks, no borrowing
    (cluster.elastic may change on resume) and another engine setting: the world is renumbered, the groups
    in flight start again whole on the new instances, and the logs of both launches still add up to one
    run: nothing lost, nothing twice."""
    run_dir = tmp_path / "moved"
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", "mode=dora", "--set", "train.max_steps=60", *BASE,
                 "--set", "cluster.elastic=true", "--set", "cluster.max_num_seqs=4", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def borrowed_rows() -> bool:  # the borrowed instance runs only while the trainer waits: some steps go by first
        return any(run_dir.glob("traj-r1-*.h5")) and 1 in set(
            read_table(run_dir, "traj", "trajectories", ["traj_id"], with_rank=True)["rank"].tolist())

    wait_for(lambda: len(checkpoints(run_dir)) >= 2 and borrowed_rows())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 3, finish(proc, 10)[-3000:]
    stopped = max(checkpoints(run_dir))
    p = resume(run_dir, "--set", "cluster.elastic=false", "--set", "cluster.rollout_instances=2",
               "--set", "cluster.trainer_ranks=2", "--set", "engine.max_batched_tokens=128",
               "--set", f"train.max_steps={stopped + 6}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ranks=1+2+2" in p.stdout
    a = assert_whole(run_dir, steps=stopped + 6, k=2)
    assert a["preemption"]["attempts"] == 2 and a["preemption"]["resumed_at_steps"] == [stopped]
    c = read_table(run_dir, "train", "consumed", with_rank=True)
    late = c["consume_step"] >= stopped
    assert set(c["rank"][late].tolist()) == {1, 2}  # both replicas of the new allocation trained
    trajs = read_table(run_dir, "traj", "trajectories", ["traj_id", "attempt"], with_rank=True)
    first = trajs["attempt"] == 0
    assert 1 in set(trajs["rank"][first].tolist())  # the trainer rank's borrowed instance finished some before the stop
