"""The replacement's process (``dora-hpc join RUN_DIR``): it offers itself to the running job, is linked to
every live rank (runtime/join.py has the protocol, runtime/link.py the links) and then is the rank it
replaces, to the run's end: a rollout rank, or a trainer replica (which joins the next step's quorum and
takes a live replica's state there, train/ft.py). A replica group of G ranks is replaced by G such processes
started together in one MPI world (``mpiexec -n G dora-hpc join RUN_DIR --role trainer``): each offers itself
naming the group, takes one rank of a lost group, and their own world is the group's (its process group).

Invariant: it leaves without MPI_Finalize (the caller ends the process with ``os._exit``), as every rank of
the job does once a rank is fenced.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
from pathlib import Path

from .join import identity
from .link import Link, store


def main(run_dir: str, sets: list[str], role: str | None = None) -> int:
    """``dora-hpc join``: this process becomes a rank of the running job in a fenced one's place (``role``:
    only a lost rank of that role, "trainer" or "rollout")."""
    from ..config import ConfigError, parse_overrides, validate, with_overrides
    from .comm import Comm
    from .main import STOP, init_mpi, install_signals
    from .messages import Hello

    run = Path(run_dir)
    if not (run / "launch.json").is_file():
        raise ConfigError(f"{run}: no launch.json (not a run directory this node can see)")
    meta = json.loads((run / "launch.json").read_text())
    # an operator's settings: rank 0 refuses a replacement whose config differs from the run's
    cfg = with_overrides(validate(meta["config"], saved=True), dict(parse_overrides(sets)))
    attempts = (run / "attempts.jsonl").read_text().splitlines()
    attempt = json.loads(attempts[-1])["attempt"]
    mpi = init_mpi()  # its own world (of one, or of a replica group's G): Comm and the group stand on it
    import faulthandler

    faulthandler.enable()  # a crash in native code (MPI) prints the Python stack
    group, refused = replica_group(cfg, role, mpi.COMM_WORLD)
    if not refused:
        st, plan = offer(run, cfg, Path(meta["model_dir"]), role, group)
        refused = plan.refused
    if refused:
        print(f"dora-hpc: join refused: {refused}", file=sys.stderr, flush=True)
        return 2
    links = accept(st, plan.peers)
    comm = Comm(cfg.cluster.trainer_ranks, cfg.runtime.data_plane, cfg.runtime.weight_bucket_mb, stop=STOP,
                heartbeat_s=cfg.runtime.heartbeat_s, elastic=cfg.cluster.elastic, identity=(plan.rank, plan.size),
                replicated=cfg.train.replicas > 1, replica_size=cfg.replica_size)
    comm.fenced = tuple(r for r in range(1, plan.size) if r != plan.rank and r not in plan.peers)  # lost before
    comm.links.update(links)
    (run / "pids" / f"rank-{plan.rank}").write_text(str(os.getpid()))
    install_signals(run, plan.rank)
    rank = become(comm, cfg, run, meta, attempt, plan)
    comm.send(Hello(plan.rank), 0)
    print(f"dora-hpc: joined as rank {plan.rank} ({comm.roles.describe(plan.rank)})", file=sys.stderr, flush=True)
    try:
        rank.run()
        comm.finish_sends(timeout_s=cfg.runtime.hang_timeout_s)
    except Exception:
        if not (run / "pids" / "complete").exists():
            raise
        # rank 0 ended the step (Shutdown, then MPI_Abort: main.py) before this rank read its Shutdown, and
        # a send to it failed: the run is complete
        print("dora-hpc: the run ended while this replacement still sent to rank 0: it leaves", file=sys.stderr,
              flush=True)
        return 0
    (run / "pids" / f"rank-{plan.rank}.done").write_text("ok")
    return 0


def replica_group(cfg, role: str | None, world) -> tuple[tuple[str, int] | None, str]:
    """(the replica group this process replaces a rank of with the others of its world: an id they share and
    their count, or None; why it may not join, or "")."""
    size = cfg.replica_size
    if role == "trainer" and size > 1:
        if world.Get_size() != size:
            return None, (f"the trainer's replica groups have {size} ranks: start {size} replacements together "
                          f"(mpiexec -n {size} dora-hpc join RUN_DIR --role trainer)")
        group = world.bcast(f"{os.uname().nodename}-{os.getpid()}", root=0)
        world.Barrier()  # each has it before the root goes on outside MPI (train/dp.py's rendezvous says why)
        return (group, size), ""
    if world.Get_size() > 1:
        return None, ("several processes replace a trainer replica group (--role trainer, train.replicas with "
                      "groups of several ranks) only")
    return None, ""


def accept(st, peers: tuple[int, ...]) -> dict:
    """This replacement's links: rank 0's, then each peer's as rank 0 tells it to connect (runtime/join.py);
    raises RuntimeError when one does not come within CONNECT_TIMEOUT_S. Built before anything collective over
    its own world (Comm's split): a group's replacement waiting there for one still offering would leave rank
    0 and its peers waiting to link to it."""
    links = {0: Link.pair(st, "0", 1)}
    for p in peers:
        links[p] = Link.pair(st, str(p), 1)
    return links


def become(comm, cfg, run: Path, meta: dict, attempt: int, plan):
    """The rank this replacement is from now on, built (its model loaded): a trainer replica (its state comes
    from a live one at the quorum it asks for first) or a rollout rank."""
    from ..data.tasks import make_task
    from .rollout import RolloutRank
    from .trainer import TrainerRank

    model_dir = Path(meta["model_dir"])
    task = make_task(cfg, meta["vocab_size"], model_dir)
    if comm.roles.role(plan.rank) == "trainer":
        import torch

        torch.set_num_threads(1)
        return TrainerRank(comm, cfg, run, model_dir, meta["run_id"], meta["t0"], attempt, None, task,
                           plan.lighthouse, joining=True)
    return RolloutRank(comm, cfg, run, model_dir, task, meta["run_id"], meta["t0"], attempt)


def offer(run: Path, cfg, model_dir: Path, role: str | None = None, group: tuple[str, int] | None = None):
    """Host a store, leave its address in the offer in RUN_DIR/join, and wait for rank 0's plan: (the store,
    the JoinPlan). ``group``: (an id, G) shared by the G replacements of one replica group."""
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    st = store(host, 0, master=True)
    (run / "join").mkdir(exist_ok=True)
    tmp = run / "join" / f"{host}-{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"addr": f"{host}:{st.port}", "pid": os.getpid(), "host": host,
                               "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "role": role, "group": group,
                               **identity(cfg.model_dump_json(), model_dir)}))
    tmp.rename(tmp.with_suffix(".offer"))
    print(f"dora-hpc: offered to join {run} from {host}; waiting for rank 0", file=sys.stderr, flush=True)
    while True:  # as long as it takes rank 0 to read the offer
        try:
            st.wait(["plan"], datetime.timedelta(seconds=60))
            break
        except RuntimeError:
            continue
    return st, pickle.loads(st.get("plan"))
