"""Rank 0's metric sinks: one record per train step to TensorBoard event files and Weights & Biases.

Invariants:
- only rank 0 writes them, from the step records the orchestrator builds (``step_record``); the HDF5
  logs stay the record of the run, and the sinks' scalars equal them;
- a sink that fails (a full disk, wandb missing, no network) warns once, naming itself, and is dropped:
  it never stops the run;
- a resumed run continues the same TensorBoard directory and the same W&B run (its id is kept in
  RUN_DIR/wandb-run-id), and its step axis continues at the resumed step: TensorBoard purges what an
  earlier attempt wrote at or after that step, so no step is shown twice.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Protocol

from ..core.policy_base import TRAIN_WAITS

# the train-steps row's figures that are not scalars to plot
NOT_SCALARS = ("step", "t_start", "t_end", "weights_checksum", "attempt")


class Sink(Protocol):
    name: str

    def log(self, step: int, record: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def step_record(train_row: dict, rollout: dict[str, float]) -> dict[str, float]:
    """The record of one train step: the trainer's train-steps row as ``train/<column>`` (exactly the HDF5
    table's values) and rank 0's figures as ``rollout/<name>``, ``staleness/<name>`` and
    ``trainer_wait/<what>_s`` (seconds the trainer waited since the last step, by what it waited for)."""
    out = {f"train/{k}": float(v) for k, v in train_row.items() if k not in NOT_SCALARS}
    out |= {k if "/" in k else f"rollout/{k}": float(v) for k, v in rollout.items()}
    return out


class StepFigures:
    """What rank 0 sees of the rollout side between two published steps, as the step record's
    ``rollout/`` and ``staleness/`` figures."""

    def __init__(self, now: float, episodes: bool = False) -> None:
        self.t_last, self.tokens, self.kv_s, self.migrations, self.loads = now, 0, 0.0, 0, []
        self.episodes = episodes  # a multi-turn run: the episodes/ figures
        self.ep = [0, 0, 0.0, 0.0, 0]  # episodes finished, their turns, env seconds, episode seconds, env errors
        self.staleness: dict[int, list[int]] = {}  # train step -> staleness of each group it consumes
        self.waits = dict.fromkeys(TRAIN_WAITS, 0.0)  # seconds the trainer waited, by Policy.train_wait's answer
        self.wait, self.t_wait = None, now       # what it waits for since t_wait (None: it trains)
        self.t_counted = now                     # the step figures hold the current wait up to here

    def on_decision(self, now: float, wait: str | None) -> tuple[str, float] | None:
        """The policy decided at ``now``; until its next decision the trainer waits for ``wait``. Returns
        (what, since) of a wait that ends now, for the event log."""
        if wait == self.wait:
            return None
        ended = None
        if self.wait is not None:
            self.waits[self.wait] += now - self.t_counted
            ended = (self.wait, self.t_wait)
        self.wait, self.t_wait, self.t_counted = wait, now, now
        return ended

    def on_done(self, response_len: int, kv_transfer_s: float, done=None) -> None:
        self.tokens += response_len
        self.kv_s += kv_transfer_s
        if done is not None:
            self.ep = [self.ep[0] + 1, self.ep[1] + done.turns, self.ep[2] + done.env_s, self.ep[3] + done.episode_s,
                       self.ep[4] + done.env_error]

    def on_train(self, step: int, staleness: list[int]) -> None:
        self.staleness[step] = staleness

    def take(self, step: int, now: float, instances, env_waiting: int, queued: int, latest: int) -> dict[str, float]:
        """The figures of train step ``step`` (published at ``now``); the counters start again.
        ``env_waiting``: the episodes waiting on their environment now (a multi-turn run)."""
        interval = max(now - self.t_last, 1e-9)
        stale = self.staleness.pop(step, [])
        targets = [x.target for x in instances if x.target is not None]
        out = {"step_interval_s": interval, "tokens_per_s": self.tokens / interval, "migrations": self.migrations,
               "kv_transfer_s": self.kv_s, "weight_loads": len(self.loads),
               "weight_load_s": sum(self.loads) / len(self.loads) if self.loads else math.nan,
               "versions_live": len(set(targets)), "queued": queued,
               "staleness/mean": sum(stale) / len(stale) if stale else math.nan,
               "staleness/max": max(stale, default=math.nan)}
        if self.wait is not None:  # a wait in progress counts up to now in this step's figures
            self.waits[self.wait] += now - self.t_counted
            self.t_counted = now
        out |= {f"trainer_wait/{k}_s": v for k, v in self.waits.items()}
        self.waits = dict.fromkeys(TRAIN_WAITS, 0.0)
        out |= {f"instances_behind_{d}": targets.count(v) for d, v in
                ((latest - v, v) for v in sorted(set(targets), reverse=True))}
        out |= {f"staleness/groups_at_{s}": stale.count(s) for s in sorted(set(stale))}
        if self.episodes:
            n, turns, env_s, ep_s, errors = self.ep
            out |= {"episodes/turns_mean": turns / n if n else math.nan,
                    "episodes/env_time_fraction": env_s / ep_s if ep_s else math.nan,
                    "episodes/env_errors": errors, "episodes/waiting_on_env": env_waiting}
        self.ep = [0, 0, 0.0, 0.0, 0]
        self.t_last, self.tokens, self.kv_s, self.migrations, self.loads = now, 0, 0.0, 0, []
        return out


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events an earlier attempt wrote at or after the resumed step are hidden
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step or None)

    def log(self, step: int, record: dict[str, float]) -> None:
        for tag, value in record.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, run_dir: Path, cfg, config: dict, run_id: str) -> None:
        import wandb

        id_file = run_dir / "wandb-run-id"
        wid = id_file.read_text().strip() if id_file.is_file() else f"{run_id}"
        id_file.write_text(wid + "\n")
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir), id=wid,
                              resume="allow", config=config, settings=wandb.Settings(silent=True))

    def log(self, step: int, record: dict[str, float]) -> None:
        self.run.log({k: v for k, v in record.items() if not math.isnan(v)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """Every configured sink; ``log`` and ``close`` drop one that raises, with a single warning."""

    def __init__(self, cfg, run_dir: Path, start_step: int, run_id: str) -> None:
        self.sinks: list[Sink] = []
        m = cfg.metrics
        if m.tensorboard:
            self._add(lambda: TensorBoardSink(run_dir, start_step), "tensorboard")
        if m.wandb is not None and m.wandb.mode != "disabled":
            self._add(lambda: WandbSink(run_dir, m.wandb, cfg.model_dump(mode="json"), run_id), "wandb")

    def _add(self, build, name: str) -> None:
        try:
            self.sinks.append(build())
        except Exception as e:  # noqa: BLE001 -- a sink must never stop the run
            self._warn(name, e)

    @staticmethod
    def _warn(name: str, e: Exception) -> None:
        print(f"dora-hpc: warning: metrics sink {name} failed and is switched off ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)

    def _each(self, call) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as e:  # noqa: BLE001
                self.sinks.remove(sink)
                self._warn(sink.name, e)

    def log(self, step: int, record: dict[str, float]) -> None:
        self._each(lambda s: s.log(step, record))

    def close(self) -> None:
        self._each(lambda s: s.close())
        self.sinks = []
