"""The trajectory record: one sample of a group, end to end, in the glossary's names (docs/glossary.md).

The same record travels from the rollout rank (the engine's finished request, rewarded) to the trainer
(the message that streams it, then the objective's sample) and back from the HDF5 shards on resume.

Invariant: ``response`` and ``logprobs`` have one entry per token after the prompt; ``version`` is the version
every model token was sampled under (its group's tag), or -1 where none is (partial rollout's spans several).
A multi-turn episode's response interleaves model turns with environment tokens: ``env_spans`` are the
[start, end) ranges of the latter (context only: logprob 0, never trained on); every other token is the model's.
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
    env_spans: tuple[tuple[int, int], ...] = ()  # environment tokens in ``response``: [start, end) each

    def model_mask(self) -> list[float]:
        """1.0 for each model token of ``response``, 0.0 for each environment token."""
        mask = [1.0] * len(self.response)
        for a, b in self.env_spans:
            mask[a:b] = [0.0] * (b - a)
        return mask

    @property
    def model_tokens(self) -> int:
        """The tokens the loss covers: the response's, less the environment's."""
        return len(self.response) - sum(b - a for a, b in self.env_spans)
