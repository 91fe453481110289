"""Why DORA beats partial rollout by less than the paper at 64 GPUs (issue 33): partial rollout on paper-64 in
its own colocated placement (every accelerator trains, 16 instances roll out between steps) and on DORA's
disaggregated split (6 instances x TP4 + 40 train accelerators). Simulated time, seed 0, the config's window.

    .venv/bin/python results/paper/partial_placement.py     # ~2 min; writes partial-placement.json here
"""

import json
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.sim.metrics import summarize

HERE = Path(__file__).resolve().parent
KEEP = ("throughput_tokens_per_s", "placement", "rollout_instances", "train_accelerators", "reprefill_tokens",
        "overheads", "rollout_only_fraction", "trainer_wait_fraction", "max_staleness")

if __name__ == "__main__":
    out = {}
    for label, sets in (("colocated", []), ("disaggregated", ["cluster.placement={partial: disaggregated}"])):
        cfg = load_config(HERE.parents[1] / "configs/sim/paper-64.yaml", sets)
        s = summarize(Simulator(cfg, "partial", timeline=False).run())
        out[label] = {k: s[k] for k in KEEP}
        print(label, round(s["throughput_tokens_per_s"]))
    (HERE / "partial-placement.json").write_text(json.dumps(out, indent=1) + "\n")
