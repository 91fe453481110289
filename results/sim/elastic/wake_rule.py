"""The heavy tail under the previous wake rule (borrowed instances wake after every publish) against the
current one (only when the trainer must wait), one seed per call, steady state (40 steps, 12 left out).
The previous rule is patched into the policy here; core/ keeps only the current one.

    for s in $(seq 7 17); do for r in old new; do .venv/bin/python results/sim/elastic/wake_rule.py $r $s; done; done
"""

import sys

from elastic import HEAVY, ROOT  # the heavy tail as elastic.py measures it (this script's folder)

from dora_hpc.config import load_config
from dora_hpc.core import dora
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

STEADY = ["sim.steps=40", "sim.warmup_steps=12", "cluster.elastic=true"]  # elastic.py's steady window at K=6


def previous_rule(self):
    self.window.publish(self.latest)
    return self._wake() + self._admit() + self._rebalance() + self._train()


def main() -> None:
    rule, seed = sys.argv[1], int(sys.argv[2])
    if rule == "old":
        dora.Dora.on_published = previous_rule
    cfg = load_config(ROOT / "configs/sim/paper-64.yaml", [*HEAVY, *STEADY, f"seed={seed}"])
    s = summarize(Simulator(cfg, "dora", timeline=False).run())
    print(rule, seed, round(s["throughput_tokens_per_s"]), flush=True)


if __name__ == "__main__":
    main()
