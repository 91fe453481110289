"""The ``slurm:`` section of RunConfig: what ``dora-hpc submit`` asks of the cluster (launch/slurm.py)."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class SlurmComponent(Section):
    """Resources of one component of the heterogeneous job (0: orchestrator + trainers, 1: rollout)."""

    nodes: int | None = Field(None, ge=1)
    cpus_per_task: int = Field(1, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    mem_gb: float | None = Field(None, gt=0)
    partition: str | None = None   # default: slurm.partition
    constraint: str | None = None  # default: slurm.constraint


class SlurmConfig(Section):
    """``dora-hpc submit``: one heterogeneous job (or one plain job when ``heterogeneous`` is false; then
    ``trainer`` gives the resources of its single component, which runs every rank)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time_min: int = Field(60, ge=1)
    job_name: str = "dora-hpc"
    heterogeneous: bool = True
    trainer: SlurmComponent = SlurmComponent()
    rollout: SlurmComponent = SlurmComponent()
    signal_delay_s: int = Field(120, ge=1, description="SIGUSR1 this long before the time limit: checkpoint")
    extra_sbatch: list[str] = Field(default_factory=list, description="extra sbatch flags, e.g. --exclusive")
    setup: list[str] = Field(default_factory=list, description="shell lines before srun (module load ...)")
    requeue_on_failure: int = Field(3, ge=0, description="a failed step (a dead rank, a failed MPI start) "
                                    "requeues the job, at most this many times per run")
    fence_rollout: bool = Field(True, description="a rollout rank killed by a signal, hung, or on a dead node costs "
                                "that instance, not the job: rank 0 fences it and the step goes on (a dead node "
                                "only in a plain job: Slurm requeues a heterogeneous one; slurm/NOTES.md). Runs the "
                                "step with --no-kill and MPICH's OFI netmod unless MPIR_CVAR_CH4_NETMOD is set")
    replace_lost: bool = Field(False, description="with fence_rollout: when a rollout rank is fenced, rank 0 submits "
                               "a replacement (dora-hpc join --submit), which Slurm starts once a node is free (a dead "
                               "one back in service, a spare) and which joins the running job; those that have not "
                               "joined by the run's end are cancelled")
    replace_retries: int = Field(3, ge=0, description="with replace_lost: a replacement job that ends without "
                                 "joining (its MPI start failed, its node died) is submitted again, at most this "
                                 "many times per run")
    mpi_init_timeout_s: float = Field(120, gt=0, description="a rank whose MPI_Init has not completed after this "
                                      "long exits 1 (a stalled PMI exchange), so the step ends and the job "
                                      "requeues; raise it for starts of thousands of ranks")
    folder: str | None = None  # submitit's folder (logs, pickles); default RUN_DIR/slurm
