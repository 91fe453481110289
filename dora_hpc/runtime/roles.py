"""Which role each world rank plays: 0 = orchestrator, 1..T = trainers, T+1.. = rollout instances.

Rollout instance i < R (the dedicated ones) is rank T+1+i. With ``cluster.elastic`` each trainer rank
also hosts a borrowed instance: instance R+j is trainer rank 1+j. With ``train.replicas`` the trainer ranks
form fault-tolerant replica groups of ``replica_size`` consecutive ranks (train/ft.py): each rank gets every
group, and a replica group may be fenced (all its ranks at once) while another lives. A source of weights is
then a replica group: its ranks each send their shard.
Pure (no MPI import), so the launcher can name a rank without initialising MPI itself.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINERS = -1  # a weight source that is every trainer rank: each sends its shard of the version


@dataclass(frozen=True)
class Roles:
    size: int
    trainers: int
    borrowed: int = 0  # trainer ranks that also host a rollout instance (cluster.elastic): all or none
    replicated: bool = False  # train.replicas: the trainer ranks are fault-tolerant replica groups
    replica_size: int = 1  # ... of this many ranks each (they shard the model: FSDP2 inside a replica)

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(1 + self.trainers, self.size))

    @property
    def dedicated(self) -> int:
        """Rollout instances on ranks of their own."""
        return self.size - 1 - self.trainers

    @property
    def instance_ranks(self) -> list[int]:
        """Every rank that hosts a rollout instance, in instance order."""
        return [self.rank_of_instance(i) for i in range(self.dedicated + self.borrowed)]

    def role(self, rank: int) -> str:
        return "orchestrator" if rank == 0 else "trainer" if rank <= self.trainers else "rollout"

    def describe(self, rank: int) -> str:
        """A trainer or rollout rank in an operator's words: "trainer replica" or "rollout instance i"."""
        return "trainer replica" if self.role(rank) == "trainer" else f"rollout instance {self.instance_of_rank(rank)}"

    def rank_of_instance(self, i: int) -> int:
        return 1 + self.trainers + i if i < self.dedicated else 1 + i - self.dedicated

    def instance_of_rank(self, rank: int) -> int:
        return rank - 1 - self.trainers if self.role(rank) == "rollout" else self.dedicated + rank - 1

    @property
    def lead_trainer(self) -> int:
        """The trainer rank that checkpoints, logs the steps and reports Published."""
        return 1

    @property
    def publish_shards(self) -> int:
        """The shards a published version is kept in: one per trainer rank, or one copy on every replica
        group, one shard per rank of it (``replicated``: it may be the only one left)."""
        return self.replica_size if self.replicated else self.trainers

    def replica_ranks(self, rank: int) -> list[int]:
        """The trainer ranks of ``rank``'s replica group (``replicated``), in shard order."""
        first = 1 + (rank - 1) // self.replica_size * self.replica_size
        return list(range(first, first + self.replica_size))

    def weight_ranks(self, source: int) -> list[int]:
        """The ranks a load from ``source`` takes shards from: every trainer rank (TRAINERS), a replica group
        (any of its ranks), or ``source`` alone (a rollout peer)."""
        if source == TRAINERS:
            return self.trainer_ranks
        if self.replicated and self.role(source) == "trainer":
            return self.replica_ranks(source)
        return [source]

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(1, 1 + self.trainers))

    def trainers_of_group(self, group_id: int) -> list[int]:
        """The trainer ranks this GRPO group's trajectories go to: its data-parallel owner (a group never
        splits), or every replica (``replicated``: a step's quorum splits the batch as it is then)."""
        return self.trainer_ranks if self.replicated else [1 + group_id % self.trainers]

    def fenceable(self, rank: int) -> bool:
        """Whether the run can go on without ``rank`` (while another of its kind lives): a rollout rank, or a
        trainer replica."""
        return self.role(rank) == "rollout" or (self.replicated and self.role(rank) == "trainer")

    def gpus_needed(self, rank: int, rollout_gpus: int) -> int:
        """GPUs a rank takes under runtime.device=cuda: none (orchestrator), one (trainer), or a rollout
        instance's engine.tensor_parallel."""
        return {"orchestrator": 0, "trainer": 1, "rollout": rollout_gpus}[self.role(rank)]


def assign_gpus(needs: list[int], count: int) -> tuple[list[list[int]], bool]:
    """The GPUs (indices 0..count-1) of each rank on one node, given each rank's need, in rank order:
    each rank takes the next ``need`` consecutive GPUs; when they run out it starts again at 0, so ranks
    share GPUs (colocated rollout and training on one GPU, say). A rank's GPUs are always distinct and
    consecutive (a tensor-parallel instance never wraps). Returns (GPUs per rank, whether any is shared)."""
    out: list[list[int]] = []
    nxt = 0
    for need in needs:
        if need > count:
            raise ValueError(f"a rank needs {need} GPUs but its node has {count} (runtime.device=cuda; "
                             "engine.tensor_parallel must fit one node)")
        if nxt + need > count:
            nxt = 0
        out.append(list(range(nxt, nxt + need)))
        nxt += need
    return out, sum(needs) > count
