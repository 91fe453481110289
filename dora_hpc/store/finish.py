"""A request to end a run early: ``dora-hpc finish RUN_DIR --at STEP`` writes RUN_DIR/finish.json, rank 0 reads
it every tick (runtime/orchestrator.py ``finish_at``) and ends the run at STEP as at ``train.max_steps``.

Invariants: the file is written whole (a rename), so rank 0 reads a request or none; a run that ended where a
request said removes it, so a later resume goes on to ``train.max_steps``."""

from __future__ import annotations

import json
import os
from pathlib import Path

FINISH = "finish.json"


def ask_finish(run_dir: Path, at: int) -> None:
    """Ask the run in ``run_dir`` (running, or resumed later) to end after step ``at``."""
    tmp = run_dir / f".{FINISH}.{os.getpid()}"
    tmp.write_text(json.dumps({"at": at}) + "\n")
    tmp.replace(run_dir / FINISH)


def read_finish(run_dir: Path) -> int | None:
    """The step a finish request names, or None (none asked, or a file that is not one)."""
    try:
        at = json.loads((run_dir / FINISH).read_text())["at"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return at if isinstance(at, int) and at >= 1 else None
