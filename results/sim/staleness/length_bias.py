"""Does the consumption order (oldest complete groups first) delay long groups? For each trained group of a
steady-state window: its response tokens (the sum over its samples), its staleness and how long it waited
complete before a step took it; Spearman correlations and the mean of each by length quintile, for eager
and lean admission at the config's K.

    .venv/bin/python results/sim/staleness/length_bias.py configs/sim/paper-64.yaml \
        > results/sim/staleness/length_bias.json
"""

import json
import statistics
import sys

import numpy as np

from dora_hpc.config import load_config
from dora_hpc.core.events import RequestFinished, StartTrain
from dora_hpc.sim.cluster import Simulator


def spearman(x: list[float], y: list[float]) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def measure(config: str, admission: str, seed: int) -> dict:
    cfg = load_config(config, [f"dora.admission={admission}", f"seed={seed}"])
    sim = Simulator(cfg, "dora", timeline=False)
    done: dict[int, float] = {}
    taken: list[tuple[int, float, tuple[int, ...]]] = []
    feed = sim.policy.on

    def on(event):
        if isinstance(event, RequestFinished):
            done[event.traj_id // cfg.batch.group_size] = sim.now
        out = feed(event)
        taken.extend((c.step, sim.now, c.group_ids) for c in out if isinstance(c, StartTrain))
        return out

    sim.policy.on = on
    sim.run()
    g_size = cfg.batch.group_size
    rows = []
    for step, t, groups in taken:
        if not cfg.sim.warmup_steps <= step < cfg.sim.steps:
            continue
        for g in groups:
            tokens = sum(x.tokens for t_ in range(g * g_size, (g + 1) * g_size) for x in sim.episodes[t_])
            rows.append((tokens, step - sim.policy.ledger.groups[g].version, t - done[g]))
    length, stale, wait = (list(c) for c in zip(*rows, strict=True))
    edges = np.quantile(length, [0.2, 0.4, 0.6, 0.8])
    quint = np.searchsorted(edges, length)
    by_q = [{"quintile": q + 1, "mean_tokens": statistics.fmean(np.array(length)[quint == q]),
             "mean_staleness": statistics.fmean(np.array(stale)[quint == q]),
             "mean_wait_complete_s": statistics.fmean(np.array(wait)[quint == q])} for q in range(5)]
    return {"admission": admission, "seed": seed, "groups": len(rows), "mean_staleness": statistics.fmean(stale),
            "spearman_length_staleness": spearman(length, stale), "spearman_length_wait": spearman(length, wait),
            "by_length_quintile": by_q}


if __name__ == "__main__":
    config = sys.argv[1]
    out = [measure(config, a, 0) for a in ("eager", "lean")]
    json.dump({"config": config, "runs": out}, sys.stdout, indent=2)
    print()
