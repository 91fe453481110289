"""Summarise the SmolLM2 runs of results/real-model/README.md: reward per step and per second from each
run's train log, the held-out evals, and where a step's time goes. Usage:
    python results/real-model/summarize.py RUNS_DIR   # holds {dora,sync}-s{0,1}/ and their eval JSONs
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from dora_hpc.store.shards import read_table

runs = Path(sys.argv[1])
here = Path(__file__).parent
out: dict = {"runs": {}}
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
for name in sorted(p.name for p in runs.iterdir() if p.is_dir() and (p / "launch.json").exists()):
    run = runs / name
    ts = read_table(run, "train", "steps")
    es = read_table(run, "events", "steps", with_rank=True)
    ops = read_table(run, "events", "ops", with_rank=True)
    o = np.argsort(ts["step"])
    t0 = float(es["t_start"].min())
    wl = ops["kind"] == "weight_load"
    rec = {"reward_by_step": ts["reward_mean"][o].tolist(), "t_end_s": (ts["t_end"][o] - t0).tolist(),
           "response_len_by_step": ts["response_len_mean"][o].tolist(),
           "wall_s": float(ts["t_end"].max() - t0),
           "step_interval_median_s": float(np.median(np.diff(ts["t_end"][o]))),
           "train_step_median_s": float(np.median(ts["t_end"] - ts["t_start"])),
           "weight_load_median_s": float(np.median(ops["t_end"][wl] - ops["t_start"][wl])),
           "engine_busy_s_by_rank": {int(r): float((es["t_end"] - es["t_start"])[es["rank"] == r].sum())
                                     for r in sorted(set(es["rank"].tolist()))}}
    for tag, f in (("heldout_final", f"{name}.json"), ("heldout_step10", f"{name}-step10.json")):
        if (runs / f).exists():
            e = json.loads((runs / f).read_text())
            rec[tag] = {"step": e["step"], "greedy": e["greedy"], "sampled": e.get("sampled")}
    out["runs"][name] = rec
    style = "-" if name.startswith("dora") else "--"
    a.plot(rec["reward_by_step"], style, label=name)
    b.plot(rec["t_end_s"], rec["reward_by_step"], style, label=name)
for ax, xl in ((a, "train step"), (b, "wall time since the first engine step (s)")):
    ax.set_xlabel(xl)
    ax.set_ylabel("mean reward of the step's batch (training prompts)")
    ax.grid(alpha=0.3)
    ax.legend()
fig.suptitle("SmolLM2-135M-Instruct, single-digit addition, 2 CPU cores: DORA K=2 vs sync "
             "(configs/smollm2-addition.yaml)")
fig.tight_layout()
fig.savefig(here / "reward.png", dpi=110)
for f in sorted(runs.glob("*step0*.json")) + sorted(runs.glob("initial*.json")):
    e = json.loads(f.read_text())
    out.setdefault("heldout_initial", {})[f.stem] = {"eval_seed": e["eval_seed"], "n": e["n"], "greedy": e["greedy"],
                                                      "sampled": e.get("sampled")}
(here / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({k: {kk: v[kk] for kk in ("wall_s", "step_interval_median_s", "train_step_median_s")}
                  | {"final": v.get("heldout_final", {}).get("greedy", {}).get("mean_reward")}
                  for k, v in out["runs"].items()}, indent=1))
