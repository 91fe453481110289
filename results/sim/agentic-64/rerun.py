"""agentic-64, seed 0, sync and DORA again under the simulator that steps the environment after the last turn
(2026-12-03), with the planner A/B's runner and window.

    .venv/bin/python results/sim/agentic-64/rerun.py     # ~30 min on 2 cores; writes rerun-2026-12-03.json
"""

import json
import sys
from multiprocessing import Pool
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "planner"))
import planner  # noqa: E402


def job(label: str):
    return planner.simulate(("agentic-64", label, 0))


if __name__ == "__main__":
    with Pool(2) as p:
        rows = p.map(job, ["sync", "dora"], chunksize=1)
    (HERE / "rerun-2026-12-03.json").write_text(json.dumps({label: row for _, label, row in rows}, indent=1) + "\n")
