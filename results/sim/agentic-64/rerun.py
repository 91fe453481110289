"""agentic-64, seed 0, sync and DORA again under the simulator that steps the environment after the last turn
(2026-12-03), with the planner A/B's runner and window.

    .venv/bin/python results/sim/agentic-64/rerun.py     # ~30 min on 2 cores; writes rerun-2026-12-03.json
"""

import json
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.sim.sweeps import run

HERE = Path(__file__).resolve().parent


def job(label: str):
    return run(("agentic-64", label, 0))


if __name__ == "__main__":
    with Pool(2) as p:
        rows = p.map(job, ["sync", "dora"], chunksize=1)
    (HERE / "rerun-2026-12-03.json").write_text(json.dumps({label: row for _, label, row in rows}, indent=1) + "\n")
