"""skyrl-gym's text environments, run unchanged (``env.name: skyrl:<id>``, ``pip install skyrl-gym``).

The adapter only builds one: ``skyrl_gym.make(id, env_config=env.args, extras={"reward_spec": {"method":
"rule", "ground_truth": the task's answer to the group's question}, "max_turns": env.max_turns})``, at the
episode's ``init`` (the task is bound there), and passes ``init``/``step``/``close`` through. Its tools run in
the worker process that runs the step: with ``env.network: false`` (the default) that process has no
network (envs/worker.py), and ``env.timeout_s`` kills it with everything it started.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .base import EnvArgError, Factory, Message, StepOutput


def skyrl_factory(env_id: str) -> Factory:
    try:
        import skyrl_gym
    except ImportError:
        raise EnvArgError(f"env.name: skyrl:{env_id} needs skyrl-gym (pip install skyrl-gym)") from None
    if env_id not in skyrl_gym.envs.registration.registry:
        known = ", ".join(sorted(skyrl_gym.envs.registration.registry))
        raise EnvArgError(f"env.name: skyrl-gym has no environment {env_id!r} (it has {known})")
    return partial(SkyrlEnv, env_id)


TOOLS = ("tool_groups", "tool_to_toolgroup")  # a skyrl-gym env's tools: stateless, rebuilt, never pickled


class SkyrlEnv:
    """Pickles as its skyrl-gym environment's attributes less its tool groups (their methods are bound
    lambdas): unpickled, the environment is made again (fresh tools) and given those attributes back."""

    def __init__(self, env_id: str, score, max_turns: int, timeout_s: float, **env_config: Any) -> None:
        self.env_id, self.score, self.max_turns, self.env_config = env_id, score, max_turns, env_config
        self.extras: dict[str, Any] = {}
        self.env = None

    def _make(self):
        import skyrl_gym
        from omegaconf import OmegaConf

        return skyrl_gym.make(self.env_id, env_config=OmegaConf.create(self.env_config), extras=self.extras)

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        self.extras = {"reward_spec": {"method": "rule", "ground_truth": self.score.ground_truth()},
                       "max_turns": self.max_turns, "extra_info": {}}
        self.env = self._make()
        messages, info = self.env.init(prompt)
        return list(messages), dict(info or {})

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k != "env"}
        if self.env is not None:
            state["env_state"] = {k: v for k, v in vars(self.env).items() if k not in TOOLS}
        return state

    def __setstate__(self, state: dict) -> None:
        env_state = state.pop("env_state", None)
        self.__dict__.update(state, env=None)
        if env_state is not None:
            self.env = self._make()
            vars(self.env).update(env_state)

    def step(self, action: str) -> StepOutput:
        out = self.env.step(action)
        return {"observations": [dict(m) for m in out["observations"]], "reward": float(out["reward"] or 0.0),
                "done": bool(out["done"]), "metadata": dict(out.get("metadata") or {})}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
