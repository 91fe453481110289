"""Entry point of every MPI rank: ``python -m dora_hpc.runtime.main RUN_DIR``.

The role comes from the world rank (runtime/roles.py). Invariants:
* any exception ends the whole job at once: the rank prints a message naming itself and calls
  MPI_Abort, so no rank hangs on a dead peer;
* rank 0 alone decides where this launch starts (a fresh run, or the newest checkpoint that verifies)
  and records it as one line of ``RUN_DIR/attempts.jsonl``; every rank gets the same decision;
* SIGINT, SIGTERM and SIGUSR1 -- a Ctrl-C, a process manager, Slurm's preemption, requeue or time-limit
  warning -- reach any rank as a stop request: the rank sets a flag, rank 0 (told by the others) commits
  a checkpoint of the current step and ends the run, which exits 3; a second signal stops at once.
  Under the local launcher (DORA_HPC_HYDRA=1) SIGUSR1 is mpiexec's notice that a peer died, not a stop
  request: the launcher decides what a death means (launch/local.py);
* MPI_Init that has not completed after MPI_INIT_TIMEOUT_S (a PMI exchange that never ends) exits the
  rank with status 1, so the step ends and a Slurm job requeues and resumes instead of holding its nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from .. import quiet_hf

# seconds MPI_Init may take (DORA_HPC_MPI_INIT_TIMEOUT_S; a Slurm job's script sets it from
# slurm.mpi_init_timeout_s): a few on a healthy start of a few ranks, however loaded the node
MPI_INIT_TIMEOUT_S = float(os.environ.get("DORA_HPC_MPI_INIT_TIMEOUT_S") or 120)
STOP = threading.Event()     # a stop was requested by a signal (to this rank; rank 0: to any rank)
STOP_SIGNAL: list[int] = []


def decide_start(run: Path, meta: dict) -> dict:
    """Rank 0: which attempt this launch is and which checkpoint (if any) it continues from."""
    from ..store import checkpoint

    log = run / "attempts.jsonl"
    (run / "preempted.json").unlink(missing_ok=True)  # it describes how the previous launch ended
    attempt = len(log.read_text().splitlines()) if log.exists() else 0
    mode = meta.get("resume", "no")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restarts > 0 and mode == "no":
        mode = "if_any"  # Slurm requeued the job: continue where it was
    if mode == "no" and attempt > 0:
        raise checkpoint.CheckpointError(f"{run} already holds a run ({attempt} launches in {log.name}); "
                                         "resume it (--resume) or choose a new --run-dir")
    ckpt = None
    if mode != "no":
        try:
            ckpt = checkpoint.latest(run)
        except checkpoint.CheckpointError as e:
            if mode == "required":
                raise
            warnings.warn(str(e), stacklevel=1)
        if ckpt is None and mode == "required":
            raise checkpoint.CheckpointError(
                f"no checkpoint under {run / 'checkpoints'} to resume from; to start this run again from "
                "step 0 pass --allow-fresh (the HDF5 logs of earlier launches are kept)")
        if ckpt is None and attempt > 0:
            print(f"dora-hpc: no usable checkpoint in {run}; attempt {attempt} starts again from step 0",
                  file=sys.stderr, flush=True)
    record = {"attempt": attempt, "t": time.time(), "checkpoint": str(ckpt.path) if ckpt else None,
              "version": ckpt.step if ckpt else 0, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
              "slurm_restart_count": restarts}
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return record


SAME_REQUEST_S = 0.25  # signals this close together are one request (a launcher's forward and a direct one)


def install_signals(run: Path, rank: int) -> None:
    """SIGINT, SIGTERM and SIGUSR1 only set STOP, on every rank: rank 0 then commits a checkpoint of the
    current step and ends the run (other ranks tell it: Comm.poll). A second signal, later than
    SAME_REQUEST_S after the first, ends this rank at once (the launcher then ends the job). Under the
    local launcher SIGUSR1 is ignored: mpiexec sends it to every survivor when a rank dies."""
    first: list[float] = []

    def on_signal(signum, frame):
        now = time.monotonic()
        if not first:
            first.append(now)
            STOP_SIGNAL.append(signum)
            STOP.set()
        elif now - first[0] > SAME_REQUEST_S:
            (run / "pids" / f"rank-{rank}.cleanup").write_text(str(signum))  # stopped, not failed
            os._exit(128 + signum)

    hydra = os.environ.get("DORA_HPC_HYDRA") == "1"  # its SIGUSR1 says a peer died (-disable-auto-cleanup)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN if hydra and s == signal.SIGUSR1 else on_signal)


def bind_gpus(world, roles, rollout_gpus: int) -> str | None:
    """runtime.device=cuda: narrow this rank's CUDA_VISIBLE_DEVICES to its GPUs (roles.assign_gpus over
    the ranks of its node, in world-rank order) before anything touches CUDA; vLLM's tensor-parallel
    workers inherit the narrowed list. Where the launcher already gave ranks of one node different GPUs
    (srun --gpus-per-task), its binding stands. Returns the GPUs this rank sees, or None if unchanged."""
    import torch
    from mpi4py import MPI

    from .roles import assign_gpus

    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    count = torch.cuda.device_count()  # before CUDA initialises: NVML, honouring CUDA_VISIBLE_DEVICES
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d for d in env.split(",") if d] if env is not None else [str(i) for i in range(count)]
    rank = world.Get_rank()
    every = node.allgather((rank, roles.gpus_needed(rank, rollout_gpus), visible[:count]))
    node.Free()
    if len({tuple(v) for _, _, v in every}) > 1:
        return None
    every.sort()
    gpus, shared = assign_gpus([need for _, need, _ in every], count)
    mine = gpus[[r for r, _, _ in every].index(rank)]
    if not mine:
        return None
    if shared and rank == min(r for r, need, _ in every if need):
        print(f"dora-hpc: {sum(need for _, need, _ in every)} GPUs wanted on {os.uname().nodename}, "
              f"{count} there: ranks share them", file=sys.stderr, flush=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in mine)
    return os.environ["CUDA_VISIBLE_DEVICES"]


class RunDirUnseen(RuntimeError):
    """This rank's node does not see the run directory the launcher prepared (no shared filesystem there)."""


STALE_AFTER_S = 10.0  # a segment this old that no process maps is a dead start's, not one being created


def clear_stale_shm(shm: Path = Path("/dev/shm"), now: float | None = None) -> list[str]:
    """Remove the MPICH shared-memory segments (``mpich_shm_*``, ``mpich_vci_*``) that no process maps and
    that are older than STALE_AFTER_S; the names removed.

    A requeued Slurm job starts under the job and step ids of the start that died, and MPICH names its
    node-local segments after them (``mpich_shm_<world id>_<node>``). A start killed on a node that
    survives (a dead peer node, SIGKILL) leaves its segments there, the next start finds them and MPI_Init
    fails ("Out of memory"). Called before MPI_Init on a requeued start: no rank of this start creates a
    segment before every rank has come through here (MPICH creates them after the PMI exchange)."""
    now = time.time() if now is None else now
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.rsplit(None, 1)[-1] for line in maps.read_text().splitlines() if "/mpich_" in line)
        except (OSError, IndexError):
            continue
    removed = []
    for f in [*shm.glob("mpich_shm_*"), *shm.glob("mpich_vci_*")]:
        try:
            if str(f) not in mapped and now - f.stat().st_mtime > STALE_AFTER_S:
                f.unlink()
                removed.append(f.name)
        except OSError:
            continue  # another rank of this node removed it first, or it is not ours to remove
    return removed


def init_mpi(timeout_s: float = MPI_INIT_TIMEOUT_S):
    """MPI_Init (mpi4py's import) under a watchdog; returns mpi4py's MPI. Under Slurm's pmi2 plugin a
    start's PMI exchange can stall for good (slurm/NOTES.md): the rank would wait in MPI_Init with its
    nodes held until the time limit. Past ``timeout_s`` the rank prints "Timeout" and where it waited, and
    exits 1; srun ends the step (--kill-on-bad-exit) and the job requeues and resumes. faulthandler's
    watchdog is a C thread: MPI_Init holds the GIL, so a Python thread could not fire."""
    import faulthandler

    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        from mpi4py import MPI
    finally:
        faulthandler.cancel_dump_traceback_later()
    return MPI


def main(run_dir: str) -> int:
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0 and (gone := clear_stale_shm()):
        print(f"dora-hpc: removed {len(gone)} MPICH shared-memory segments a dead start left on "
              f"{os.uname().nodename}: {', '.join(gone)}", file=sys.stderr, flush=True)
    MPI = init_mpi()  # noqa: N806 - mpi4py's module, under its own name
    import faulthandler

    faulthandler.enable()  # a crash in native code (MPI, UCX, torch) prints every thread's Python stack
    faulthandler.register(signal.SIGQUIT, all_threads=True)  # and SIGQUIT prints them, the rank goes on

    rank = MPI.COMM_WORLD.Get_rank()
    try:
        if not (Path(run_dir) / "launch.json").is_file():  # before writing anything there
            raise RunDirUnseen(f"rank {rank} on {os.uname().nodename} cannot see the run directory {run_dir} "
                               f"({Path(run_dir) / 'launch.json'} is missing): every node of the job must see it "
                               "at the same path (a shared filesystem; docs/architecture.md)")
        quiet_hf()
        from ..config import validate
        from .comm import Comm

        run = Path(run_dir)
        (run / "pids").mkdir(exist_ok=True)
        (run / "pids" / f"rank-{rank}").write_text(str(os.getpid()))
        install_signals(run, rank)
        meta = json.loads((run / "launch.json").read_text())
        cfg = validate(meta["config"], saved=True)
        start = MPI.COMM_WORLD.bcast(decide_start(run, meta) | lighthouse(cfg) if rank == 0 else None, root=0)
        announce(MPI.COMM_WORLD, cfg, meta, start)
        comm = Comm(cfg.cluster.trainer_ranks, cfg.runtime.data_plane, cfg.runtime.weight_bucket_mb, stop=STOP,
                    heartbeat_s=cfg.runtime.heartbeat_s, elastic=cfg.cluster.elastic,
                    replicated=cfg.train.replicas > 1, replica_size=cfg.replica_size)
        outcome = play(comm, cfg, run, meta, start)
        comm.close()
        finish(MPI.COMM_WORLD, comm, run, outcome)
        return 0
    except BaseException as e:  # noqa: BLE001 - any failure must take the whole job down
        fail(Path(run_dir), rank, e)
        save_coverage()
        MPI.COMM_WORLD.Abort(1)
        return 1


LIGHTHOUSE: list = []  # rank 0's torchft lighthouse, kept for the process's life


def lighthouse(cfg) -> dict:
    """Rank 0 serves torchft's lighthouse where the trainer is fault-tolerant replicas (train.replicas):
    its address goes to every rank with the start."""
    if cfg.train.replicas < 2:
        return {"lighthouse": None}
    from ..train.ft import serve_lighthouse

    LIGHTHOUSE.append(serve_lighthouse(cfg.train.replica_timeout_s))
    return {"lighthouse": LIGHTHOUSE[-1].address()}


def announce(world, cfg, meta: dict, start: dict) -> None:
    """Bind GPUs (before the data plane or any model touches CUDA); rank 0 names every rank once."""
    from .roles import Roles

    gpus = None
    if cfg.runtime.device == "cuda":
        bind_gpus(world, Roles(world.Get_size(), cfg.cluster.trainer_ranks), cfg.engine.tensor_parallel)
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    where = world.gather({"rank": world.Get_rank(), "host": os.environ.get("SLURMD_NODENAME") or os.uname().nodename,
                          "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "gpus": gpus}, root=0)
    if world.Get_rank() == 0:  # one world across the job's components: say so, once per launch
        print(f"dora-hpc: attempt {start['attempt']}: one MPI world of {len(where)} ranks: " + ", ".join(
            f"r{w['rank']}@{w['host']}" + (f"[GPU {w['gpus']}]" if w["gpus"] is not None else "")
            + (f"(job {w['slurm_job_id']})" if w["slurm_job_id"] else "") for w in where),
            file=sys.stderr, flush=True)
        print(f"dora-hpc: model {meta['model_dir']} loads on every trainer and rollout rank", file=sys.stderr,
              flush=True)


def play(comm, cfg, run: Path, meta: dict, start: dict) -> str:
    """This rank's role, to the end of the run: "done" or (rank 0) "preempted"."""
    from ..data.tasks import make_task
    from ..store import checkpoint

    attempt, t0, model_dir = start["attempt"], meta["t0"], Path(meta["model_dir"])
    role = comm.roles.role(comm.rank)
    if role != "orchestrator":  # rank 0 never imports torch: 2 CPU-seconds less at every start
        import torch

        torch.set_num_threads(1)
    resume = None  # rank 0 verified it in decide_start; only the orchestrator and trainers read it
    if start["checkpoint"] and role in ("orchestrator", "trainer"):
        resume = checkpoint.load(Path(start["checkpoint"]), verified=True)
    if role == "orchestrator":
        from .orchestrator import Orchestrator

        task = make_task(cfg, meta["vocab_size"], model_dir)
        orch = Orchestrator(comm, cfg, run, task, meta["run_id"], t0, attempt, resume, stop=STOP,
                            lighthouse=start["lighthouse"])
        outcome = orch.run()
        if outcome == "preempted":
            (run / "preempted.json").write_text(json.dumps(
                {"attempt": attempt, "checkpoint_step": orch.checkpoints.last, "signal": STOP_SIGNAL[:1]}))
        return outcome
    if role == "trainer":
        from .trainer import TrainerRank

        task = make_task(cfg, meta["vocab_size"], model_dir) if cfg.cluster.elastic else None  # its borrowed instance
        TrainerRank(comm, cfg, run, model_dir, meta["run_id"], t0, attempt, resume, task, start["lighthouse"]).run()
    else:
        from .rollout import RolloutRank

        task = make_task(cfg, meta["vocab_size"], model_dir)
        RolloutRank(comm, cfg, run, model_dir, task, meta["run_id"], t0, attempt).run()
    return "done"


def replacements_left(run: Path, ranks: list[int], timeout_s: float) -> None:
    """Before rank 0 ends the job with MPI_Abort: wait (at most ``timeout_s``) until each live replacement
    (``dora-hpc join``, reached over links of its own, not in the barriers) has read its Shutdown, finished
    its sends and left (its ``pids/rank-N.done``, newer than its ``rank-N``): a replacement whose link to rank
    0 breaks before that fails (Comm.broke)."""
    end = time.monotonic() + timeout_s
    for r in ranks:
        started, done = run / "pids" / f"rank-{r}", run / "pids" / f"rank-{r}.done"
        while time.monotonic() < end and not (done.exists() and started.exists()
                                               and done.stat().st_mtime >= started.stat().st_mtime):
            time.sleep(0.05)
    time.sleep(0.2)  # its process exits right after writing it


def finish(world, comm, run: Path, outcome: str) -> None:
    # MPICH's process manager signals SIGUSR1 to ranks still finishing when one exits; Python's
    # finalization resets handlers it installed to the default (die), so ignore it from here on
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    (run / "pids" / f"rank-{world.Get_rank()}.done").write_text("ok")  # a clean exit: the launcher must not blame it
    if outcome == "preempted" and STOP_SIGNAL[:1] == [signal.SIGUSR1] and os.environ.get("SLURM_JOB_ID"):
        # Slurm's early warning (--signal=USR1@T): the checkpoint is in; ask Slurm to run us again
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
    if comm.left_out:  # a fenced rank never reaches MPI_Finalize: once every other rank is done, end the job
        comm.group.Barrier()
        if world.Get_rank() == 0:
            replacements_left(run, [r for r in comm.links if r not in comm.broken and r not in comm.fenced],
                              timeout_s=comm.heartbeat_s * 10)
            if outcome == "done" and os.environ.get("SLURM_JOB_ID"):  # srun fails a step ended by MPI_Abort:
                # the job script's tail reads this start's marker as a complete run (launch/slurm.py:
                # requeue_on_failure); a run stopped at a checkpoint leaves none, so the job is run again
                (run / "pids" / "complete").write_text(
                    f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT') or 0}")
            save_coverage()
            world.Abort(0)  # exit status 0: the run is complete; this also ends the fenced ranks


def fail(run: Path, rank: int, e: BaseException) -> None:
    """Say why this rank failed, once, and leave the launcher a marker (it may follow a dead peer)."""
    try:
        (run / "pids" / f"rank-{rank}.failed").write_text(f"{type(e).__name__}: {e}")
    except OSError:
        pass
    from ..store import DiskFull
    from .orchestrator import RankHung

    if isinstance(e, DiskFull | RankHung):  # not a bug: the message says all; the job is resumable
        sys.stderr.write(f"dora-hpc: rank {rank} stopped: {e.strerror if isinstance(e, DiskFull) else e}\n")
    elif isinstance(e, RunDirUnseen):  # not a bug either: the message names the node and the path
        sys.stderr.write(f"dora-hpc: {e}\n")
    else:
        sys.stderr.write(f"dora-hpc: rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    sys.stderr.flush()
    time.sleep(0.2)


def save_coverage() -> None:
    """Under the tests' coverage measurement (tools/coverage.sh), write this rank's data before MPI_Abort
    (or an MPI_Finalize that rank 0's MPI_Abort may end), which kill the process with no atexit or os._exit
    for coverage to save in. Nothing where coverage is not running (not imported, or not installed)."""
    coverage = sys.modules.get("coverage")
    if coverage is not None and (cov := coverage.Coverage.current()) is not None:
        try:
            cov.save()
        except Exception:  # noqa: BLE001 - the abort must happen whatever coverage thinks
            pass


def exit_now(code: int) -> None:
    """End this process without Python's teardown: MPI_Finalize, then _exit. Tearing down torch and the
    Hugging Face libraries module by module costs each rank about half a CPU-second and releases nothing
    the kernel does not (1.5 s of wall time for 5 ranks on 2 cores, at every launch). Everything a rank
    opens is closed by then: shards are written whole at each flush, play() closes the metric sinks, the
    engine (vLLM's worker processes) and the environment pool, and comm.close() drains the messages."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    save_coverage()  # a rank still in MPI_Finalize when rank 0 ends the job over fenced ranks dies there
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1]))
