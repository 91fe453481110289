"""A replacement joins the running job in a fenced rollout rank's place (``dora-hpc join RUN_DIR``).

The mechanism is MPI's dynamic processes (slurm/NOTES.md has the evidence): the replacement is a process
of its own MPI world (a Slurm step or job of its own, or a plain process), which opens a port
(MPI_Open_port) and leaves it in ``RUN_DIR/join/HOST-PID.offer``. Rank 0 reads offers when it watches
(every ``runtime.tick_s``), vets each (the same config and model as the run, a fenced rollout rank to
replace, the MPI data plane), connects (MPI_Comm_connect: a *link*) and sends a ``JoinPlan``: the rank it
replaces, or why it is refused. Rank 0 then tells every live rank (``Joined`` on TAG_FENCE), and each
connects in turn; the replacement accepts them all, loads the model, and says ``Hello``. Only then does
rank 0 take the rank off its fenced list and give the policy ``InstanceJoined``: the instance loads the
latest version from a trainer and takes work like any other.

Invariants:
* a replacement runs nothing before its ``Hello`` is taken: until then it is fenced, and rank 0 sends it
  nothing but its plan;
* a join that has not said ``Hello`` within ``runtime.join_timeout_s`` is abandoned (the rank stays fenced);
  a replacement that dies or hangs after it joined is fenced again, like any rollout rank;
* a replacement leaves at the run's end without MPI_Finalize (its peers end with the job: MPI_Abort(0)
  follows any fenced rank), once its own sends are done.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .messages import JoinPlan

if TYPE_CHECKING:
    from .orchestrator import Orchestrator


def identity(cfg_json: str, model_dir: Path) -> dict[str, str]:
    """What a replacement must share with the run: its config (every key), and its model folder's config and
    files (names and sizes: reading a large model's weights to hash them would cost minutes)."""
    files = sorted((p.name, p.stat().st_size) for p in Path(model_dir).iterdir() if p.is_file())
    model = hashlib.sha256(json.dumps(files).encode())
    cfg_file = Path(model_dir) / "config.json"
    if cfg_file.is_file():
        model.update(cfg_file.read_bytes())
    return {"config": hashlib.sha256(cfg_json.encode()).hexdigest()[:16], "model": model.hexdigest()[:16]}


class JoinDesk:
    """Rank 0's side of joins: offers read, vetted, linked and announced; Hellos taken; stale joins dropped."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.dir = orch.run_dir / "join"
        self.model_dir = Path(json.loads((orch.run_dir / "launch.json").read_text())["model_dir"])
        self.mine = identity(orch.cfg.model_dump_json(), self.model_dir)
        self.pending: dict[int, tuple[float, str]] = {}  # rank -> (deadline for its Hello, its host)

    def poll(self) -> None:
        for r, (deadline, host) in list(self.pending.items()):
            if time.monotonic() > deadline:
                self.pending.pop(r)
                self.orch.op("join_failed", peer=r, detail=f"host={host} no Hello")
                print(f"dora-hpc: the replacement of rank {r} on {host} did not finish joining within "
                      f"runtime.join_timeout_s={self.orch.cfg.runtime.join_timeout_s:g} s: rank {r} stays fenced",
                      file=sys.stderr, flush=True)
                self.orch.comm.links.pop(r, None)
                self.orch.comm.fence(r, self.peers(r))
        for offer in sorted(self.dir.glob("*.offer")) if self.dir.is_dir() else ():
            taken = offer.with_suffix(".taken")
            offer.rename(taken)
            self.take(json.loads(taken.read_text()))

    def peers(self, rank: int) -> tuple[int, ...]:
        """Every live rank but rank 0 and ``rank``: each links to the replacement."""
        return tuple(r for r in range(1, self.orch.roles.size) if r != rank and r not in self.orch.fenced)

    def take(self, offer: dict) -> None:
        from mpi4py import MPI

        orch = self.orch
        rank, why = self.vet(offer)
        link = MPI.COMM_SELF.Connect(offer["port"])
        peers = self.peers(rank) if rank is not None else ()
        link.send(JoinPlan(rank if rank is not None else -1, orch.roles.size, peers, why), dest=0, tag=1)
        if rank is None:
            link.Disconnect()  # both sides: MPICH forgets the process (a later one may reuse its name)
            orch.op("join_refused", detail=f"host={offer['host']} {why}")
            print(f"dora-hpc: a replacement on {offer['host']} (pid {offer['pid']}) is refused: {why}",
                  file=sys.stderr, flush=True)
            return
        orch.comm.linked(rank, link)
        orch.comm.announce(rank, offer["port"], list(peers))
        self.pending[rank] = (time.monotonic() + orch.cfg.runtime.join_timeout_s, offer["host"])
        print(f"dora-hpc: a replacement on {offer['host']} joins as rank {rank} (rollout instance "
              f"{orch.roles.instance_of_rank(rank)}): linking it to {len(peers)} ranks", file=sys.stderr, flush=True)

    def vet(self, offer: dict) -> tuple[int | None, str]:
        """(the rank it replaces, "") or (None, why it is refused)."""
        orch = self.orch
        if offer["config"] != self.mine["config"]:
            return None, "its config differs from the run's (launch.json)"
        if offer["model"] != self.mine["model"]:
            return None, f"its model folder differs from the run's ({self.model_dir})"
        if orch.cfg.runtime.data_plane != "mpi":
            return None, "runtime.data_plane is torch: its process group cannot take a new rank"
        lost = [r for r in orch.roles.rollout_ranks if r in orch.fenced and r not in self.pending]
        if not lost:
            return None, "no rollout instance is lost"
        return lost[0], ""

    def hello(self, rank: int) -> bool:
        """The replacement of ``rank`` is linked to everyone and loaded: True if it was expected."""
        if self.pending.pop(rank, None) is None:
            return False
        self.orch.rejoin(rank)
        return True


def main(run_dir: str, sets: list[str]) -> int:
    """``dora-hpc join``: this process becomes a rollout rank of the running job in a fenced one's place."""
    from ..config import ConfigError, parse_overrides, validate, with_overrides
    from ..data.tasks import make_task
    from .comm import Comm
    from .main import STOP, init_mpi, install_signals
    from .messages import Hello
    from .rollout import RolloutRank

    run = Path(run_dir)
    if not (run / "launch.json").is_file():
        raise ConfigError(f"{run}: no launch.json (not a run directory this node can see)")
    meta = json.loads((run / "launch.json").read_text())
    # an operator's settings: rank 0 refuses a replacement whose config differs from the run's
    cfg = with_overrides(validate(meta["config"], saved=True), dict(parse_overrides(sets)))
    attempts = (run / "attempts.jsonl").read_text().splitlines()
    attempt = json.loads(attempts[-1])["attempt"]
    mpi = init_mpi()
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    port = mpi.Open_port()
    offer = {"port": port, "pid": os.getpid(), "host": host, **identity(cfg.model_dump_json(), Path(meta["model_dir"]))}
    (run / "join").mkdir(exist_ok=True)
    tmp = run / "join" / f"{host}-{os.getpid()}.tmp"
    tmp.write_text(json.dumps(offer))
    tmp.rename(tmp.with_suffix(".offer"))
    print(f"dora-hpc: offered to join {run} from {host}; waiting for rank 0", file=sys.stderr, flush=True)
    link = mpi.COMM_SELF.Accept(port)
    plan: JoinPlan = link.recv(source=0, tag=1)
    if plan.refused:
        link.Disconnect()
        print(f"dora-hpc: join refused: {plan.refused}", file=sys.stderr, flush=True)
        return 2
    comm = Comm(cfg.cluster.trainer_ranks, cfg.runtime.data_plane, cfg.runtime.weight_bucket_mb, stop=STOP,
                heartbeat_s=cfg.runtime.heartbeat_s, elastic=cfg.cluster.elastic, identity=(plan.rank, plan.size))
    comm.links[0] = link
    comm.accept(port, plan.peers)
    (run / "pids" / f"rank-{plan.rank}").write_text(str(os.getpid()))
    install_signals(run, plan.rank)
    model_dir = Path(meta["model_dir"])
    rollout = RolloutRank(comm, cfg, run, model_dir, make_task(cfg, meta["vocab_size"], model_dir), meta["run_id"],
                          meta["t0"], attempt)
    comm.send(Hello(plan.rank), 0)
    print(f"dora-hpc: joined as rank {plan.rank} (rollout instance {comm.roles.instance_of_rank(plan.rank)})",
          file=sys.stderr, flush=True)
    rollout.run()
    comm.finish_sends(timeout_s=cfg.runtime.hang_timeout_s)
    (run / "pids" / f"rank-{plan.rank}.done").write_text("ok")
    return 0
