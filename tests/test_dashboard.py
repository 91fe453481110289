"""The live dashboard on a real terminal: ``dora-hpc run`` under tmux, the screen read back with
capture-pane. The panel is redrawn in place (its top line appears once in the whole scrollback), fits
80x24 and 200x50, and a Ctrl-C leaves the terminal clean (cursor shown, exit 3 at a checkpoint)."""

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from dora_hpc.runtime.dashboard import line, panel

REPO = Path(__file__).resolve().parents[1]
STATUS = {"mode": "dora", "k": 3, "step": 7, "max_steps": 40, "latest": 7, "t": 95.2, "tok_s": 291.4,
          "reward": 0.512, "instances": [[7 - i % 3, i == 2, 12 - i % 7] for i in range(16)], "fenced": [5],
          "queued": {"6": 3, "7": 5}, "stale": {"0": 10, "1": 5, "2": 3}}


def test_the_panel_fits_a_small_terminal_and_names_every_figure():
    console = Console(width=80, record=True, color_system=None)
    console.print(panel(STATUS))
    text = console.export_text()
    rows = text.rstrip("\n").split("\n")
    assert len(rows) <= 10 and all(len(r) <= 80 for r in rows), text
    for want in ("dora-hpc dora K=3", "step 7/40", "latest v7", "291 tok/s", "reward 0.512", "5:fenced",
                 "2:v5…·10", "v6: 3", "v7: 5", "0: 10", "2: 3"):
        assert want in text, (want, text)
    assert "step 7/40" in line(STATUS) and "reward 0.512" in line(STATUS)


def test_instances_lost_and_joined_show_as_the_live_count_over_time():
    s = {**STATUS, "live": [[0.0, 16], [52.3, 15], [90.0, 16]]}
    console = Console(width=80, record=True, color_system=None)
    console.print(panel(s))
    text = console.export_text()
    assert len(text.rstrip("\n").split("\n")) <= 10, text
    assert "live instances over time: 16 (0 s) → 15 (52 s) → 16 (90 s)" in text
    assert "| live 16 (0 s) → 15 (52 s) → 16 (90 s) |" in line(s)
    assert "live" not in line({**STATUS, "live": [[0.0, 16]]})  # nothing lost yet: no count shown


def test_a_multi_turn_run_shows_the_episodes_waiting_on_their_environment():
    s = {**STATUS, "instances": STATUS["instances"][:8], "env_waiting": [3, 0, 5, 1, 0, 0, 2, 9]}
    console = Console(width=80, record=True, color_system=None)
    console.print(panel(s))
    text = console.export_text()
    assert len(text.rstrip("\n").split("\n")) <= 10 and "(N env) waiting on" in text
    assert "0:v7·12(3 env)" in text and "7:v6·12(9 env)" in text.replace("\n", "")
    assert "v7·12(3 env) v6·11 v5…·10(5 env)" in line(s)


class Tmux:
    def __init__(self, width: int, height: int, command: str) -> None:
        self.name = f"dora-test-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height),
                        f"cd {REPO} && {command}; echo EXIT=$?; sleep 600"], check=True)

    def screen(self, history: bool = False) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name, *(["-S", "-"] if history else [])],
                              capture_output=True, text=True, check=True).stdout

    def wait_for(self, text: str, timeout: float = 240) -> str:
        end = time.time() + timeout
        while text not in (screen := self.screen()):
            assert time.time() < end, f"{text!r} never showed:\n{screen}"
            time.sleep(0.5)
        return screen

    def cursor_shown(self) -> bool:
        return subprocess.run(["tmux", "display", "-p", "-t", self.name, "#{cursor_flag}"], capture_output=True,
                              text=True).stdout.strip() == "1"

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


@pytest.fixture
def tmux():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    opened = []
    yield lambda *a: opened.append(Tmux(*a)) or opened[-1]
    for t in opened:
        t.close()


def run(run_dir, steps: int) -> str:
    return (f".venv/bin/dora-hpc run configs/tiny-cpu.yaml --set train.max_steps={steps} --set batch.tbs=4 "
            f"--set batch.rbs=6 --run-dir {run_dir}")


@pytest.mark.slow
def test_the_dashboard_redraws_in_place_at_80x24(tmp_path, tmux):
    term = tmux(80, 24, run(tmp_path / "run", 5))
    screen = term.wait_for("EXIT=")
    assert "EXIT=0" in screen and "run finished: 5 steps" in screen, screen
    assert term.screen(history=True).count("dora-hpc dora K=2") == 1, term.screen(history=True)
    for want in ("step 5/5", "tok/s", "instances (version", "queued per version", "staleness of consumed"):
        assert want in screen, (want, screen)
    assert term.cursor_shown()


@pytest.mark.slow
def test_ctrl_c_at_200x50_commits_a_checkpoint_and_leaves_the_terminal_clean(tmp_path, tmux):
    term = tmux(200, 50, run(tmp_path / "run", 40))
    end = time.time() + 240
    while not any(f"step {n}/40" in term.screen() for n in range(3, 40)):
        assert time.time() < end, term.screen()
        time.sleep(0.5)
    subprocess.run(["tmux", "send-keys", "-t", term.name, "C-c"], check=True)
    screen = term.wait_for("EXIT=", timeout=120)
    assert "EXIT=3" in screen and "stopped at checkpoint step-" in screen, screen
    history = term.screen(history=True)
    assert history.count("dora-hpc dora K=2") == 1 and "Traceback" not in history, history
    assert term.cursor_shown()
