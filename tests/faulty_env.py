"""An environment that fails on purpose (tests/test_episodes.py): toy_turns, except that the second step of
every episode of group g raises when g % 8 == 1, hangs when g % 8 == 2 and kills its worker when g % 8 == 3."""

import os
import time

from dora_hpc.envs.builtin import ToyTurnsEnv


class FaultyEnv(ToyTurnsEnv):
    def step(self, action):
        if self.turn == 1:
            kind = self.score.group_id % 8
            if kind == 1:
                raise RuntimeError("the tool crashed")
            if kind == 2:
                time.sleep(3600)
            if kind == 3:
                os._exit(7)
        return super().step(action)
