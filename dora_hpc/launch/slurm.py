"""Slurm launch: ``dora-hpc submit`` as ONE heterogeneous job whose components share one MPI world.

Component 0 runs the orchestrator and the trainer ranks, component 1 the rollout ranks; the job step
is ``srun --mpi=pmi2 --het-group=0,1`` so every task is a rank of one MPI_COMM_WORLD and takes its
role from its world rank (runtime/roles.py), exactly as under mpiexec. submitit has no
heterogeneous-job support: ``HetSlurmExecutor`` appends ``#SBATCH hetjob`` and component 1's flags
after component 0's. With ``slurm.heterogeneous: false`` it is one plain job with all the ranks.

Invariants:
* ``RUN_DIR/launch.json`` is written before submission (runtime/main.py reads it on every start);
* the job is requeueable; a requeued start (SLURM_RESTART_COUNT > 0) resumes from the newest
  checkpoint that verifies (runtime/main.py); SIGUSR1 ``signal_delay_s`` before the time limit makes
  rank 0 commit a checkpoint and requeue the job;
* with ``slurm.fence_rollout`` (the default) a rollout rank killed by a signal costs that instance, not the
  job: it runs as a child of its task (``task``), which then leaves ``pids/rank-N.dead`` (the child's pid)
  for rank 0, which fences it, and exits 0, so srun keeps the step; a plain job and its step run with
  ``--no-kill``, so a dead node's rollout ranks are fenced too (Slurm requeues a heterogeneous job on any
  node's failure, so it keeps the default); MPICH runs its OFI netmod (FENCE_NETMOD);
* rank 0 ends a step with fenced ranks (hung ones too) by MPI_Abort(0) after leaving ``pids/complete``
  (this start's job id and restart count), which the script's tail reads as a complete run, not a failure;
* any other dead rank (orchestrator, trainer, a rank that raised) ends the job step at once
  (``--kill-on-bad-exit``), so no allocation is held; the job then requeues itself
  (``slurm.requeue_on_failure`` times at most) and resumes.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import submitit
from submitit.core import core
from submitit.slurm.slurm import _as_sbatch_flag

from ..config import RunConfig, SlurmComponent


def _component_flags(c: SlurmComponent, ntasks: int, cfg: RunConfig) -> dict[str, Any]:
    s = cfg.slurm
    flags: dict[str, Any] = {"ntasks": ntasks, "cpus_per_task": c.cpus_per_task,
                             "partition": c.partition or s.partition, "constraint": c.constraint or s.constraint,
                             "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                             "mem": f"{int(c.mem_gb * 1024)}MB" if c.mem_gb else None}
    return {k: v for k, v in flags.items() if v is not None}


class HetSlurmExecutor(submitit.SlurmExecutor):
    """A SlurmExecutor whose job has a second component (``#SBATCH hetjob`` + its own flags)."""

    def __init__(self, folder: Path, second: dict[str, Any] | None, need_srun: bool = True) -> None:
        if need_srun:
            super().__init__(folder, max_num_timeout=0)
        else:  # --dry-run on a machine without Slurm: render the script only
            core.PicklingExecutor.__init__(self, folder, max_num_timeout=0)
            self.python = shlex.quote(__import__("sys").executable)
        self.second = second
        self.extra: list[str] = []

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        lines = super()._make_submission_file_text(command, uid).split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        extra = [f"#SBATCH {flag}" for flag in self.extra]
        if self.second is not None:
            extra += ["#SBATCH hetjob"] + [_as_sbatch_flag(k, v) for k, v in sorted(self.second.items())]
        return "\n".join(lines[: last + 1] + extra + lines[last + 1 :])

    def _num_tasks(self) -> int:
        first = int(self.parameters.get("additional_parameters", {}).get("ntasks", 1))
        return first + (int(self.second["ntasks"]) if self.second else 0)


def make_executor(cfg: RunConfig, run_dir: Path, need_srun: bool = True) -> HetSlurmExecutor:
    s, c = cfg.slurm, cfg.cluster
    head = 1 + c.trainer_ranks
    folder = Path(s.folder) if s.folder else run_dir / "slurm"
    if "%j" in str(folder):
        raise ValueError("slurm.folder must not contain %j (it breaks srun's output redirection)")
    first = _component_flags(s.trainer, head, cfg)
    second = _component_flags(s.rollout, c.rollout_instances, cfg) if s.heterogeneous else None
    if second is None:  # one plain job: all ranks in one component
        first["ntasks"] = head + c.rollout_instances
    # a plain job survives a dead node with --no-kill (it shrinks; the node's rollout ranks are fenced). A
    # heterogeneous one cannot (Slurm requeues its leader whatever it asks), and with --no-kill its rollout
    # component ended instead of requeueing with it, leaving the job pending for good: no --no-kill there
    shrink = s.fence_rollout and second is None
    if shrink:
        first["no_kill"] = True
    ex = HetSlurmExecutor(folder, second, need_srun)
    srun_args = (["--mpi=pmi2", "--kill-on-bad-exit=1"] + (["--no-kill"] if shrink else [])
                 + (["--het-group=0,1"] if second is not None else []))
    params: dict[str, Any] = {"job_name": s.job_name, "time": s.time_min, "srun_args": srun_args,
                              "stderr_to_stdout": True,
                              "setup": [*s.setup, f"export DORA_HPC_MPI_INIT_TIMEOUT_S={s.mpi_init_timeout_s:g}",
                                        *(FENCE_NETMOD if s.fence_rollout else [])],
                              "teardown": requeue_on_failure(run_dir, s.requeue_on_failure),
                              "additional_parameters": {"requeue": True, "signal": f"USR1@{s.signal_delay_s}",
                                                        **{k: v for k, v in first.items()
                                                           if k not in ("partition", "gpus_per_node")}}}
    for key in ("partition", "gpus_per_node"):
        if key in first:
            params[key] = first[key]
    if s.account:
        params["account"] = s.account
    if s.qos:
        params["qos"] = s.qos
    ex.update_parameters(**params)
    ex.extra = list(s.extra_sbatch)
    return ex


# MPICH's UCX netmod makes its endpoints without peer error handling, so once a peer is gone any progress
# on the endpoint may crash the rank (rank 0 segfaulted in an isend, slurm/NOTES.md); the OFI netmod
# reports the failure instead. A site's own MPICH without OFI sets MPIR_CVAR_CH4_NETMOD itself.
FENCE_NETMOD = ['export MPIR_CVAR_CH4_NETMOD="${MPIR_CVAR_CH4_NETMOD:-ofi}"']


def requeue_on_failure(run_dir: Path, limit: int) -> list[str]:
    """Shell lines after srun: a step rank 0 ended over fenced ranks (MPI_Abort(0) kills every task, so
    srun fails) is a completed run when rank 0 left ``pids/complete`` for this start; any other failed
    step requeues the job (it resumes from its checkpoint), at most ``limit`` times per run (counted in
    RUN_DIR/failed_steps). When Slurm itself requeues or preempts the job it kills this script too, so
    these lines run only when the step ended on its own."""
    done = shlex.quote(str(run_dir / "pids" / "complete"))
    start = "$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"
    lines = ["rc=$?",
             f'if [ "$rc" -ne 0 ] && [ "$(cat {done} 2>/dev/null)" = "{start}" ]; then',
             '  echo "dora-hpc: the run is complete (rank 0 ended the step over its fenced ranks)"',
             "  rc=0",
             "fi"]
    if limit == 0:
        return [*lines, 'exit "$rc"']
    count = shlex.quote(str(run_dir / "failed_steps"))
    return [*lines,
            f'if [ "$rc" -ne 0 ] && [ "$(cat {count} 2>/dev/null | wc -l)" -lt {limit} ]; then',
            f'  echo "$SLURM_JOB_ID step failed (exit $rc)" >> {count}',
            '  echo "dora-hpc: the step failed (exit $rc): requeueing the job to resume from its checkpoint"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "fi"]


def submit_replacement(run_dir: Path, sets: list[str] = (), nodelist: str | None = None,
                       role: str | None = None) -> str:
    """sbatch one task that runs ``dora-hpc join RUN_DIR`` (runtime/replacement.py), with the resources of
    ``role``'s component (the trainer's for a trainer replica, else the rollout's) and a node of its own:
    Slurm starts it when a node is free (a dead node back in service, a spare), and it joins the running
    job in a fenced rank's place (of ``role`` only, where given). A trainer replica group of G ranks is replaced
    by G tasks on one node, one srun step: they join together (runtime/replacement.py). Returns the job id."""
    from ..config import validate
    from .local import LaunchError

    cfg = validate(json.loads((run_dir / "launch.json").read_text())["config"], saved=True)
    s = cfg.slurm
    c = s.trainer if role == "trainer" else s.rollout
    tasks = cfg.replica_size if role == "trainer" else 1
    flags = {"job-name": f"{s.job_name}-join", "nodes": 1, "ntasks": tasks, "cpus-per-task": c.cpus_per_task,
             "time": s.time_min, "output": run_dir / "slurm" / "join-%j.out", "partition": c.partition or s.partition,
             "constraint": c.constraint or s.constraint, "account": s.account, "qos": s.qos,
             "gpus-per-node": c.gpus_per_node, "mem": f"{int(c.mem_gb * 1024)}MB" if c.mem_gb else None,
             "nodelist": nodelist}
    (run_dir / "slurm").mkdir(exist_ok=True)
    join = shlex.join(["srun", "--mpi=pmi2", f"--ntasks={tasks}", sys.executable, "-m", "dora_hpc.cli", "join",
                       str(run_dir), *[x for kv in sets for x in ("--set", kv)], *(["--role", role] if role else [])])
    # a node of its own (--exclusive): a replaced node is a whole node
    args = [f"--{k}={v}" for k, v in flags.items() if v is not None]
    wrap = "\n".join([*s.setup, *FENCE_NETMOD, join])
    p = subprocess.run(["sbatch", "--parsable", "--exclusive", *args, "--wrap", wrap], capture_output=True, text=True)
    if p.returncode != 0:
        raise LaunchError(f"sbatch: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip().split(";")[0]


def script(cfg: RunConfig, run_dir: Path) -> str:
    """The sbatch script ``submit`` would send (for --dry-run)."""
    ex = make_executor(cfg, run_dir, need_srun=False)
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def submit(cfg: RunConfig, run_dir: Path, resume: str = "no"):
    """Prepare the run directory and submit; returns the submitit Job (job.job_id)."""
    from .local import prepare

    run_dir = run_dir.resolve()
    prepare(cfg, run_dir, resume)
    ex = make_executor(cfg, run_dir)
    return ex.submit(task if cfg.slurm.fence_rollout else rank_task, str(run_dir))


def rank_task(run_dir: str) -> None:
    """A task that is its rank (submitit runs it): it ends as every rank does, MPI_Finalize then ``os._exit``
    with the rank's status (runtime/main.py exit_now), never through submitit's interpreter teardown, which
    aborts a process whose gloo links still have a receive pending (runtime/link.py)."""
    from ..runtime.main import exit_now
    from ..runtime.main import main as rank_main

    exit_now(rank_main(run_dir))


# the rank's own to act on (SIGQUIT: print every thread's stack, runtime/main.py)
RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def task(run_dir: str) -> int:
    """One task of the job step (submitit runs it). The orchestrator and the trainers run here; a rollout
    rank (or a trainer replica, ``train.replicas``) runs as a child process (it inherits the PMI connection,
    so it is the MPI rank), and when a signal kills it (SIGKILL, the kernel's OOM killer) this task leaves
    ``pids/rank-N.dead`` for rank 0 and exits 0: srun keeps the step, rank 0 fences the rank and the run
    goes on. A rank that raised
    exits with its status, which ends the step (--kill-on-bad-exit) as before."""
    from ..runtime.roles import Roles

    rank = int(os.environ.get("PMI_RANK") or os.environ.get("SLURM_PROCID") or 0)
    cfg = json.loads((Path(run_dir) / "launch.json").read_text())["config"]
    roles = Roles(rank + 1, cfg["cluster"]["trainer_ranks"], replicated=cfg["train"].get("replicas", 1) > 1)
    if not roles.fenceable(rank):  # the orchestrator, or a trainer whose loss ends the job
        rank_task(run_dir)
    fd = os.environ.get("PMI_FD")
    for s in RANK_SIGNALS:  # Slurm signals the rank too
        signal.signal(s, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-m", "dora_hpc.runtime.main", run_dir],
                             pass_fds=(int(fd),) if fd and fd.isdigit() else (), preexec_fn=_default_signals)
    rc = child.wait()
    if rc >= 0:
        if rc:
            sys.exit(rc)
        return 0
    pids = Path(run_dir) / "pids"  # absent when the child died before its MPI_Init returned
    pids.mkdir(exist_ok=True)
    (pids / f"rank-{rank}.dead").write_text(str(child.pid))
    print(f"dora-hpc: rank {rank} (a {roles.role(rank)} rank) was killed by {signal.Signals(-rc).name} on "
          f"{os.uname().nodename}: rank 0 fences it, the run goes on", file=sys.stderr, flush=True)
    return 0


def _default_signals() -> None:
    for s in RANK_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
