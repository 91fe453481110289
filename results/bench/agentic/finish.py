"""Finish the agentic convergence bench after its process stopped at the DORA eval (a config key added on
disk mid-bench): the same steps bench_convergence takes, from where it stopped."""
import json
import sys
from pathlib import Path

from dora_hpc.bench.convergence_bench import CASES, LOSSES, _eval, heldout_path, machine, run_dir, summarize
from dora_hpc.bench.modes_bench import run_case
from dora_hpc.bench.plots import plot_convergence

out, config, seed, n = Path("results/bench/agentic"), "configs/smollm2-retry.yaml", 0, 100
which, losses = ["sync", "dora-k2", "partial"], ["decoupled+truncate"]
for case in which:
    rd = run_dir(out, case, seed)
    if not (rd / "launch.json").is_file():
        print(f"running {case}", flush=True)
        run_case(config, [*LOSSES[losses[0]], *CASES[case], f"seed={seed}"], rd, timeout_s=3600)
    if not heldout_path(out, case, seed).is_file():
        print(f"eval {case}", flush=True)
        _eval(str(rd), None, heldout_path(out, case, seed), n)
title = f"{', '.join(which)}: same initial model and seeds ({config} )"
summary = summarize(out, [seed], 5, losses, which) | {"config": config, "sets": [], "losses": losses, "eval_n": n,
                                                       "machine": machine(), "title": title}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
plot_convergence(summary, out / "convergence.png")
print("done", file=sys.stderr)
