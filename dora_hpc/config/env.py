"""The ``env`` section: the environment of multi-turn episodes (dora_hpc/envs/), ``none`` for single turn."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .base import Section


class EnvConfig(Section):
    name: str = Field("none", description="the environment of each episode: none (one turn: prompt -> "
                      "response), retry, python_tool, toy_turns, openai_agent (the user's agent, env.args.agent, "
                      "calls an OpenAI-compatible endpoint), skyrl:<id> (a skyrl-gym environment, "
                      "pip install skyrl-gym) or module:Class")
    max_turns: int = Field(4, ge=1, description="model turns per episode at most")
    timeout_s: float = Field(30.0, gt=0, description="an environment step slower than this ends its episode "
                             "with reward 0 and a recorded error (the worker is replaced)")
    workers: int = Field(2, ge=1, description="environment worker processes per rollout rank (steps run "
                         "there, so decoding goes on while tools run)")
    max_episode_tokens: int = Field(2048, ge=2, description="prompt + every turn's model and environment "
                                    "tokens; an episode that reaches it ends (finish_reason episode_cap)")
    network: bool = Field(False, description="environment workers (and every tool they start) may reach the "
                          "network; false: each worker runs in a network namespace of its own, with none")
    args: dict[str, Any] = Field(default_factory=dict, description="passed to the environment's constructor "
                                 "(openai_agent: ``agent`` names the agent, 'module:function'; the rest are passed "
                                 "to it)")
    listen: str = Field("127.0.0.1", description="openai_agent: the address each rollout rank's OpenAI-compatible "
                        "endpoint binds (0.0.0.0: agents on other hosts may call it; each call still needs its "
                        "episode's key)")

    @property
    def multi_turn(self) -> bool:
        return self.name != "none"

    @field_validator("listen")
    @classmethod
    def _an_address(cls, v: str) -> str:
        import ipaddress

        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address (127.0.0.1: this host only; 0.0.0.0: every "
                             "interface)") from None
        return v

    @model_validator(mode="after")
    def _env_exists(self) -> EnvConfig:
        if self.multi_turn:
            from ..envs import check_env  # an unknown name or argument names its key

            check_env(self.name, self.max_turns, self.timeout_s, self.args)
        return self
