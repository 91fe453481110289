"""Rank 0's record of weight loads: which instance loads which version from where, and what each holds.

Invariants:
* a load is one LoadVersion to the instance plus one SendWeights to each source rank (every trainer rank
  for TRAINERS, none for FOLDER); it is under way from then until the instance's Ready;
* a load from the trainers is a delta against the version the instance holds (its base), when no other
  load is under way there; a slept instance, a lost one and one mid-load hold nothing a delta could use. A
  version added beside others (an adapter, ``add``) comes whole and leaves the base a later delta uses alone;
* version 0 taken from the model folder (FOLDER) is checked against the trainer's version 0 (its Initial):
  an instance whose folder differs stops the run, naming the instance;
* fault-tolerant trainer replica groups (``Roles.replicated``) each keep a version (a shard on each rank of a
  group): a load from the trainers comes from the lowest live replica group that holds it (``holders``, from
  their Initial, Published and Holds; ``Roles.weight_ranks``: every rank of that group sends its shard), and
  from the next when that one is lost. One source, not spread over the replicas: MPICH's OFI netmod
  kills a rank that is receiving a large buffer from a process that dies (a completion-queue error is
  fatal, slurm/NOTES.md), so only the source's death, not every replica's, can take a rollout rank along.
"""

from __future__ import annotations

from ..core.events import FOLDER
from .comm import Comm
from .messages import LoadVersion, Ready, SendWeights
from .roles import TRAINERS


class WeightLoads:
    def __init__(self, comm: Comm) -> None:
        self.comm, self.roles = comm, comm.roles
        self.under_way: dict[int, tuple[int, int, bool]] = {}  # instance -> (version, source rank, keep)
        self.holds: dict[int, int] = {}  # instance -> the version it loaded and checked: a delta's base
        self.folder: dict[int, str] = {}  # instance -> the checksum of v0 as its model folder gave it
        self.trainer_v0: str | None = None
        self.holders: dict[int, set[int]] = {}  # replicated trainers: version -> the replica ranks holding it

    def held(self, rank: int, version: int) -> None:
        """Trainer replica ``rank`` holds ``version`` (it published or recovered it)."""
        self.holders.setdefault(version, set()).add(rank)

    def forget_holder(self, rank: int) -> None:
        """Trainer replica ``rank``'s process was replaced: it holds nothing until it says so again."""
        for ranks in self.holders.values():
            ranks.discard(rank)

    def trainer_source(self, v: int) -> int:
        """Where an instance loads ``v`` from the trainers: every rank's shard (TRAINERS), or the lowest live
        replica that holds it; where none has said so yet (the one that did was lost before the others'
        reports arrived), the lowest live replica holding any version, which sends it once its step has made
        it."""
        if not self.roles.replicated:
            return TRAINERS
        live = sorted(r for r in self.holders.get(v, ()) if r not in self.comm.fenced)
        if live:
            return live[0]
        holding = {r for ranks in self.holders.values() for r in ranks}  # not a replacement yet to recover
        return next((r for r in self.comm.live_trainers if r in holding), self.comm.live_trainers[0])

    def start(self, i: int, v: int, source: int, keep: bool, add: bool = False) -> None:
        """Instance ``i`` loads ``v`` from ``source``: a rollout peer's whole weights, (TRAINERS) every trainer
        rank's shard, as deltas against the version the instance holds, or (FOLDER) what its engine loaded
        at start."""
        if source == TRAINERS:
            source = self.trainer_source(v)
        trainers = source == TRAINERS or source != FOLDER and self.roles.role(source) == "trainer"
        base = -1 if add else self.holds.pop(i, -1) if i not in self.under_way else -1
        dst = self.roles.rank_of_instance(i)
        for rank in [] if source == FOLDER else self.roles.weight_ranks(source):
            self.comm.send(SendWeights(v, dst, base if trainers else -1), rank)
        self.comm.send(LoadVersion(v, source, keep, add), dst)
        if not add:
            self.under_way[i] = (v, source, keep)

    def ready(self, msg: Ready) -> None:
        if msg.instance not in self.under_way or self.under_way[msg.instance][0] != msg.version:
            return  # an added version: the instance's base for deltas is unchanged
        if self.under_way.pop(msg.instance)[1] == FOLDER:
            self.folder[msg.instance] = msg.checksum
            self.check_folder()
        self.holds[msg.instance] = msg.version

    def initial(self, version: int, checksum: str) -> None:
        """The trainer's checksum of the version it starts from (0 on a fresh start)."""
        if version == 0:
            self.trainer_v0 = checksum
            self.check_folder()

    def check_folder(self) -> None:
        for i, got in self.folder.items():
            if self.trainer_v0 is not None and got != self.trainer_v0:
                raise RuntimeError(f"orchestrator: instance {i} took version 0 from the model folder with checksum "
                                   f"{got}; the trainer's version 0 is {self.trainer_v0}")

    def forget(self, i: int) -> None:
        """Instance ``i`` is lost: no load is under way there and it holds nothing."""
        self.under_way.pop(i, None)
        self.holds.pop(i, None)

    def slept(self, i: int) -> None:
        """Instance ``i`` slept: its engine may have dropped its weights (vLLM's sleep mode), so no delta base."""
        self.holds.pop(i, None)

    def source_lost(self, rank: int) -> None:
        """Loads that waited for ``rank``'s weights (a rollout peer's, or a trainer replica's) take them from
        the trainers instead."""
        for i, (v, source, keep) in list(self.under_way.items()):
            if source == rank:
                self.start(i, v, TRAINERS, keep)
