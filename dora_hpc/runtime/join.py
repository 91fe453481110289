"""Joins: a replacement takes a fenced rollout rank's or trainer replica's place in the running job. This
module is rank 0's side (``JoinDesk``) and what both sides compare (``identity``); the replacement's process
is runtime/replacement.py (``dora-hpc join RUN_DIR``).

The replacement is a process of its own MPI world (a Slurm step or job of its own, or a plain process):
it hosts a TCPStore and leaves its address in ``RUN_DIR/join/HOST-PID.offer``. Rank 0 reads offers when it
watches (every ``runtime.tick_s``), vets each (the same config and model as the run, a fenced rank to
replace: a trainer replica first, then a rollout rank), puts a ``JoinPlan`` in its store (the rank it
replaces and, for a replica, torchft's lighthouse; or why it is refused) and builds a
*link* to it (runtime/link.py: a gloo pair, not MPI, so a replacement that dies takes no peer along).
Rank 0 then tells the live ranks one at a time (``Joined`` on TAG_FENCE) to link to it, each once the one
before has said ``Linked``, in the plan's order, which is the order the replacement builds its links in;
the replacement loads the model and says ``Hello``. Only then does rank 0 take the rank off its fenced list
and give the policy ``InstanceJoined``: the instance loads the latest version from a peer instance that
holds it (else from a trainer) and takes work like any other. A replica's replacement instead asks for a quorum
at once and gets into the others' next step's (train/ft.py): it takes the weights, optimizer state, the step
and its untrained trajectories from a live replica there, and trains its share of the step with them.

Invariants:
* a replacement runs nothing before its ``Hello`` is taken: until then it is fenced, and rank 0 sends it
  nothing but its plan;
* a join that has not said ``Hello`` within ``runtime.join_timeout_s``, or that a peer could not link to, is
  abandoned (the rank stays fenced);
  a replacement that dies or hangs after it joined is fenced again, like any rollout rank;
* a replacement leaves at the run's end without MPI_Finalize (its peers end with the job: MPI_Abort(0)
  follows any fenced rank), once its own sends are done.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .link import CONNECT_TIMEOUT_S, Link, store
from .messages import JoinPlan, Linked

ALIVE_CHECK_S = 10.0  # how often rank 0 asks Slurm whether the replacement jobs it waits for are alive


def alive_jobs(jobs: list[str]) -> set[str] | None:
    """Which of ``jobs`` Slurm still holds (pending, running, completing); None if slurmctld did not answer."""
    try:
        p = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(jobs)], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:  # every id unknown (purged) is an error too
        return set() if "Invalid job id" in p.stderr else None
    return set(p.stdout.split())


def identity(cfg_json: str, model_dir: Path) -> dict[str, str]:
    """What a replacement must share with the run: its config (every key), and its model folder's config and
    files (names and sizes: reading a large model's weights to hash them would cost minutes)."""
    files = sorted((p.name, p.stat().st_size) for p in Path(model_dir).iterdir() if p.is_file())
    model = hashlib.sha256(json.dumps(files).encode())
    cfg_file = Path(model_dir) / "config.json"
    if cfg_file.is_file():
        model.update(cfg_file.read_bytes())
    return {"config": hashlib.sha256(cfg_json.encode()).hexdigest()[:16], "model": model.hexdigest()[:16]}


@dataclass
class Join:
    """A replacement taken but not yet live: where it listens, whom rank 0 has yet to tell to link to it,
    the peer told last (linking now), and until when its ``Hello`` is awaited."""
    host: str
    addr: str  # its store: host:port
    deadline: float
    left: list[int]  # the live ranks yet to be told to connect, in order
    told: int | None = None  # the peer connecting now (its Linked awaited) ...
    told_at: float = 0.0  # ... and since when


class JoinDesk:
    """Rank 0's side of joins: offers read, vetted, linked and announced; Hellos taken; stale joins dropped."""

    def __init__(self, orch) -> None:
        """``orch``: rank 0's Orchestrator (runtime/orchestrator.py), whose fenced ranks a replacement takes."""
        self.orch = orch
        self.dir = orch.run_dir / "join"
        self.model_dir = Path(json.loads((orch.run_dir / "launch.json").read_text())["model_dir"])
        self.mine = identity(orch.cfg.model_dump_json(), self.model_dir)
        self.pending: dict[int, Join] = {}  # the rank a replacement takes -> its join, until its Hello
        self.groups: dict[str, list[int]] = {}  # a replica group's replacements (their offers' id) -> its ranks
        self.greeted: set[int] = set()  # ranks of a replica group whose replacement said Hello: live with the last
        s = orch.cfg.slurm
        self.auto = s.replace_lost and s.fence_rollout and "SLURM_JOB_ID" in os.environ  # slurm.replace_lost
        self.submitting: dict[subprocess.Popen, str] = {}  # dora-hpc join --submit under way -> its role
        self.requested: dict[str, str] = {}   # replacement jobs rank 0 submitted -> the role each replaces
        self.joined_jobs: set[str] = set()  # ... those whose replacement was taken
        self.ended_jobs: set[str] = set()   # ... and those that ended without offering (a failed start)
        self.failures = 0  # replacements that came to nothing: not submitted, ended without offering, abandoned
        self.checked_at = 0.0  # when Slurm was last asked which requested jobs are alive

    def ask(self) -> None:
        """``slurm.replace_lost``: keep one replacement job asked for per lost rank, or per lost replica group of
        several ranks (a job of one task, or of the group's, ``dora-hpc join --submit``, in the background: rank 0
        goes on); each joins once Slurm starts it. A job that ends without offering (its MPI start failed, its
        node died) is asked for again, at most ``slurm.replace_retries`` times per run."""
        self._submitted()
        waiting = self._waiting()
        if waiting and time.monotonic() - self.checked_at > ALIVE_CHECK_S:
            self.checked_at = time.monotonic()
            alive = alive_jobs(waiting)
            for job in [j for j in waiting if j not in alive] if alive is not None else []:
                self.ended_jobs.add(job)
                waiting.remove(job)
                self.orch.op("join_failed", detail=f"slurm_job={job} ended without joining")
                self._failed(f"replacement job {job} ended without joining (its log: slurm/join-{job}.out)")
        asked = [self.requested[j] for j in waiting] + list(self.submitting.values())
        lost = [self.orch.roles.role(r) for r in self.lost()] + ["trainer"] * len(self.lost_groups())
        role = next((x for x in ("trainer", "rollout") if lost.count(x) > asked.count(x)), None)
        if role is None:
            return
        if self.failures > self.orch.cfg.slurm.replace_retries:
            return  # given up (said when the last one failed)
        self.submitting[subprocess.Popen(
            [sys.executable, "-m", "dora_hpc.cli", "join", str(self.orch.run_dir), "--submit", "--role", role],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)] = role

    def _waiting(self) -> list[str]:
        """Requested replacement jobs neither taken nor seen to end: pending, starting, or loading."""
        return [j for j in self.requested if j not in self.joined_jobs and j not in self.ended_jobs]

    def _failed(self, what: str) -> None:
        self.failures += 1
        retries = self.orch.cfg.slurm.replace_retries
        print(f"dora-hpc: {what}" + (f"; no more replacements are asked for (slurm.replace_retries={retries})"
                                     if self.auto and self.failures > retries else ""), file=sys.stderr, flush=True)

    def _submitted(self) -> None:
        for proc in [p for p in self.submitting if p.poll() is not None]:
            role = self.submitting.pop(proc)
            out = proc.stdout.read()
            job = re.search(r"submitted replacement job (\d+)", out)
            if job is None:
                self._failed(f"could not submit a replacement: {out.strip()}")
                continue
            self.requested[job.group(1)] = role
            self.orch.op("join_requested", detail=f"slurm_job={job.group(1)} role={role}")
            print(f"dora-hpc: submitted replacement job {job.group(1)} ({role})", file=sys.stderr, flush=True)

    def close(self) -> None:
        """The run's end: cancel the replacement jobs that have not joined (pending, or still loading)."""
        for proc in self.submitting:
            proc.wait(timeout=120)
        self._submitted()
        if waiting := self._waiting():
            subprocess.run(["scancel", *waiting], capture_output=True, timeout=60)

    def poll(self) -> None:
        if self.auto:
            self.ask()
        for r, join in list(self.pending.items()):
            if time.monotonic() > join.deadline:
                self.abandon(r, "no Hello", "did not finish joining within runtime.join_timeout_s="
                                            f"{self.orch.cfg.runtime.join_timeout_s:g} s")
        for offer in sorted(self.dir.glob("*.offer")) if self.dir.is_dir() else ():
            taken = offer.with_suffix(".taken")
            offer.rename(taken)
            self.take(json.loads(taken.read_text()))

    def lost(self) -> list[int]:
        """The fenced ranks a replacement may take, in the order they are given: trainer replicas of one rank
        first (the last one lost ends the job), then rollout ranks. A replica group of several ranks is not
        taken by a replacement (one process cannot be a group)."""
        roles = self.orch.roles
        ranks = [*(roles.trainer_ranks if roles.replicated and roles.replica_size == 1 else ()), *roles.rollout_ranks]
        return [r for r in ranks if r in self.orch.fenced and r not in self.pending]

    def peers(self, rank: int) -> tuple[int, ...]:
        """Every live rank but rank 0 and ``rank``: each links to the replacement."""
        return tuple(r for r in range(1, self.orch.roles.size) if r != rank and r not in self.orch.fenced)

    def abandon(self, r: int, op_detail: str, why: str) -> None:
        """Give up on the join of ``r``'s replacement (with the rest of its replica group's): ``r`` stays fenced,
        and every live rank is told so."""
        host = self.pending.pop(r).host
        self.orch.op("join_failed", peer=r, detail=f"host={host} {op_detail}")
        self._failed(f"the replacement of rank {r} on {host} {why}: rank {r} stays fenced")
        self.orch.comm.links.pop(r, None)
        self.orch.comm.fence(r, self.peers(r))
        for gid, ranks in list(self.groups.items()):
            if r in ranks:  # a group joins whole or not at all: the ones that said Hello are fenced again too
                del self.groups[gid]
                for q in [q for q in ranks if q in self.greeted]:
                    self.greeted.discard(q)
                    self.orch.comm.links.pop(q, None)
                    self.orch.comm.fence(q, self.peers(q))
                for q in [q for q in ranks if q in self.pending]:
                    self.abandon(q, f"group of rank {r}", f"is of rank {r}'s group, whose join failed")

    def linked(self, msg: Linked, src: int) -> None:
        """Peer ``src`` linked to ``msg.rank``'s replacement (or could not: the join is abandoned); the next
        peer is told to connect."""
        join = self.pending.get(msg.rank)
        if join is None or join.told != src:  # given up meanwhile
            return
        join.told = None
        if not msg.ok:
            self.abandon(msg.rank, f"rank {src} could not link", f"could not be reached from rank {src}")
            return
        self.orch.op("join_linked", peer=src, detail=f"rank={msg.rank}")
        self._tell_next(msg.rank)

    def _tell_next(self, rank: int) -> None:
        join = self.pending[rank]
        while join.left and join.left[0] in self.orch.fenced:  # fenced meanwhile: the replacement waits for it
            join.left.pop(0)                                   # in vain and its join times out, as with any lost peer
        if join.left:
            join.told, join.told_at = join.left.pop(0), time.monotonic()
            self.orch.comm.announce(rank, join.addr, [join.told])

    def excused(self, peer: int, now: float) -> bool:
        """``peer`` is silent because it is linking to a replacement (building the link blocks it for up to
        CONNECT_TIMEOUT_S): not hung until that and the hang timeout have passed."""
        limit = CONNECT_TIMEOUT_S + self.orch.cfg.runtime.hang_timeout_s
        return any(j.told == peer and now - j.told_at <= limit for j in self.pending.values())

    def take(self, offer: dict) -> None:
        orch = self.orch
        rank, why = self.vet(offer)
        host, port = offer["addr"].rsplit(":", 1)
        try:
            st = store(host, int(port))
            peers = self.peers(rank) if rank is not None else ()
            st.set("plan", pickle.dumps(JoinPlan(rank if rank is not None else -1, orch.roles.size, peers, why,
                                                 orch.lighthouse)))
            link = Link.pair(st, "0", 0) if rank is not None else None
        except RuntimeError:  # the replacement is gone (an offer left by a process that died)
            orch.op("join_failed", detail=f"host={offer['host']} pid={offer['pid']} unreachable")
            print(f"dora-hpc: the replacement on {offer['host']} (pid {offer['pid']}) cannot be reached: its "
                  "offer is dropped", file=sys.stderr, flush=True)
            return
        if link is None:
            orch.op("join_refused", detail=f"host={offer['host']} {why}")
            print(f"dora-hpc: a replacement on {offer['host']} (pid {offer['pid']}) is refused: {why}",
                  file=sys.stderr, flush=True)
            return
        orch.comm.linked(rank, link, live=False)  # nothing is sent to it (no Train, no checkpoint) until its Hello
        self.joined_jobs.add(str(offer.get("slurm_job_id")))
        self.pending[rank] = Join(offer["host"], offer["addr"], time.monotonic() + orch.cfg.runtime.join_timeout_s,
                                  list(peers))
        self._tell_next(rank)
        print(f"dora-hpc: a replacement on {offer['host']} joins as rank {rank} ({orch.roles.describe(rank)}): "
              f"linking it to {len(peers)} ranks", file=sys.stderr, flush=True)

    def vet(self, offer: dict) -> tuple[int | None, str]:
        """(the rank it replaces, "") or (None, why it is refused). An offer naming a ``role`` (a job submitted
        with that component's resources) takes a lost rank of that role only."""
        orch = self.orch
        if offer["config"] != self.mine["config"]:
            return None, "its config differs from the run's (launch.json)"
        if offer["model"] != self.mine["model"]:
            return None, f"its model folder differs from the run's ({self.model_dir})"
        role = offer.get("role")
        if role == "trainer" and orch.roles.replica_size > 1:
            return self.vet_group(offer.get("group"))
        lost = [r for r in self.lost() if role is None or orch.roles.role(r) == role]
        if not lost:
            what = {"trainer": "trainer replica", "rollout": "rollout instance"}.get(role) or \
                "rollout instance" + (" or trainer replica" if orch.roles.replicated else "")
            return None, f"no {what} is lost"
        return lost[0], ""

    def lost_groups(self) -> list[int]:
        """The first ranks of the replica groups of several ranks that are lost (every rank fenced) and that no
        replacement has taken yet."""
        roles = self.orch.roles
        if not roles.replicated or roles.replica_size == 1:
            return []
        taken = {q for ranks in self.groups.values() for q in ranks}
        return [f for f in range(1, 1 + roles.trainers, roles.replica_size)
                if all(q in self.orch.fenced and q not in taken for q in roles.replica_ranks(f))]

    def vet_group(self, group: list | None) -> tuple[int | None, str]:
        """A replacement of a rank of a replica group of several ranks: the next rank of the lost group its
        offers' id was given, or the first of a lost group (every rank of it fenced, none taken)."""
        roles, size = self.orch.roles, self.orch.roles.replica_size
        if not group or group[1] != size:
            return None, (f"the trainer's replica groups have {size} ranks: {size} replacements replace one "
                          f"together (mpiexec -n {size} dora-hpc join RUN_DIR --role trainer)")
        gid = group[0]
        if gid not in self.groups:
            lost = self.lost_groups()
            if not lost:
                return None, "no trainer replica group is lost"
            self.groups[gid] = roles.replica_ranks(lost[0])
        left = [q for q in self.groups[gid] if q not in self.pending and q not in self.greeted]
        return (left[0], "") if left else (None, f"replica group {self.groups[gid]} has all its replacements")

    def hello(self, rank: int) -> bool:
        """The replacement of ``rank`` is linked to everyone and loaded: True if it was expected. A replica
        group's ranks go live together, at the last one's Hello."""
        if self.pending.pop(rank, None) is None:
            return False
        gid = next((g for g, ranks in self.groups.items() if rank in ranks), None)
        if gid is None:
            self.orch.rejoin(rank)
            return True
        self.greeted.add(rank)
        if all(q in self.greeted for q in self.groups[gid]):
            for q in self.groups.pop(gid):
                self.greeted.discard(q)
                self.orch.rejoin(q)
        return True
