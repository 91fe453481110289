"""dora-hpc submit against a real local Slurm cluster (slurm/start_local_slurm.sh: slurmctld, 4 slurmd's,
munge, accounting): one heterogeneous job, one MPI world across both components; a time-limit warning,
a requeue and a SIGKILLed rollout rank later the run completes with nothing lost, nothing twice,
staleness <= K.

The cluster is started here when it is not running and this is a root Debian machine (CI is); anywhere
else these tests are skipped, saying why. It is started with nodes of their own (NETNS=1: a network, host
name and boot id per node, slurm/NOTES.md), so every job's components talk over a (virtual) network; where
namespaces cannot be made, it falls back to the one-host cluster and the multi-node checks are skipped."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_ft import replacement_steps
from test_join import finish_soon

from dora_hpc.analysis.basic import analyze
from dora_hpc.core.events import FOLDER
from dora_hpc.launch.local import DeathWatch

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dora_hpc.cli"]
pytestmark = pytest.mark.slurm


def _netns_nodes() -> bool:
    """The running cluster's nodes are namespaces of their own (NETNS=1), each behind the bridge."""
    out = subprocess.run(["scontrol", "show", "node", "n1"], capture_output=True, text=True).stdout
    return "NodeAddr=10.77.0." in out


def _cluster_up(idle_only: bool = False) -> bool:
    """At least 3 nodes up (``idle_only``: every node idle)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-t", "idle,alloc,mix", "-o", "%D"], capture_output=True, text=True,
                             timeout=10)
        everyone = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, timeout=10)
        idle = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    count = lambda p: sum(int(x) for x in p.stdout.split() if x.isdigit())  # noqa: E731
    if idle_only:
        return idle.returncode == 0 and count(idle) == count(everyone)
    return out.returncode == 0 and count(out) >= 3


@pytest.fixture(scope="session")
def slurm_cluster():
    if _cluster_up():
        yield
        return
    if os.geteuid() != 0 or not shutil.which("apt-get") or os.environ.get("DORA_HPC_NO_SLURM"):
        pytest.skip("no Slurm cluster, and cannot start the local one here (needs root on Debian)")
    p = subprocess.run(["bash", "slurm/start_local_slurm.sh"], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "NETNS": "1", "NNODES": "5"})  # one to lose, four left
    if p.returncode != 0 or not _cluster_up():  # no namespaces here: one host, every node on 127.0.0.1
        subprocess.run(["bash", "slurm/stop_local_slurm.sh"], cwd=REPO, capture_output=True, timeout=120)
        p = subprocess.run(["bash", "slurm/start_local_slurm.sh"], cwd=REPO, capture_output=True, text=True,
                           timeout=900)
    if p.returncode != 0 or not _cluster_up():
        pytest.fail(f"slurm/start_local_slurm.sh failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    yield
    subprocess.run(["bash", "slurm/stop_local_slurm.sh"], cwd=REPO, capture_output=True, timeout=120)


def job_state(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    first = out.split("\n\n")[0]  # the het job leader (component 0)
    st = dict(re.findall(r"(\w+)=(\S*)", first))
    if not st:  # purged from slurmctld's memory (MinJobAge): ask accounting
        acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
        states = acct.stdout.split()
        st = {"JobState": states[0].split()[0]} if states else {}
    return st


ENDED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# a start can stall in MPI_Init (pmi2, slurm/NOTES.md): the rank's watchdog ends it after
# slurm.mpi_init_timeout_s and the job requeues; a whole-job wait allows one such start beside its run
JOB_S = 240 + 120 + 30


def why(job: str, run_dir: Path | None) -> str:
    """The tail of the job's log (and its replacements'), what this host's slurmd's said about its MPI start
    (pmi2), and the queue and the nodes' states."""
    out = ""
    if run_dir is not None:
        logs = [*sorted((run_dir / "slurm").glob("*_0_log.out")), *sorted((run_dir / "slurm").glob("join-*.out"))]
        out = "".join(f"--- {f.name}: its dora-hpc lines\n{said(f)}\n--- {f.name}: its end\n{f.read_text()[-3000:]}"
                      for f in logs)
    pmi = [line for f in sorted(Path("/var/log/slurm").glob("slurmd-*.log")) if os.access(f, os.R_OK)
           for line in f.read_text(errors="replace").splitlines() if "mpi/pmi2" in line]
    queue = subprocess.run(["squeue", "-o", "%i %j %T %R"], capture_output=True, text=True).stdout
    nodes = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T"], capture_output=True, text=True).stdout
    return (out + ("\nslurmd, mpi/pmi2:\n" + "\n".join(pmi[-8:]) if pmi else "")
            + f"\nsqueue:\n{queue}sinfo:\n{nodes}")


def said(log: Path) -> str:
    """The lines a log's ranks and launch script wrote as ``dora-hpc: ...`` (starts, faults, fences, joins,
    requeues), the last 60: what happened over the whole job, where the tail shows only its end."""
    return "\n".join([ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("dora-hpc:")][-60:])


def stacks(run_dir: Path) -> str:
    """Where every live rank of the run waits: each prints its threads' Python stacks to its task log on
    SIGQUIT (runtime/main.py); the tails of the other tasks' logs (task 0's is in ``why``)."""
    for f in (run_dir / "pids").glob("rank-*"):
        if f.name.removeprefix("rank-").isdigit():  # not rank-N.dead or .cleanup
            try:
                os.kill(int(f.read_text()), signal.SIGQUIT)
            except (ValueError, OSError):
                pass
    time.sleep(2)
    logs = [f for f in sorted((run_dir / "slurm").glob("*_log.out")) if not f.name.endswith("_0_log.out")]
    return "".join(f"\n--- {f.name}\n{f.read_text(errors='replace')[-2500:]}" for f in logs)


def kill_rank(run_dir: Path, rank: int) -> None:
    """SIGKILL the rank's process (its pid file, runtime/main.py) and see it gone; fail if that pid is not a
    dora_hpc process."""
    pid = int((run_dir / "pids" / f"rank-{rank}").read_text())
    cmd = Path(f"/proc/{pid}/cmdline")
    assert "dora_hpc" in cmd.read_bytes().decode(errors="replace"), f"pid {pid} (rank {rank}) is {cmd.read_bytes()!r}"
    os.kill(pid, signal.SIGKILL)
    end = time.time() + 30
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return  # dead, not yet reaped
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        assert time.time() < end, f"rank {rank} (pid {pid}) outlived SIGKILL by 30 s"
        time.sleep(0.1)


def wait_for(cond, job: str, timeout: float = 300, what: str = "", run_dir: Path | None = None) -> None:
    """Poll ``cond`` until it holds; fail at once (with the job's log) if the job ends (or completes) before
    it does."""
    end = time.time() + timeout
    while not cond():
        st = job_state(job)
        if st.get("JobState") in {*ENDED, "COMPLETED"} and not cond():
            pytest.fail(f"job {job} ended {st['JobState']} ({st.get('Reason')}) while waiting for {what}\n"
                        + why(job, run_dir))
        if time.time() > end:
            pytest.fail(f"timed out waiting for {what}: job {job} {st.get('JobState')} ({st.get('Reason')})\n"
                        + why(job, run_dir) + (stacks(run_dir) if run_dir is not None else ""))
        if st.get("JobState") == "PENDING" and st.get("Reason") == "None":
            # Slurm 22.05 leaves a requeued heterogeneous job pending with Reason=None until the job is
            # updated; any no-op update (release) makes the scheduler consider it again (slurm/NOTES.md)
            subprocess.run(["scontrol", "release", job], capture_output=True)
        time.sleep(1)


def attempts(run_dir: Path) -> int:
    f = run_dir / "attempts.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def resumed_at(run_dir: Path) -> list[int]:
    """The version each launch started from (attempts.jsonl), in order."""
    return [int(v) for v in re.findall(r'"version": (\d+)', (run_dir / "attempts.jsonl").read_text())]


def trained(run_dir: Path, attempt: int, steps: int):
    """Launch ``attempt`` is running and has trained ``steps`` steps of its own."""
    from dora_hpc.store.shards import ShardError, read_table

    def cond():
        if attempts(run_dir) != attempt + 1:
            return False
        try:
            return int((read_table(run_dir, "train", "steps", ["attempt"])["attempt"] == attempt).sum()) >= steps
        except ShardError:
            return False
    return cond


def submit(run_dir: Path, steps: int, *settings: str) -> str:
    """``dora-hpc submit`` the tiny config (tbs 4, rbs 6) with extra ``key=value`` settings; the job id."""
    sets = [x for kv in (f"train.max_steps={steps}", "batch.tbs=4", "batch.rbs=6", *settings) for x in ("--set", kv)]
    p = subprocess.run(CLI + ["submit", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir), *sets],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return re.search(r"submitted job (\d+)", p.stdout).group(1)


def test_dry_run_prints_a_heterogeneous_script_and_the_config(tmp_path):
    p = subprocess.run(CLI + ["submit", "configs/tiny-cpu.yaml", "--dry-run", "--run-dir", str(tmp_path / "x"),
                              "--set", "slurm.partition=gpu", "--set", "slurm.extra_sbatch=[--exclusive]"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "mode: dora" in out and "#SBATCH hetjob" in out and "#SBATCH --requeue" in out
    assert "--het-group=0,1" in out and "--mpi=pmi2" in out and "--kill-on-bad-exit=1" in out
    assert out.index("#SBATCH --ntasks=2") < out.index("#SBATCH hetjob") < out.index("#SBATCH --ntasks=3")
    assert "#SBATCH --partition=gpu" in out and "#SBATCH --exclusive" in out


def test_fencing_asks_no_kill_of_a_plain_job_only(tmp_path):
    """A plain job survives a dead node with --no-kill; a heterogeneous one is requeued by Slurm on any node's
    failure, and with --no-kill its rollout component would end instead of requeueing (slurm/NOTES.md)."""
    from dora_hpc.config import load_config
    from dora_hpc.launch.slurm import script

    het = script(load_config("configs/tiny-cpu.yaml"), tmp_path)
    plain = script(load_config("configs/tiny-cpu.yaml", ["slurm.heterogeneous=false"]), tmp_path)
    off = script(load_config("configs/tiny-cpu.yaml", ["slurm.heterogeneous=false", "slurm.fence_rollout=false"]),
                 tmp_path)
    assert "--no-kill" not in het and "MPIR_CVAR_CH4_NETMOD" in het
    assert "#SBATCH --no-kill" in plain and "--kill-on-bad-exit=1 --no-kill" in plain
    assert "--no-kill" not in off and "MPIR_CVAR_CH4_NETMOD" not in off


def test_a_replica_groups_replacement_job_asks_for_the_groups_tasks(tmp_path, monkeypatch):
    """``dora-hpc join --submit --role trainer`` under replica groups of two ranks asks Slurm for two tasks on one
    node and starts them as one srun step (they join together); a rollout replacement stays one task (sbatch is
    a stand-in script here that records its arguments: the job itself is the Slurm tests' above)."""
    import json

    from dora_hpc.config import load_config
    from dora_hpc.launch.slurm import submit_replacement

    cfg = load_config("configs/tiny-cpu.yaml", ["cluster.trainer_ranks=4", "train.replicas=2", "train.backend=fsdp"])
    (tmp_path / "launch.json").write_text(json.dumps({"config": json.loads(cfg.model_dump_json())}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/args\necho 123\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert submit_replacement(tmp_path, role="trainer") == "123"
    args = (tmp_path / "args").read_text()
    assert "--ntasks=2" in args and "--nodes=1" in args and "srun --mpi=pmi2 --ntasks=2" in args
    submit_replacement(tmp_path, role="rollout")
    args = (tmp_path / "args").read_text()
    assert "--ntasks=1" in args and "srun --mpi=pmi2 --ntasks=1" in args


def test_the_gpu_cluster_template_renders_gpus_for_both_components(tmp_path):
    p = subprocess.run(CLI + ["submit", "configs/cluster-gpu.yaml", "--dry-run", "--run-dir", str(tmp_path / "x")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    head, second = p.stdout.split("#SBATCH hetjob")
    assert "#SBATCH --ntasks=9" in head and "#SBATCH --ntasks=8" in second  # orchestrator + 8 trainers; 8 rollout
    assert "#SBATCH --gpus-per-node=8" in head and "#SBATCH --gpus-per-node=8" in second
    assert "device: cuda" in p.stdout and "tensor_parallel: 2" in p.stdout


@pytest.mark.slow
def test_a_time_limit_warning_a_requeue_and_a_killed_rank_then_complete(tmp_path, slurm_cluster):
    """Three interruptions of one job, with no periodic checkpoint (train.checkpoint_every=0):
    * SIGUSR1 (what --signal=USR1@T sends before the time limit): rank 0 commits a checkpoint of the
      current state, ends the step and requeues the job itself;
    * ``scontrol requeue`` (a preemption): Slurm sends SIGTERM to every task and requeues the job; rank 0
      commits within KillWait;
    * SIGKILL on a rollout rank with ``slurm.fence_rollout`` off: the step fails at once (no hang, no held
      allocation) and the job requeues itself (slurm.requeue_on_failure), resuming from the last checkpoint.
      (Rank 0 sees the rank's link break at once and, fencing being off, ends the step naming it.)
    Each signal's start resumes from the step the run was at (there is no other checkpoint), and the run
    completes with nothing lost, nothing twice."""
    run_dir = tmp_path / "run"
    steps = 16
    job = submit(run_dir, steps, "train.checkpoint_every=0", "slurm.time_min=20", "slurm.fence_rollout=false")
    try:
        wait_for(trained(run_dir, 0, 2), job, what="attempt 0 to train two steps", run_dir=run_dir)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)  # to every task of the job's steps
        wait_for(trained(run_dir, 1, 2), job, what="attempt 1 to train two steps", run_dir=run_dir)
        subprocess.run(["scontrol", "requeue", job], check=True)
        wait_for(trained(run_dir, 2, 1), job, what="attempt 2 to train a step", run_dir=run_dir)
        pids = {r: int((run_dir / "pids" / f"rank-{r}").read_text()) for r in range(5)}
        os.kill(pids[3], signal.SIGKILL)  # a rollout rank (component 1)
        t = time.time()  # the whole step ends promptly: no hang, no held allocation
        wait_for(lambda: not any(DeathWatch._alive(p) for p in pids.values()), job, timeout=60,
                 what="every rank to end", run_dir=run_dir)
        assert time.time() - t < 60
        steps = finish_soon(run_dir, after=2)  # the start after the killed one ends 2 steps on
        # the failed step requeues the job itself (slurm.requeue_on_failure) and it resumes
        wait_for(lambda: job_state(job).get("JobState") == "COMPLETED" and attempts(run_dir) == 4, job,
                 timeout=400, what="the run to complete", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    log = "".join(f.read_text() for f in (run_dir / "slurm").glob(f"{job}_0_log.out"))
    worlds = re.findall(r"one MPI world of (\d+) ranks: (.*)", log)
    assert len(worlds) >= 4 and all(n == "5" for n, _ in worlds), log[-3000:]
    assert "step failed" in log and "requeueing the job" in log
    assert len(set(rank_hosts(run_dir, job).values())) >= 2  # the world spans the job's components (their own nodes)
    a = analyze(run_dir)
    inv = a["invariants"]
    assert (inv["lost_groups"], inv["duplicate_groups"], inv["split_groups"], inv["staleness_over_k"]) == (0, 0, 0, 0)
    assert a["steps"] == steps and a["consumed"] == steps * 4 * 4  # the ledger totals of an uninterrupted run
    assert a["staleness"]["max"] <= 2 and a["weights"]["mismatched_loads"] == 0
    # a start whose MPI_Init fails (Slurm 22.05's pmi2 plugin, slurm/NOTES.md) records no attempt, so four
    # attempts are the two stops, the killed step and the completing one
    first, second, third = resumed_at(run_dir)[1:]
    assert first >= 2 and second >= first + 2  # each signal's own checkpoint: the step the run was at
    assert third == second  # the killed launch committed none: its successor starts where it did
    # the killed launch trained nothing the run kept: the chain of launches the run's steps come from skips it
    assert a["preemption"]["chain"] == [0, 1, 3] and a["preemption"]["resumed_at_steps"] == [first, second]


@pytest.mark.slow
def test_the_sbatch_template_runs_as_documented(tmp_path, slurm_cluster):
    run_dir = tmp_path / "template"
    env = {**os.environ, "RUN_DIR": str(run_dir), "PY": sys.executable,
           "DORA_HPC_SET": "--set train.max_steps=3 --set batch.tbs=4 --set batch.rbs=6"}
    p = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", "slurm/dora.sbatch"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: job_state(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), job, timeout=JOB_S,
                 what="the template's job")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert job_state(job)["JobState"] == "COMPLETED", out[-3000:]
    assert "one MPI world of 5 ranks" in out
    a = analyze(run_dir)
    assert a["steps"] == 3 and a["invariants"]["lost_groups"] == 0 and a["invariants"]["duplicate_groups"] == 0


@pytest.mark.slow
def test_a_plain_job_when_heterogeneous_is_off(tmp_path, slurm_cluster):
    run_dir = tmp_path / "plain"
    job = submit(run_dir, 3, "slurm.heterogeneous=false", "slurm.trainer.nodes=3")
    try:
        wait_for(lambda: job_state(job).get("JobState") in ("COMPLETED", "FAILED"), job, timeout=JOB_S,
                 what="the plain job", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    script = (run_dir / "slurm" / f"{job}_submission.sh").read_text()
    assert "hetjob" not in script and "--ntasks=5" in script
    assert job_state(job)["JobState"] == "COMPLETED"
    a = analyze(run_dir)
    assert a["steps"] == 3 and a["invariants"]["lost_groups"] == 0


@pytest.mark.slow
def test_data_parallel_trainers_in_a_heterogeneous_job(tmp_path, slurm_cluster):
    """Two trainer replicas in component 0 (with the orchestrator), two rollout ranks in component 1:
    the gloo group bootstraps over the job's one MPI world and each replica trains its own groups."""
    from dora_hpc.store.shards import read_table

    run_dir = tmp_path / "dp"
    sent = node_bytes()
    # the local cluster's nodes have 2 CPUs each: component 0's 3 tasks span 2 of them
    job = submit(run_dir, 3, "cluster.trainer_ranks=2", "cluster.rollout_instances=2", "slurm.trainer.nodes=2")
    try:
        wait_for(lambda: job_state(job).get("JobState") in ("COMPLETED", "FAILED"), job, timeout=JOB_S,
                 what="the data-parallel job", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    log = "".join(f.read_text() for f in (run_dir / "slurm").glob(f"{job}_0_log.*"))
    assert job_state(job)["JobState"] == "COMPLETED", log[-3000:]
    a = analyze(run_dir)
    assert a["steps"] == 3 and a["consumed"] == 3 * 4 * 4
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories"))
    c = read_table(run_dir, "train", "consumed", with_rank=True)
    assert {(int(r), int(g) % 2) for r, g in zip(c["rank"], c["group_id"], strict=True)} == {(1, 0), (2, 1)}
    if _netns_nodes():  # the replicas on two nodes: gloo's all-reduce crossed the bridge every step
        hosts = rank_hosts(run_dir, job)
        assert hosts[1] != hosts[2], hosts
        ops = read_table(run_dir, "events", "ops", ["kind", "bytes"])
        model = max(int(b) for k, b in zip(ops["kind"], ops["bytes"], strict=True) if k == "weight_load")
        from_second = node_bytes()[hosts[2]] - sent[hosts[2]]
        assert from_second >= 3 * model, (from_second, model)  # 3 steps' gradients, at least a model each


@pytest.mark.slow
def test_a_dora_run_across_four_nodes_loses_one_and_resumes_on_the_others(tmp_path, slurm_cluster):
    """Orchestrator and trainer on one node, one rollout instance on each of three others: every weight load
    comes from another node and crosses the bridge (MPI over TCP, not shared memory), KV migrates between
    nodes, and the logs name each rank's host. Then one rollout node dies (every process in it killed, its
    slurmd too) with ``slurm.fence_rollout`` off (with it on the run would fence the node's rank and finish
    before Slurm noticed; the chaos test covers that): Slurm marks the node down and requeues the job, which
    resumes from its last checkpoint on the nodes that are left, nothing lost or trained twice."""
    from dora_hpc.store.shards import read_table

    if not _netns_nodes():
        pytest.skip("the cluster's nodes share one host (start it with NETNS=1 for nodes of their own)")
    run_dir = tmp_path / "nodes"
    before = bridge_bytes()
    steps = 16
    job = submit(run_dir, steps, "slurm.rollout.nodes=3", "train.checkpoint_every=2", "slurm.time_min=20",
                 "slurm.fence_rollout=false")  # the node's death is the job's: what a requeue and resume cost
    try:
        wait_for(trained(run_dir, 0, 4), job, what="attempt 0 to train four steps", run_dir=run_dir)
        hosts = rank_hosts(run_dir, job)
        dead = hosts[4]
        killed = subprocess.run(["ip", "netns", "pids", f"dora-{dead}"], capture_output=True, text=True).stdout.split()
        for pid in killed:  # the node dies: its slurmd, its slurmstepd, its rank
            subprocess.run(["kill", "-9", pid], capture_output=True)
        steps = finish_soon(run_dir, after=3)  # the resumed start ends there
        wait_for(lambda: job_state(job).get("JobState") == "COMPLETED", job, timeout=400,
                 what="the job to resume on the nodes left and complete", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        revive(dead if "dead" in locals() else None)
    sent = bridge_bytes() - before
    assert hosts[0] == hosts[1] and len({hosts[0], hosts[2], hosts[3], hosts[4]}) == 4, hosts  # 4 nodes
    after = rank_hosts(run_dir, job, launch=-1)
    assert attempts(run_dir) == 2 and dead not in after.values(), after  # resumed without the dead node
    a = analyze(run_dir)
    assert a["steps"] == steps and a["consumed"] == steps * 4 * 4
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories"))
    assert a["preemption"]["chain"] == [0, 1] and a["preemption"]["resumed_at_steps"][0] >= 2
    assert a["migrations"] >= 1 and a["reprefill_tokens"] == 0  # instances on different nodes: KV moved
    ops = read_table(run_dir, "events", "ops", ["kind", "peer", "bytes", "attempt"], with_rank=True)
    loads = [(int(r), int(p) if p >= 0 else 1, int(b))  # peer -1: every trainer rank's shard (one here, rank 1)
             for k, p, b, r, t in zip(ops["kind"], ops["peer"], ops["bytes"], ops["rank"], ops["attempt"], strict=True)
             if k == "weight_load" and t == 0 and p != FOLDER]  # v0 from the model folder: nothing is sent
    across = [(r, p, b) for r, p, b in loads if hosts[r] != hosts[p]]
    assert across == loads and len(loads) >= 3, loads  # every load of the first launch came from another node
    assert sent >= sum(b for _, _, b in across), (sent, across)  # and its bytes went over the bridge


@pytest.mark.slow
def test_chaos_a_lost_rank_a_lost_node_and_a_hung_rank_cost_their_instances_and_a_replica_not_the_job(
        tmp_path, slurm_cluster):
    """The chaos test (issues 47 and 56): one DORA run under Slurm in a plain job over five nodes, two
    fault-tolerant trainer replicas (``train.replicas``) and four rollout instances. The second replica is
    SIGKILLed, then a rollout rank; then the node the replica was on dies (every process in its namespace,
    its slurmd too) with the rollout rank it held; then a rollout rank hangs (SIGSTOP). Each is fenced and
    the run goes on on the replica and the instance left. Then the dead node is revived and a replacement
    replica submitted there (``dora-hpc join --submit --role trainer``) joins the running job in the lost
    replica's place: it recovers the survivor's state across nodes at a step's quorum and trains beside it.
    The run finishes in its first start (no requeue), nothing lost or trained twice, staleness <= K, every
    episode on one version, the two replicas' weights bit-identical; analyze shows the instance count fall
    to 1."""
    if not _netns_nodes():
        pytest.skip("the cluster's nodes share one host (start it with NETNS=1 for nodes of their own)")
    run_dir = tmp_path / "chaos"
    steps = 80
    job = submit(run_dir, steps, "cluster.trainer_ranks=2", "train.replicas=2", "cluster.rollout_instances=4",
                 "slurm.heterogeneous=false", "slurm.trainer.nodes=5", "slurm.fence_rollout=true",
                 "runtime.hang_timeout_s=20", "train.replica_timeout_s=20", "slurm.time_min=30")
    dead = None
    try:
        wait_for(trained(run_dir, 0, 2), job, what="the run to train two steps", run_dir=run_dir)
        hosts = rank_hosts(run_dir, job)
        rollout = range(3, 7)
        dead = hosts[2]  # the second replica's node: it must hold one rollout rank, and neither rank 0 nor 1
        on_dead = [r for r in rollout if hosts[r] == dead]
        alone = [r for r in rollout if r not in on_dead and hosts[r] not in {hosts[0], dead}
                 and sum(h == hosts[r] for h in hosts.values()) == 1]
        assert len(on_dead) == 1 and dead not in {hosts[0], hosts[1]} and len(alone) >= 2, hosts
        killed, stopped = alone[0], alone[1]
        kill_rank(run_dir, 2)  # a trainer replica: its task leaves the marker, rank 0 fences it
        wait_for(trainer_fenced(run_dir, job, 2), job, timeout=60, what="rank 2 to be fenced", run_dir=run_dir)
        kill_rank(run_dir, killed)  # a rollout rank
        wait_for(fenced(run_dir, job, killed), job, timeout=60, what=f"rank {killed} to be fenced", run_dir=run_dir)
        for pid in subprocess.run(["ip", "netns", "pids", f"dora-{dead}"], capture_output=True,
                                  text=True).stdout.split():
            subprocess.run(["kill", "-9", pid], capture_output=True)  # a node: its slurmd, slurmstepd, ranks
        wait_for(fenced(run_dir, job, on_dead[0]), job, timeout=90,
                 what=f"rank {on_dead[0]} (its node dead) to be fenced", run_dir=run_dir)
        os.kill(int((run_dir / "pids" / f"rank-{stopped}").read_text()), signal.SIGSTOP)  # a hung rank
        wait_for(fenced(run_dir, job, stopped), job, timeout=90, what=f"rank {stopped} (stopped) to be fenced",
                 run_dir=run_dir)
        # a node comes back after Slurm declared it down: a slurmd that registers before that reports the
        # step missing, and srun then aborts the step on the dead I/O connection (slurm/NOTES.md)
        wait_for(lambda: node_down(dead), job, timeout=120, what=f"Slurm to declare {dead} down", run_dir=run_dir)
        subprocess.run(["bash", "slurm/start_node.sh", dead[1:]], cwd=REPO, capture_output=True, timeout=60)
        p = subprocess.run(CLI + ["join", str(run_dir), "--submit", "--nodelist", dead, "--role", "trainer"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)  # a replica on the revived node
        assert p.returncode == 0, p.stderr
        replacement = re.search(r"submitted replacement job (\d+)", p.stdout).group(1)
        wait_for(lambda: "rank 2 (trainer replica) is back" in slurm_log(run_dir, job), job, timeout=300,
                 what="the replacement replica to join", run_dir=run_dir)
        steps = finish_soon(run_dir, after=5)
        wait_for(lambda: job_state(job).get("JobState") == "COMPLETED", job, timeout=600,
                 what="the run to complete", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job, *([replacement] if "replacement" in locals() else [])], capture_output=True)
        revive(dead)
    log = slurm_log(run_dir, job)
    assert attempts(run_dir) == 1 and "requeueing" not in since_attempt_0(log), log[-3000:]
    assert "the run is complete (rank 0 ended the step over its fenced ranks)" in log
    a = analyze(run_dir)
    assert a["steps"] == steps and a["consumed"] == steps * 4 * 4
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories")), a["invariants"]
    assert a["staleness"]["max"] <= 2 and a["weights"]["mismatched_loads"] == 0
    events = [(e["event"], e["rank"], e["instances"]) for e in a["instances"]["timeline"]]
    assert events == [("start", None, 4), ("fence", killed, 3), ("fence", on_dead[0], 2), ("fence", stopped, 1)]
    out = (run_dir / "slurm" / f"join-{replacement}.out").read_text()
    assert "joined as rank 2 (trainer replica)" in out and f"from {dead}" in out and "recovered v" in out, \
        out[-2000:]
    late, survivor = replacement_steps(run_dir, 2, 1)  # the replacement replica's steps, the survivor's
    assert late and max(late) == steps - 1 and all(survivor[s] == c for s, c in late.items()), sorted(late)
    assert job_state(replacement).get("JobState") == "COMPLETED", out[-2000:]  # it left at the run's end


def trainer_fenced(run_dir: Path, job: str, rank: int):
    """Rank 0 has fenced trainer replica ``rank`` (its line in rank 0's log)."""
    return lambda: re.search(rf"rank {rank} \(trainer replica\) .*: fenced", slurm_log(run_dir, job)) is not None


@pytest.mark.slow
def test_a_lost_rollout_rank_is_replaced_automatically(tmp_path, slurm_cluster):
    """``slurm.replace_lost``: when rank 0 fences a rollout rank it submits a replacement job, which Slurm
    starts on a free node of its own and which joins the running job; the run ends with its three instances.
    The first replacement job fails before its MPI start (a setup line exits 3): rank 0 sees it end without
    joining and submits another."""
    run_dir = tmp_path / "auto"
    once = tmp_path / "first-replacement-failed"
    fail_first = f'test "$SLURM_JOB_NAME" != dora-hpc-join || test -e {once} || (touch {once}; exit 3) || exit 3'
    steps = 120
    job = submit(run_dir, steps, "slurm.heterogeneous=false", "slurm.trainer.nodes=3", "slurm.replace_lost=true",
                 "slurm.time_min=20", f"slurm.setup=[{fail_first}]")
    try:
        wait_for(trained(run_dir, 0, 2), job, what="the run to train two steps", run_dir=run_dir)
        kill_rank(run_dir, 3)
        wait_for(lambda: "rank 3 (rollout instance 1) died: fenced" in slurm_log(run_dir, job), job, timeout=120,
                 what="rank 0 to fence the killed rank", run_dir=run_dir)
        wait_for(lambda: "its replacement joined" in slurm_log(run_dir, job), job, timeout=300,
                 what="the replacement to join", run_dir=run_dir)
        steps = finish_soon(run_dir, after=4)
        wait_for(lambda: job_state(job).get("JobState") == "COMPLETED", job, timeout=400,
                 what="the run to complete", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    log = slurm_log(run_dir, job)
    failed, replacement = re.findall(r"submitted replacement job (\d+)", log)
    assert f"replacement job {failed} ended without joining" in log and once.exists(), log[-3000:]
    assert attempts(run_dir) == 1 and "requeueing" not in since_attempt_0(log), log[-3000:]
    a = analyze(run_dir)
    assert a["steps"] == steps and not any(a["invariants"][k] for k in (
        "lost_groups", "duplicate_groups", "split_groups", "staleness_over_k", "mixed_version_trajectories"))
    assert [(e["event"], e["instances"]) for e in a["instances"]["timeline"]] == [("start", 3), ("fence", 2),
                                                                                   ("join", 3)]
    wait_for(lambda: job_state(replacement).get("JobState") == "COMPLETED", replacement, timeout=60,
             what="the replacement to leave")


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig", [(4, signal.SIGKILL)], ids=["kill-rank4"])
def test_a_lost_replica_group_is_replaced_automatically(tmp_path, slurm_cluster, victim, sig):
    """Two replica groups of two FSDP2 trainer ranks (HSDP) and ``slurm.replace_lost``: rank 4 SIGKILLed fences
    its group (ranks 3 and 4; the other one leaves), rank 0 asks for one replacement job of two tasks on a node
    of its own, both join in the group's place together, recover the other group's shards and train beside it
    with the same weights. The run ends in its first start with every invariant 0. (A group's hung first rank,
    SIGSTOPped, fenced and replaced: tests/test_ft.py's FSDP2 group replacement, the same path without Slurm.)"""
    run_dir = tmp_path / "group"
    steps = 60
    job = submit(run_dir, steps, "cluster.trainer_ranks=4", "train.replicas=2", "train.backend=fsdp",
                 "cluster.rollout_instances=2", "slurm.heterogeneous=false", "slurm.trainer.nodes=4",
                 "slurm.fence_rollout=true", "slurm.replace_lost=true", "train.replica_timeout_s=20",
                 "runtime.hang_timeout_s=20", "slurm.time_min=30")
    try:
        wait_for(trained(run_dir, 0, 2), job, what="the run to train two steps", run_dir=run_dir)
        if sig == signal.SIGKILL:
            kill_rank(run_dir, victim)
        else:
            os.kill(int((run_dir / "pids" / f"rank-{victim}").read_text()), sig)
        wait_for(lambda: "fenced with its replica group (ranks 3, 4)" in slurm_log(run_dir, job), job, timeout=120,
                 what=f"rank 0 to fence rank {victim}'s group", run_dir=run_dir)
        wait_for(lambda: "rank 4 (trainer replica) is back" in slurm_log(run_dir, job)
                 and "rank 3 (trainer replica) is back" in slurm_log(run_dir, job), job, timeout=400,
                 what="the replacement group to join", run_dir=run_dir)
        steps = finish_soon(run_dir, after=5)
        wait_for(lambda: job_state(job).get("JobState") == "COMPLETED", job, timeout=600,
                 what="the run to complete", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    log = slurm_log(run_dir, job)
    (replacement,) = re.findall(r"submitted replacement job (\d+) \(trainer\)", log)
    assert attempts(run_dir) == 1 and "requeueing" not in since_attempt_0(log), log[-3000:]
    a = analyze(run_dir)
    assert a["steps"] == steps and a["consumed"] == steps * 4 * 4
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories")), a["invariants"]
    assert [e["event"] for e in a["instances"]["timeline"]] == ["start"]  # a replica is no rollout instance
    out = (run_dir / "slurm" / f"join-{replacement}.out").read_text()
    assert "joined as rank 3 (trainer replica)" in out and "joined as rank 4 (trainer replica)" in out, out[-2000:]
    assert "recovered v" in out, out[-2000:]
    late, other = replacement_steps(run_dir, 3, 1)  # the new group's first rank logs its steps
    assert late and max(late) == steps - 1 and all(other[s] == c for s, c in late.items()), sorted(late)
    wait_for(lambda: job_state(replacement).get("JobState") == "COMPLETED", replacement, timeout=60,
             what="the replacement to leave")


@pytest.mark.slow
def test_the_last_rollout_instance_lost_ends_the_start_and_the_job_resumes(tmp_path, slurm_cluster):
    """With one rollout instance there is nothing to fence onto: its death ends the start at once (exit 75,
    resumable), and the job requeues itself and resumes from its last checkpoint."""
    run_dir = tmp_path / "last"
    job = submit(run_dir, 8, "cluster.rollout_instances=1", "train.checkpoint_every=2", "slurm.time_min=20")
    try:
        wait_for(trained(run_dir, 0, 3), job, what="the run to train three steps", run_dir=run_dir)
        kill_rank(run_dir, 2)
        wait_for(lambda: job_state(job).get("JobState") == "COMPLETED" and attempts(run_dir) == 2, job, timeout=400,
                 what="the job to resume and complete", run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    log = slurm_log(run_dir, job)
    assert "rank 2, the last rollout instance, died" in log and "requeueing the job" in log, log[-3000:]
    a = analyze(run_dir)
    assert a["steps"] == 8 and a["consumed"] == 8 * 4 * 4
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories")), a["invariants"]


def fenced(run_dir: Path, job: str, rank: int):
    """Rank 0 has fenced ``rank`` (its line in rank 0's log)."""
    return lambda: re.search(rf"rank {rank} \(rollout instance \d+\) .*: fenced", slurm_log(run_dir, job)) is not None


def slurm_log(run_dir: Path, job: str) -> str:
    """Task 0's log (rank 0's output and the script's own lines) of every start of the job."""
    return "".join(f.read_text(errors="replace") for f in (run_dir / "slurm").glob(f"{job}_0_log.out"))


def since_attempt_0(log: str) -> str:
    """The job's log from its first attempt on: a start that never got through MPI_Init (Slurm's pmi2 stall,
    slurm/NOTES.md) records no attempt and is requeued before it; the faults a test injects come after."""
    return log[max(0, log.find("attempt 0: one MPI world")):]


def node_down(node: str) -> bool:
    """slurmctld has declared ``node`` down (its State has DOWN, e.g. ``DOWN+NOT_RESPONDING``)."""
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True).stdout
    return "DOWN" in (re.search(r"State=(\S+)", out) or [None, ""])[1]


def revive(node: str | None) -> None:
    """Start a dead namespaced node's slurmd again and wait until every node is idle (for the next test)."""
    if node is not None:
        subprocess.run(["bash", "slurm/start_node.sh", node[1:]], cwd=REPO, capture_output=True, timeout=60)
    end = time.time() + 120
    while time.time() < end and not _cluster_up(idle_only=True):
        time.sleep(1)


def rank_hosts(run_dir: Path, job: str, launch: int = 0) -> dict[int, str]:
    """Each rank's host in a launch of the job (0: its first, -1: its last), from its "one MPI world" line."""
    log = "".join(f.read_text() for f in (run_dir / "slurm").glob(f"{job}_0_log.out"))
    world = re.findall(r"one MPI world of \d+ ranks: (.*)", log)[launch]
    return {int(r): h for r, h in re.findall(r"r(\d+)@(\w+)", world)}


def node_bytes() -> dict[str, int]:
    """Bytes each namespaced node has sent into the bridge (its veth's host side counts what the node sent)."""
    return {f"n{p.parent.parent.name[3:]}": int(p.read_text())
            for p in Path("/sys/class/net").glob("dvh*/statistics/rx_bytes")}


def bridge_bytes() -> int:
    return sum(node_bytes().values())


@pytest.mark.parametrize("limit", [0, 3])
def test_a_step_rank_0_ended_over_fenced_ranks_is_a_complete_run_not_a_failure(tmp_path, limit):
    """MPI_Abort(0) (rank 0 ending a step with fenced ranks) kills every task, so srun fails; the script's
    tail reads rank 0's marker for this start as a complete run and neither requeues nor fails the job. A
    marker of another start (an earlier restart) does not count."""
    from dora_hpc.launch.slurm import requeue_on_failure

    (tmp_path / "pids").mkdir()
    tail = "\n".join(requeue_on_failure(tmp_path, limit))
    env = {**os.environ, "SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2", "PATH": os.environ["PATH"]}
    (tmp_path / "pids" / "complete").write_text("41.2")
    p = subprocess.run(["bash", "-c", f"(exit 137)\n{tail}"], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "the run is complete" in p.stdout and not (tmp_path / "failed_steps").exists()
    if limit == 0:  # (with a limit the tail would requeue through scontrol: not run here)
        (tmp_path / "pids" / "complete").write_text("41.1")
        p = subprocess.run(["bash", "-c", f"(exit 137)\n{tail}"], env=env, capture_output=True, text=True)
        assert p.returncode == 137 and "complete" not in p.stdout


def test_rank_0_fences_a_rank_whose_dead_marker_names_this_starts_process(tmp_path):
    from types import SimpleNamespace

    from dora_hpc.runtime.orchestrator import Orchestrator

    pids = tmp_path / "pids"
    pids.mkdir()
    orch = SimpleNamespace(run_dir=tmp_path, comm=SimpleNamespace(broken=set()))
    (pids / "rank-3").write_text("4125")
    assert not Orchestrator.died(orch, 3)
    (pids / "rank-3.dead").write_text("3001")  # an earlier start's process (the directory outlives requeues)
    assert not Orchestrator.died(orch, 3)
    (pids / "rank-3.dead").write_text("4125")
    assert Orchestrator.died(orch, 3)
    orch.comm.broken.add(4)  # a send to rank 4 failed (MPICH's OFI netmod): its process is gone
    assert Orchestrator.died(orch, 4) and not Orchestrator.died(orch, 5)
