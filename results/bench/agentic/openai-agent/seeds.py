"""The agent against the environment on 3 seeds at the same 8 slots (issue 44, item 7): held-out greedy gain,
batch reward, staleness and invariants per run, and the spread of each side. Usage:
    python results/bench/agentic/openai-agent/seeds.py RUNS_DIR
RUNS_DIR holds ``agent-sN/`` and ``env8-sN/`` (run directories), ``NAME.final.eval.json`` for each, and
``sN.initial.eval.json`` (the initial model on seed N's held-out prompts, which depend on the seed) for
N > 0. Seed 0's agent run is the one in summary.json (same config, an earlier commit), and seed 0's initial
eval is initial.eval.json here. A seed counts once both sides' final evals and its initial eval exist.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from dora_hpc.analysis.basic import analyze
from dora_hpc.store.shards import read_table

runs, here = Path(sys.argv[1]), Path(__file__).parent
SEEDS = tuple(s for s in (0, 1, 2) if (runs / f"env8-s{s}.final.eval.json").exists() and (
    s == 0 or (runs / f"agent-s{s}.final.eval.json").exists() and (runs / f"s{s}.initial.eval.json").exists()))
INVARIANTS = ("lost_groups", "duplicate_groups", "split_groups", "staleness_over_k", "mixed_version_trajectories")


def greedy(path: Path) -> dict:
    g = json.loads(path.read_text())["greedy"]
    return {"mean_reward": g["mean_reward"], "pass_at_1": g["pass_at_1"], "turns": g["turns"]["mean"],
            "prompts": g["responses"]}


def run_figures(run: Path) -> dict:
    ts = read_table(run, "train", "steps")
    rewards = ts["reward_mean"][np.argsort(ts["step"])].tolist()
    a = analyze(run)
    return {"reward_curve": rewards, "batch_reward_last5": float(np.mean(rewards[-5:])),
            "staleness_mean": a["staleness"]["mean"], "invariants": {k: a["invariants"][k] for k in INVARIANTS}}


initial = {0: greedy(here / "initial.eval.json")} | {s: greedy(runs / f"s{s}.initial.eval.json") for s in SEEDS[1:]}
out: dict = {"seeds": list(SEEDS), "initial": {str(s): v for s, v in initial.items()}, "runs": {}}
old = json.loads((here / "summary.json").read_text())
for kind in ("agent", "env8"):
    for s in SEEDS:
        name = f"{kind}-s{s}"
        if kind == "agent" and s == 0:
            rec = {"reward_curve": old["reward_curve"], "batch_reward_last5": old["batch_reward_last5"],
                   "staleness_mean": old["run"]["staleness"]["mean"],
                   "invariants": {k: old["run"]["invariants"][k] for k in INVARIANTS}}
            final = {"mean_reward": old["heldout"]["final"]["mean_reward"],
                     "pass_at_1": old["heldout"]["final"]["pass_at_1"],
                     "turns": old["heldout"]["final"]["turns"]["mean"], "prompts": old["heldout"]["final"]["responses"]}
        else:
            rec, final = run_figures(runs / name), greedy(runs / f"{name}.final.eval.json")
        out["runs"][name] = rec | {"heldout_final": final, "gain": final["mean_reward"] - initial[s]["mean_reward"]}
gains = {kind: [out["runs"][f"{kind}-s{s}"]["gain"] for s in SEEDS] for kind in ("agent", "env8")}
out["gain"] = {kind: {"by_seed": g, "mean": float(np.mean(g)), "min": min(g), "max": max(g)}
               for kind, g in gains.items()}
out["agent_within_env_spread"] = bool(min(gains["env8"]) <= np.mean(gains["agent"]) <= max(gains["env8"]))
(here / "seeds.json").write_text(json.dumps(out, indent=2) + "\n")

fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
for kind, color in (("agent", "tab:blue"), ("env8", "tab:orange")):
    for s in SEEDS:
        r = out["runs"][f"{kind}-s{s}"]["reward_curve"]
        a.plot(range(len(r)), r, color=color, alpha=0.7, label=f"{kind}" if s == 0 else None)
    b.scatter([kind] * len(SEEDS), gains[kind], color=color)
    b.hlines(np.mean(gains[kind]), -0.2 + (kind == "env8"), 0.2 + (kind == "env8"), color=color)
a.set(xlabel="step", ylabel="training batch reward", title=f"retry: agent vs environment, seeds {SEEDS}")
a.legend()
b.set(ylabel="held-out greedy gain (final - initial)", title="held-out gain per seed (line: mean)")
fig.tight_layout()
fig.savefig(here / "seeds.png", dpi=110)
print(json.dumps(out["gain"], indent=1), "within env spread:", out["agent_within_env_spread"])
