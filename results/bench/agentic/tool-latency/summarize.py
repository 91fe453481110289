"""The SmolLM2 `retry` run under DORA K=2 with a slow environment step (issue 30): summary.json and
reward.png from its run directory and its held-out eval, beside the committed runs without a latency.

    .venv/bin/python results/bench/agentic/tool-latency/summarize.py RUN_DIR EVAL_JSON
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dora_hpc.analysis.basic import analyze  # noqa: E402
from dora_hpc.bench.convergence_bench import final, rollout_figures  # noqa: E402
from dora_hpc.store.shards import read_table  # noqa: E402

HERE = Path(__file__).resolve().parent
run, evaluation = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
launch = json.loads((run / "launch.json").read_text())
t = read_table(run, "train", "steps", ["step", "t_end", "reward_mean"])
order = t["step"].argsort()
curve, times = t["reward_mean"][order].tolist(), t["t_end"][order].tolist()
a = analyze(run)
ops = read_table(run, "events", "ops", ["kind", "detail", "bytes"])
moved = [(str(d), int(b)) for k, d, b in zip(ops["kind"], ops["detail"], ops["bytes"], strict=True)
         if k == "migration_in"]
committed = json.loads((HERE.parent / "summary.json").read_text())
summary = {
    "config": "configs/smollm2-retry.yaml", "env_args": launch["config"]["env"]["args"],
    "env_workers": launch["config"]["env"]["workers"], "env_timeout_s": launch["config"]["env"]["timeout_s"],
    "steps": a["steps"], "curve": curve, "times": times, "first": curve[0], "final": final(curve, 5),
    "seconds": times[-1], "seconds_per_step": (times[-1] - times[0]) / max(len(times) - 1, 1),
    "rollout": rollout_figures(run),
    "migrations_in": len(moved), "migrations_while_waiting": sum("waiting_env" in d for d, _ in moved),
    "migrated_kv_bytes": sum(b for _, b in moved), "reprefill_tokens": a["reprefill_tokens"],
    "staleness": a["staleness"], "trainer_wait_fraction": a["trainer_wait_fraction"],
    "heldout": {"initial": committed["heldout"]["initial_by_seed"]["0"],
                "final": evaluation["greedy"]["mean_reward"],
                "sampled_final": evaluation.get("sampled", {}).get("mean_reward"),
                "pass_at_1_final": evaluation["greedy"]["pass_at_1"], "turns_final": evaluation["greedy"]["turns"],
                "eval": "dora-hpc eval RUN_DIR --n 100 --set 'env.args={}' (the scores do not depend on the wait)"},
}
summary["heldout"]["gain"] = summary["heldout"]["final"] - summary["heldout"]["initial"]
(HERE / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
for name, style in (("sync", "C0"), ("dora-k2", "C1")):
    c = committed["cases"][name]
    left.plot(c["curves"]["0"], color=style, alpha=0.6, label=f"{name}, no latency")
    right.plot(c["times"]["0"], c["curves"]["0"], color=style, alpha=0.6, label=f"{name}, no latency")
left.plot(curve, "C3", lw=2, label="dora-k2, step latency (median 4 s)")
right.plot(times, curve, "C3", lw=2, label="dora-k2, step latency (median 4 s)")
left.set(xlabel="train step", ylabel="batch mean reward", title="reward per step")
right.set(xlabel="seconds since launch", title="reward per second")
left.legend(fontsize=8)
fig.suptitle("SmolLM2-135M, retry over single-digit addition (one seed, 2 CPU cores)")
fig.tight_layout()
fig.savefig(HERE / "reward.png", dpi=120)
print(json.dumps({k: v for k, v in summary.items() if k not in ("curve", "times")}, indent=1))
