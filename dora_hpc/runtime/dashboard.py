"""Rank 0's view of the run: a rich live dashboard on a terminal, one plain line per update otherwise.

It only reads the policy's state and counters the orchestrator keeps; it never decides anything.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]


class Dashboard:
    def __init__(self, live: bool, max_steps: int) -> None:
        self.max_steps = max_steps
        self.live = Live(console=Console(force_terminal=True), refresh_per_second=4, transient=False) if live else None
        if self.live:
            self.live.start()
        self.last_line = 0.0

    def update(self, orch, force: bool = False) -> None:
        if self.live:
            self.live.update(self.render(orch))
        elif force or time.time() - self.last_line >= 2.0:
            self.last_line = time.time()
            print(self.line(orch), file=sys.stderr, flush=True)

    def close(self, orch) -> None:
        if self.live:
            self.live.update(self.render(orch))
            self.live.stop()

    @staticmethod
    def _instances(orch) -> list[tuple[str, str]]:
        out = []
        for x in orch.policy.view.instances:
            v = x.target
            label = "-" if v is None else f"v{v}{'…' if x.loading is not None else ''}·{len(x.active)}"
            out.append((label, "dim" if v is None else COLORS[v % len(COLORS)]))
        return out

    def line(self, orch) -> str:
        inst = " ".join(label for label, _ in self._instances(orch))
        queued = {v: len(q) for v, q in orch.policy.view.queues.items() if q}
        t = orch.now()
        reward = orch.rewards[-1] if orch.rewards else float("nan")
        return (f"[{t:7.1f}s] step {orch.steps_done}/{self.max_steps} latest v{orch.policy.latest} | "
                f"instances {inst} | queued {queued or '-'} | {orch.finished_tokens / max(t, 1e-9):.0f} tok/s | "
                f"staleness {dict(sorted(orch.stale.items()))} | reward {reward:.3f}")

    def render(self, orch):
        t = orch.now()
        head = Table.grid(padding=(0, 2))
        head.add_row(Text(f"dora-hpc {orch.cfg.mode}", style="bold"), f"step {orch.steps_done}/{self.max_steps}",
                     f"latest v{orch.policy.latest}", f"{orch.finished_tokens / max(t, 1e-9):,.0f} tok/s",
                     f"reward {orch.rewards[-1]:.3f}" if orch.rewards else "reward -", f"{t:,.0f}s")
        inst = Text("instances (version·live requests, … = loading): ")
        for label, style in self._instances(orch):
            inst.append(label + " ", style=style)
        queued = {v: len(q) for v, q in orch.policy.view.queues.items() if q}
        stale = ", ".join(f"{s}: {orch.stale[s]}" for s in sorted(orch.stale)) or "-"
        return Group(head, inst, Text(f"queued per version: {queued or '-'}"),
                     Text(f"staleness of consumed groups (staleness: groups): {stale}"),
                     ProgressBar(total=self.max_steps, completed=orch.steps_done, width=60))
