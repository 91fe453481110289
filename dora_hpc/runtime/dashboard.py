"""The run's live view: rank 0 describes its state, the launcher draws it on its own terminal.

Rank 0's stdout reaches the terminal only through mpiexec's pipes, so rank 0 never draws. On a terminal
(``DORA_HPC_TTY=1``) it writes one status line (``MARKER`` + JSON) at most 4 times a second, which the
launcher (launch/local.py) turns into a rich Live panel sized to its terminal, printing every other
line of the job above it; otherwise (a log file, Slurm) rank 0 prints a plain status line every 2 s.

It only reads the policy's state and the counters the orchestrator keeps; it never decides anything.
"""

from __future__ import annotations

import json
import os
import sys
import time

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
LIVE_SHOWN = 6  # the live instance count's last changes the dashboard shows
MARKER = "\x1edora-status "  # starts a status line (ASCII record separator: never in a rank's own output)


def status(orch) -> dict:
    """What the dashboard shows, as plain data."""
    t = orch.now()
    bound = orch.policy.traits(orch.cfg.dora.k).staleness_bound  # None: unbounded (partial rollout)
    return {"mode": orch.cfg.mode, "k": bound,
            "step": orch.steps_done, "max_steps": orch.max_steps, "latest": orch.policy.latest,
            "t": t, "tok_s": orch.figures.trained_tokens_per_s(),  # trained tokens/s, as analyze says (glossary)
            "reward": orch.rewards[-1] if orch.rewards else None,
            "instances": [[x.target, x.loading is not None, len(x.active)] for x in orch.policy.view.instances],
            "env_waiting": [orch.env_waiting.get(i, 0) for i in range(len(orch.policy.view.instances))]
            if orch.cfg.env.multi_turn else None,
            "fenced": sorted(orch.roles.instance_of_rank(r) for r in orch.fenced if orch.roles.role(r) == "rollout"),
            "trainers": [orch.live_groups, orch.cfg.train.replicas] if orch.roles.replicated else None,
            "live": [[round(t, 1), n] for t, n in orch.live_counts[-LIVE_SHOWN:]],
            "queued": {str(v): len(q) for v, q in sorted(orch.policy.view.queues.items()) if q},
            "stale": {str(s): n for s, n in sorted(orch.stale.items())}}


def _label(target: int | None, loading: bool, active: int) -> str:
    return "-" if target is None else f"v{target}{'…' if loading else ''}·{active}"


def _env(s: dict, i: int) -> str:
    """An instance's episodes waiting on their environment (multi-turn runs)."""
    waiting = s.get("env_waiting")
    return f"({waiting[i]} env)" if waiting and waiting[i] else ""


def tok_s(s: dict) -> str:
    """Trained tokens/s so far ("-" until a second step has ended)."""
    return "-" if s.get("tok_s") is None else f"{s['tok_s']:,.0f}"


def mean_staleness(s: dict) -> str:
    """The mean staleness of the groups consumed so far ("-" before the first step)."""
    n = sum(s["stale"].values())
    return f"{sum(int(k) * c for k, c in s['stale'].items()) / n:.2f}" if n else "-"


def live(s: dict) -> str:
    """The live instance count over time, once it has changed ("" before): "4 (0 s) → 3 (52 s) → 4 (90 s)"."""
    counts = s.get("live") or []
    return " → ".join(f"{n} ({t:.0f} s)" for t, n in counts) if len(counts) > 1 else ""


def line(s: dict) -> str:
    """One plain status line (logs, Slurm)."""
    inst = " ".join(_label(*x) + _env(s, i) for i, x in enumerate(s["instances"]))
    counts = live(s)
    inst += f" | live {counts}" if counts else ""
    inst += f" | trainer replicas {s['trainers'][0]}/{s['trainers'][1]}" if s.get("trainers") else ""
    reward = "nan" if s["reward"] is None else f"{s['reward']:.3f}"
    return (f"[{s['t']:7.1f}s] step {s['step']}/{s['max_steps']} latest v{s['latest']} | instances {inst} | "
            f"queued {s['queued'] or '-'} | {tok_s(s)} tok/s | staleness {s['stale']} mean {mean_staleness(s)} | "
            f"reward {reward}")


def panel(s: dict):
    """The live panel: a few lines that wrap to any width (80x24 and up)."""
    head = Text()
    head.append(f"dora-hpc {s['mode']}" + (f" K={s['k']}" if s["k"] is not None else ""), style="bold")
    reward = "-" if s["reward"] is None else f"{s['reward']:.3f}"
    head.append(f"  step {s['step']}/{s['max_steps']}  latest v{s['latest']}  {tok_s(s)} tok/s  "
                f"reward {reward}  {s['t']:,.0f} s")
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=max(s["max_steps"], 1), completed=s["step"], width=40),
                f"{100 * s['step'] / max(s['max_steps'], 1):.0f}%")
    inst = Text("instances (version·live requests, … loading" + (", (N env) waiting on their environment"
                if s.get("env_waiting") else "") + "): ", style="dim")
    for i, (target, loading, active) in enumerate(s["instances"]):
        gone = i in s["fenced"]
        inst.append(f"{i}:", style="dim")
        inst.append("fenced" if gone else _label(target, loading, active),
                    style="red strike" if gone else ("dim" if target is None else COLORS[target % len(COLORS)]))
        inst.append("" if gone else _env(s, i), style="dim")
        inst.append("  ")
    queued = "  ".join(f"v{v}: {n}" for v, n in s["queued"].items()) or "-"
    stale = "  ".join(f"{k}: {n}" for k, n in s["stale"].items()) or "-"
    counts = live(s)
    return Group(head, bar, inst, *([Text(f"live instances over time: {counts}")] if counts else []),
                 Text(f"queued per version: {queued}"),
                 Text(f"staleness of consumed groups (staleness: groups): {stale}   mean {mean_staleness(s)}"))


class Dashboard:
    """Rank 0's side: status lines for the launcher's panel on a terminal, plain lines otherwise."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.last = 0.0

    def update(self, orch, force: bool = False) -> None:
        every = 0.25 if self.tty else 2.0
        if not force and time.time() - self.last < every:
            return
        self.last = time.time()
        s = status(orch)
        if self.tty:  # one write: hydra forwards it whole, never interleaved with another rank's line
            os.write(sys.stdout.fileno(), (MARKER + json.dumps(s) + "\n").encode())
        else:
            print(line(s), file=sys.stderr, flush=True)

    def close(self, orch) -> None:
        self.update(orch, force=True)


class LiveView:
    """The launcher's side: rank 0's status lines redrawn in place as a rich Live panel on the launcher's
    own terminal (its real size; every other line of the job printed above it). Without a terminal the
    status lines are dropped (rank 0 then writes none). ``stop`` leaves the last panel and the cursor."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.live = None

    def feed(self, raw: str) -> bool:
        """Whether ``raw`` was a status line (shown, or dropped if garbled), not a line to pass on."""
        if not raw.startswith(MARKER):
            return False
        try:
            view = panel(json.loads(raw[len(MARKER):]))
        except (ValueError, KeyError, TypeError):
            return True
        if not self.tty:
            return True
        if self.live is None:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(view, console=Console(stderr=True), refresh_per_second=4, transient=False)
            self.live.start()
        else:
            self.live.update(view)
        return True

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
