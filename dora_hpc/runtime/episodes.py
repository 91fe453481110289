"""Multi-turn episodes on one rollout rank (``env.name`` other than none): the model's turns on the engine,
the environment's steps in the rank's worker pool (envs/pool.py), so decoding goes on while tools run.

Invariants:
* an episode is one engine request from its first turn to its last (added with ``hold``): between turns it
  is held with its KV, so every model turn is sampled under the version its group was tagged with, and only
  the environment's new tokens are prefilled (``env_prefill_tokens``, apart from re-prefill);
* the episode's ``env`` in its info is the environment's state before the step in flight, if any, and
  ``pending`` that step's action: a migration (or a park) carries both with the KV, and the destination runs
  the step again (``env_reruns``; the source's result is dropped). Environments are therefore re-runnable
  from their state (docs/architecture.md, "Episodes");
* an episode ends exactly once, through ``RolloutRank.finish``: its environment says done, it used
  ``env.max_turns`` turns, the next turn would pass ``env.max_episode_tokens`` (``episode_cap``), or its
  environment failed (raised, timed out, killed its worker: reward 0, the error recorded);
* the reward of an episode is the sum of its environment's step rewards (one final reward is its own sum).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Protocol

from ..envs import Scorer, make_env
from .env_workers import tell_waiting, worker_pool


class Host(Protocol):
    """What drives the episodes: a rollout rank (runtime/rollout.py) or ``dora-hpc eval``."""

    cfg: Any
    task: Any
    engine: Any
    info: dict[int, dict]

    def finish(self, f, kv_frac: float) -> None: ...


class Episodes:
    """Driven by a rollout rank (or by ``dora-hpc eval``): ``rank`` has ``cfg``, ``task``, ``engine``, the
    requests' ``info`` and ``finish(finished, kv_frac)``."""

    def __init__(self, rank: Host, model_dir) -> None:
        self.rank, self.env_cfg = rank, rank.cfg.env
        self.pool = worker_pool(rank, model_dir, self.env_cfg.network)
        self.jobs: dict[int, int] = {}  # pool job -> traj id
        self.told = (0, 0.0)  # episodes waiting on their environment last told rank 0, and when

    def begin(self, traj_id: int, prompt: list[int], params, version: int, info: dict, group_id: int) -> None:
        """A dispatched episode: its first turn goes on the engine (held: its KV stays between turns), its
        environment starts."""
        self.rank.engine.add(traj_id, prompt, params, version, hold=True)
        self.start(traj_id, info, group_id)

    def start(self, traj_id: int, info: dict, group_id: int) -> None:
        """A new episode's bookkeeping and environment (its first turn is already on the engine)."""
        c = self.env_cfg
        info.update(episode=True, env=None, env_error="", turns=0, turn_start=0, env_spans=[], env_rewards=[],
                    env_s=0.0, env_prefill=0, env_reruns=0, pending=None, job=None, last=None)
        try:
            info["env"] = make_env(c.name, Scorer(group_id), c.max_turns, c.timeout_s, c.args)
            info["env"].init(self.rank.task.messages(group_id))  # the first turn continues the task's prompt
        except Exception as e:  # noqa: BLE001 - a user's environment may raise anything: the episode records it
            info["env"], info["env_error"] = None, f"init: {type(e).__name__}: {e}"

    def turn_ended(self, f, info: dict) -> None:
        """The engine finished a model turn: its text goes to the environment (or the episode ends)."""
        info["last"], info["turns"] = f, info["turns"] + 1
        if info["env"] is None:  # its environment failed to start
            self.end(f.req_id, info)
            return
        self.submit(f.req_id, info, self.rank.task.decode_turn(f.response[info["turn_start"]:]))

    def submit(self, traj_id: int, info: dict, action: str) -> None:
        info["pending"], info["job"] = action, self.pool.submit(info["env"], action)
        self.jobs[info["job"]] = traj_id

    def left(self, info: dict) -> None:
        """The episode left this rank (migrated, parked or aborted): a step in flight here is dropped."""
        if info.get("job") is not None:
            self.pool.cancel(info["job"])
            self.jobs.pop(info["job"], None)
            info["job"] = None

    def arrived(self, traj_id: int, info: dict) -> None:
        """A migrated episode landed here: the step it was waiting on runs again, from the state before it."""
        if info.get("pending") is not None:
            info["env_reruns"] += 1
            self.submit(traj_id, info, info["pending"])

    def tell(self) -> None:
        """Rank 0's dashboard: how many episodes wait on their environment here."""
        self.told = tell_waiting(self.rank, self.told, lambda: len(self.jobs))

    def poll(self) -> None:
        """Apply the environment steps that finished: the next turn goes on the engine, or the episode ends."""
        self.tell()
        for r in self.pool.poll():
            tid = self.jobs.pop(r.job, None)
            info = self.rank.info.get(tid) if tid is not None else None
            if info is None or info["job"] != r.job:
                continue
            info["pending"] = info["job"] = None
            info["env_s"] += r.seconds
            if r.error:
                info["env_error"] = r.error
                self.end(tid, info)
                continue
            info["env"], out = r.env, r.output
            info["env_rewards"].append(float(out["reward"]))
            if out["done"] or info["turns"] >= self.env_cfg.max_turns:
                self.end(tid, info)
                continue
            self.next_turn(tid, info, out["observations"])

    def next_turn(self, tid: int, info: dict, observations: list) -> None:
        last, task = info["last"], self.rank.task
        tokens = task.render_env(observations, last.response[-1])
        room = self.env_cfg.max_episode_tokens - (len(last.prompt) + len(last.response) + len(tokens))
        budget = min(task.max_tokens(tid, info["turns"]), room)
        if budget < 1:
            self.end(tid, info, "episode_cap")
            return
        start = len(last.response)
        self.rank.engine.extend(tid, tokens, budget)
        if tokens:
            info["env_spans"].append((start, start + len(tokens)))
            info["env_prefill"] += len(tokens)
        info["turn_start"] = start + len(tokens)

    def end(self, tid: int, info: dict, reason: str | None = None) -> None:
        if self.rank.engine.has_request(tid):
            self.rank.engine.abort(tid)  # frees the KV it kept between turns
        if info["env"] is not None:
            with contextlib.suppress(Exception):
                info["env"].close()
        f, kv_frac = info["last"], self.rank.engine.stats()["kv_used_fraction"]  # read once, as it ends
        self.rank.finish(replace(f, finish_reason=reason or ("env_error" if info["env_error"] else f.finish_reason)),
                         kv_frac)

    def close(self) -> None:
        self.pool.close()


def make_episodes(rank: Host, model_dir) -> Episodes:
    """The episodes of ``rank``'s ``env.name``: an agent's (agent_episodes.py) or an environment's (above)."""
    if rank.cfg.env.name == "openai_agent":
        from .agent_episodes import AgentEpisodes

        return AgentEpisodes(rank, model_dir)  # type: ignore[return-value] - the same interface
    return Episodes(rank, model_dir)
