"""The trajectory record: one sample of a group, end to end, in the glossary's names (docs/glossary.md).

The same record travels from the rollout rank (the engine's finished request, rewarded) to the trainer
(the message that streams it, then the objective's sample) and back from the HDF5 shards on resume.

Invariant: ``response`` and ``logprobs`` have one entry per generated token; ``version`` is the version
every token was sampled under (its group's tag), or -1 where none is (partial rollout's spans several).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Trajectory:
    traj_id: int                 # group_id * G + sample index (the engines' request id)
    group_id: int
    version: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]        # the behaviour policy's logprob of each response token
    reward: float
    attempt: int = 0             # the launch that generated it (a re-queued one may predate a resume)
