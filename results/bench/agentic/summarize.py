import json
from pathlib import Path

from dora_hpc.bench.convergence_bench import machine, summarize
from dora_hpc.bench.plots import plot_convergence

out, config, n = Path("results/bench/agentic"), "configs/smollm2-retry.yaml", 100
which, losses = ["sync", "dora-k2", "partial"], ["decoupled+truncate"]
title = f"{', '.join(which)}: same initial model and seed ({config}, multi-turn retry)"
summary = summarize(out, [0], 5, losses, which) | {"config": config, "sets": [], "losses": losses, "eval_n": n,
                                                    "machine": machine(), "title": title}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
plot_convergence(summary, out / "convergence.png")
brief = {c: {k: v for k, v in d.items() if k not in ("curves", "times", "mean")} for c, d in summary["cases"].items()}
print(json.dumps(brief, indent=1))
print(json.dumps(summary.get("heldout"), indent=1))
