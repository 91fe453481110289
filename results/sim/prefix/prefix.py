"""Issue 45 in the simulator: a prompt shared by a group's samples, and a system prompt shared by every
request, prefilled and held once per instance (``engine.prefix_caching``) against once per sequence. Seed 0,
steady state (40 steps, the first 2K left out), the scenarios of dora_hpc/sim/sweeps.py:

* agentic-64 with a 2,000-token system prompt (``workload.shared_prefix_tokens=2000``), DORA elastic;
* paper-64 and long reasoning (no system prompt: only a group's prompt is shared), DORA.

    .venv/bin/python results/sim/prefix/prefix.py [workers]    # ~45 min on 1 core; writes summary.json
"""

from __future__ import annotations

import json
import sys
from multiprocessing import Pool
from pathlib import Path

from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize, zero_bubble_limit
from dora_hpc.sim.sweeps import KEEP, SCENARIOS, steady

HERE = Path(__file__).resolve().parent

RUNS = {  # name: (scenario, mode, extra overrides)
    "agentic-64 + 2,000-token system prompt, DORA elastic": (
        "agentic-64", "dora", ["cluster.elastic=true", "workload.shared_prefix_tokens=2000"]),
    "paper-64, DORA": ("paper-64", "dora", []),
    "long reasoning, DORA": ("long reasoning", "dora", []),
}


def simulate(job: tuple[str, bool]) -> tuple[str, bool, dict]:
    name, shared = job
    scenario, mode, extra = RUNS[name]
    seed = SCENARIOS[scenario][2]
    cfg = steady(scenario, [*extra, f"engine.prefix_caching={str(shared).lower()}"], seed)
    s = summarize(Simulator(cfg, mode, timeline=False).run())
    limit = zero_bubble_limit(cfg, s["placement"], borrowed=s["borrowed_instances"])
    row = {**{key: s.get(key) for key in (*KEEP, "prefix_hit_tokens", "preemptions")}, "limit_tokens_per_s": limit,
           "limit_share": s["throughput_tokens_per_s"] / limit, "seed": seed}
    print(name, "shared" if shared else "unshared", round(s["throughput_tokens_per_s"]), round(limit), flush=True)
    return name, shared, row


if __name__ == "__main__":
    jobs = [(name, shared) for name in RUNS for shared in (False, True)]
    with Pool(int(sys.argv[1]) if len(sys.argv) > 1 else 1) as pool:
        rows = pool.map(simulate, jobs, chunksize=1)
    out: dict = {}
    for name, shared, row in rows:
        out.setdefault(name, {})["shared" if shared else "unshared"] = row
    for runs in out.values():
        runs["shared_over_unshared"] = {k: runs["shared"][k] / runs["unshared"][k] for k in
                                        ("throughput_tokens_per_s", "limit_tokens_per_s") if runs["unshared"][k]}
    (HERE / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
