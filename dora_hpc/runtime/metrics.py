"""Rank 0's metric sinks: one record per train step to TensorBoard event files, Weights & Biases and a
Prometheus endpoint (which also shows the live state between steps).

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

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Protocol

from ..core.policy_base import TRAIN_WAITS
from ..measure.utilization import trained_tokens_per_s

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
        self.stale_tokens: dict[int, list[int]] = {}  # ... and the trained tokens each finished in this attempt
        self.group_tokens: dict[int, int] = {}  # group -> trained tokens (prompt + response) of its trajectories
        self.trained: list[tuple[float, int]] = []  # each published step of this attempt: (its end, trained tokens)
        self.fenced = self.joined = 0  # instances fenced / joined since the last step
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

    def on_done(self, response_len: int, kv_transfer_s: float, done=None, group: int | None = None) -> None:
        self.tokens += response_len
        if group is not None:
            prompt = done.prompt_len if done is not None else 0
            self.group_tokens[group] = self.group_tokens.get(group, 0) + prompt + response_len
        self.kv_s += kv_transfer_s
        if done is not None:
            self.ep = [self.ep[0] + 1, self.ep[1] + done.turns, self.ep[2] + done.env_s, self.ep[3] + done.episode_s,
                       self.ep[4] + done.env_error]

    def on_train(self, step: int, staleness: list[int], groups: list[int] | None = None) -> None:
        self.staleness[step] = staleness
        self.stale_tokens[step] = [self.group_tokens.pop(g, 0) for g in groups or []]

    def forget(self, group: int) -> None:
        """A group that is dropped or filtered never trains: its tokens leave the count."""
        self.group_tokens.pop(group, None)

    def trained_tokens_per_s(self) -> float | None:
        """Trained tokens/s over this attempt's published steps, after its first (measure/utilization.py)."""
        return trained_tokens_per_s([t for t, _ in self.trained], [n for _, n in self.trained])

    def take(self, step: int, now: float, instances, env_waiting: int, queued: int, latest: int) -> dict[str, float]:
        """The figures of train step ``step`` (published at ``now``); the counters start again.
        ``env_waiting``: the episodes waiting on their environment now (a multi-turn run)."""
        interval = max(now - self.t_last, 1e-9)
        stale, tokens = self.staleness.pop(step, []), self.stale_tokens.pop(step, [])
        self.trained.append((now, sum(tokens)))
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
        if sum(tokens):  # weighted by the trained tokens each group finished in this attempt
            out["staleness/token_mean"] = sum(s * n for s, n in zip(stale, tokens, strict=True)) / sum(tokens)
            out |= {f"staleness/tokens_at_{s}": sum(n for x, n in zip(stale, tokens, strict=True) if x == s)
                    for s in sorted(set(stale))}
        out |= {"instances/fenced": self.fenced, "instances/joined": self.joined}
        self.fenced = self.joined = 0
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


class PrometheusSink:
    """``metrics.prometheus: PORT``: rank 0's figures in Prometheus' text format at http://HOST:PORT/metrics
    (prometheus_client; its own registry). Each step record's scalars are gauges ``dora_<name>`` (``/`` as
    ``_``); its per-step counts add up in counters: groups and tokens trained by staleness, the trainer's
    waits by kind, instances fenced and joined. Between steps ``live`` refreshes the step, the versions live,
    the queues and the live instances. The port bound (PORT 0: any free one) is written to
    RUN_DIR/prometheus-port."""

    name = "prometheus"

    def __init__(self, run_dir: Path, port: int) -> None:
        import prometheus_client as pc

        self.pc, self.registry = pc, pc.CollectorRegistry()
        self.gauges: dict[str, object] = {}
        g = lambda name, doc, labels=(): pc.Gauge(name, doc, labels, registry=self.registry)  # noqa: E731
        c = lambda name, doc, labels=(): pc.Counter(name, doc, labels, registry=self.registry)  # noqa: E731
        self.step, self.latest = g("dora_step", "train steps done"), g("dora_latest_version", "newest version")
        self.versions = g("dora_versions_live", "versions the rollout instances serve or load")
        self.queued = g("dora_queued_groups", "groups queued for a slot, by version", ["version"])
        self.live_instances = g("dora_instances_live", "rollout instances live (not fenced)")
        self.groups = c("dora_staleness_groups", "groups trained, by staleness", ["staleness"])
        self.tokens = c("dora_staleness_tokens", "trained tokens (prompt + response), by their group's staleness",
                        ["staleness"])
        self.waits = c("dora_trainer_wait_seconds", "seconds the trainer waited, by what for", ["kind"])
        self.replicas = g("dora_trainer_replicas_live", "trainer replicas live (train.replicas; not fenced)")
        self.fenced = c("dora_instances_fenced", "rollout instances fenced")
        self.joined = c("dora_instances_joined", "replacement instances joined")
        self.server, _ = pc.start_http_server(port, registry=self.registry)
        (run_dir / "prometheus-port").write_text(f"{self.server.server_port}\n")

    def log(self, step: int, record: dict[str, float]) -> None:
        self.step.set(step + 1)
        for key, value in record.items():
            if key.startswith(("staleness/groups_at_", "staleness/tokens_at_")):
                (self.groups if "groups_at_" in key else self.tokens).labels(key.rsplit("_", 1)[1]).inc(value)
            elif key.startswith("trainer_wait/"):
                self.waits.labels(key.removeprefix("trainer_wait/").removesuffix("_s")).inc(value)
            elif key in ("instances/fenced", "instances/joined"):
                (self.fenced if key.endswith("fenced") else self.joined).inc(value)
            elif not key.startswith(("rollout/instances_behind_", "instances_behind_")):
                name = "dora_" + "".join(ch if ch.isalnum() else "_" for ch in key)
                if name not in self.gauges:
                    self.gauges[name] = self.pc.Gauge(name, f"the last train step's {key}", registry=self.registry)
                self.gauges[name].set(value)

    def live(self, state: dict) -> None:
        """The dashboard's state (runtime/dashboard.py ``status``), at most every second."""
        self.step.set(state["step"])
        self.latest.set(state["latest"])
        targets = [t for t, _, _ in state["instances"] if t is not None]
        self.versions.set(len(set(targets)))
        self.live_instances.set(len(state["instances"]) - len(state["fenced"]))
        if state.get("trainers"):
            self.replicas.set(state["trainers"][0])
        self.queued.clear()
        for version, n in state["queued"].items():
            self.queued.labels(version).set(n)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Sinks:
    """Every configured sink; ``log``, ``live`` and ``close`` drop one that raises, with a single warning."""

    def __init__(self, cfg, run_dir: Path, start_step: int, run_id: str) -> None:
        self.sinks: list[Sink] = []
        m = cfg.metrics
        if m.tensorboard:
            self._add(lambda: TensorBoardSink(run_dir, start_step), "tensorboard")
        if m.wandb is not None and m.wandb.mode != "disabled":
            self._add(lambda: WandbSink(run_dir, m.wandb, cfg.model_dump(mode="json"), run_id), "wandb")
        if m.prometheus is not None:
            self._add(lambda: PrometheusSink(run_dir, m.prometheus), "prometheus")
        self.live_at = 0.0  # when ``live`` last reached the sinks (monotonic seconds)

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
                with contextlib.suppress(Exception):  # an endpoint must not go on showing stale figures
                    sink.close()

    def log(self, step: int, record: dict[str, float]) -> None:
        self._each(lambda s: s.log(step, record))

    def live(self, orch) -> None:
        """Between steps: the live state to the sinks that show one (Prometheus), at most every second."""
        if not any(hasattr(s, "live") for s in self.sinks) or time.monotonic() - self.live_at < 1.0:
            return
        from .dashboard import status

        self.live_at, state = time.monotonic(), status(orch)
        self._each(lambda s: s.live(state) if hasattr(s, "live") else None)

    def close(self) -> None:
        self._each(lambda s: s.close())
        self.sinks = []
