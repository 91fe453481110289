"""The simulator's side of analyze's ``window_gate``: while the trainer waits for the window, where are the requests
it waits for (the unfinished ones of the versions the next step must consume), and beside how large a batch do they
decode? Until the simulator writes the runtime's logs (issue 54), this reads its state at every change of what the
trainer waits for (Simulator._mark), so it is a probe, not a second definition of a figure.

    .venv/bin/python results/sim/tail/gate.py > results/sim/tail/gate.json      # ~5 min

Per workload and admission: window-wait seconds; gating requests (mean, per wait-second); the share of their
request-seconds spent running, queued on an instance (waiting for KV), in transit, or held; and the mean running
batch beside a running gating request (request-second weighted).
"""

import json
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator

HEAVY = ["workload.response_len.sigma=1.6", "workload.response_len.max=65536", "dora.k=6", "sim.warmup_steps=12"]
CASES = {
    "paper-64, lean": ("configs/sim/paper-64.yaml", [], 0),
    "paper-64, eager": ("configs/sim/paper-64.yaml", ["dora.admission=eager"], 0),
    "heavy tail, eager": ("configs/sim/paper-64.yaml", [*HEAVY, "dora.admission=eager"], 7),
    "heavy tail, eager elastic": ("configs/sim/paper-64.yaml", [*HEAVY, "dora.admission=eager",
                                                                "cluster.elastic=true"], 7),
}


def probe(case: str) -> dict:
    path, sets, seed = CASES[case]
    cfg = load_config(path, [*sets, f"seed={seed}"])
    sim = Simulator(cfg, "dora", timeline=False)
    where: Counter[str] = Counter()
    stats = {"wait_s": 0.0, "request_s": 0.0, "batch_s": 0.0}
    mark = sim._mark

    def observed() -> None:
        dt = sim.now - sim._last_mark
        if (dt > 0 and not sim.trainer_busy and len(sim.steps) >= cfg.sim.warmup_steps
                and sim.policy.train_wait() == "window"):
            gate = sim.policy.window.must_consume()
            gating = [t for t, tr in sim.policy.view.trajs.items() if tr.version <= gate]
            stats["wait_s"] += dt
            where_now = {}
            for inst in sim.inst:  # one pass over the instances, not one a gating request
                where_now |= {t: ("running", len(inst.reqs)) for t in inst.reqs}
                where_now |= {t: ("held", 0) for t in inst.held} | {r.traj: ("queued", 0) for r in inst.waiting}
            for t in gating:
                state, n = where_now.get(t, ("in transit" if t in sim.in_transit else "parked", 0))
                stats["batch_s"] += n * dt
                where[state] += dt
                stats["request_s"] += dt
        mark()

    sim._mark = observed
    sim.run()
    running = where["running"]
    return {"window_wait_s": stats["wait_s"],
            "gating_requests": stats["request_s"] / stats["wait_s"] if stats["wait_s"] else 0.0,
            "share": {k: v / stats["request_s"] for k, v in where.items()} if stats["request_s"] else {},
            "batch_beside_running": stats["batch_s"] / running if running else None}


def main() -> None:
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with ProcessPoolExecutor(max_workers=workers) as pool:
        out = dict(zip(CASES, pool.map(probe, CASES), strict=True))
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
