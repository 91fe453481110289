"""Which role each world rank plays: 0 = orchestrator, 1..T = trainers, T+1.. = rollout instances.

Pure (no MPI import), so the launcher can name a rank without initialising MPI itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Roles:
    size: int
    trainers: int

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(1 + self.trainers, self.size))

    def role(self, rank: int) -> str:
        return "orchestrator" if rank == 0 else "trainer" if rank <= self.trainers else "rollout"

    def rank_of_instance(self, i: int) -> int:
        return 1 + self.trainers + i

    def instance_of_rank(self, rank: int) -> int:
        return rank - 1 - self.trainers

    @property
    def lead_trainer(self) -> int:
        """The trainer rank that checkpoints, logs the steps and reports Published."""
        return 1

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(1, 1 + self.trainers))

    def trainer_of_group(self, group_id: int) -> int:
        """The data-parallel replica that trains on this GRPO group (a group never splits)."""
        return 1 + group_id % self.trainers

    def trainer_for_instance(self, i: int) -> int:
        """The trainer rank that serves initial/new weights to rollout instance i (spreads the sends)."""
        return 1 + i % self.trainers
