"""The tiered-supplementation A/B (issue 33): DORA with legacy top-up after the planner's migrations on a
publish (``dora.supplement: after_migration``, the paper's §3.3 order and the default) against top-up before
the planner (``before_rebalance``, the order dora_hpc used until 2026-12-03), each beside sync on the same
seed, on the planner A/B's single-turn workloads, 3 seeds each. Steady state: 40 steps, the first 2K left
out. Each run also counts the legacy groups top-up admitted, at a publish and at other events (the only
place the order can act is a publish).

    .venv/bin/python results/sim/supplement/supplement.py     # ~14 min on 2 cores; writes summary.json
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

import dora_hpc.core.dora as dora_policy
from dora_hpc.core.events import VersionPublished
from dora_hpc.sim import sweeps
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

HERE = Path(__file__).resolve().parent
SCENARIOS = {name: s for name, s in sweeps.SCENARIOS.items() if name != "agentic-64"}  # single-turn
SEEDS = sweeps.SEEDS
RUNS = {"sync": ("sync", []), "after_migration": ("dora", ["dora.supplement=after_migration"]),
        "before_rebalance": ("dora", ["dora.supplement=before_rebalance"])}
TOPUPS: collections.Counter = collections.Counter()  # legacy groups admitted, by the event being handled


def _count_topups() -> None:
    on, admit = dora_policy.Dora.on, dora_policy.Dora.admit

    def counted_on(self, event):
        self._event = "publish" if isinstance(event, VersionPublished) else "other"
        return on(self, event)

    def counted_admit(self, version):
        if version < self.latest:
            TOPUPS[getattr(self, "_event", "other")] += 1
        return admit(self, version)

    dora_policy.Dora.on, dora_policy.Dora.admit = counted_on, counted_admit


def simulate(job: tuple[str, str, int]) -> tuple[str, str, dict]:
    name, label, seed = job
    mode, extra = RUNS[label]
    TOPUPS.clear()
    cfg = sweeps.steady(name, extra, seed)
    s = summarize(Simulator(cfg, mode, timeline=False).run())
    row = {key: s[key] for key in ("throughput_tokens_per_s", "trainer_wait_fraction", "max_staleness", "migrations",
                                   "lost_groups", "duplicate_groups", "mixed_version_trajectories")}
    row |= {"seed": seed, "topup_at_publish": TOPUPS["publish"], "topup_elsewhere": TOPUPS["other"]}
    print(name, label, seed, round(s["throughput_tokens_per_s"]), dict(TOPUPS), flush=True)
    return name, label, row


def jobs() -> list[tuple[str, str, int]]:
    return [(name, label, base + i) for name, (_, _, base, _) in SCENARIOS.items() for i in range(SEEDS)
            for label in RUNS]


def main() -> None:
    with Pool(int(sys.argv[1]) if len(sys.argv) > 1 else 2, initializer=_count_topups) as pool:
        results = pool.map(simulate, jobs(), chunksize=1)
    out = sweeps.grouped(results)
    for rows in out.values():
        for label, runs in rows.items():
            rows[label] = {"median_over_sync": statistics.median(r["over_sync"] for r in runs), "seeds": runs}
    (HERE / "summary.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
