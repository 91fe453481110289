""""The longer the tail, the bigger the gain" (paper §2.2), in the simulator: paper-64 at the defaults, the response
length's sigma swept with the cap at 64k, 3 seeds; DORA over sync and over partial rollout, each seed against its
own reference run. Steady state (the config's 40 steps, the first 6 left out).

    .venv/bin/python results/sim/tail/tail.py [SEEDS [WORKERS]] > results/sim/tail/tail.json
    .venv/bin/python results/sim/tail/tail.py --plot results/sim/tail/tail.json   # tail.png
    .venv/bin/python results/sim/tail/tail.py --elastic results/sim/tail/tail.json > results/sim/tail/tail-elastic.json
    T=results/sim/tail; .venv/bin/python $T/tail.py --reprefill $T/tail.json > $T/tail-chunked.json
    .venv/bin/python results/sim/tail/tail.py --plot results/sim/tail/tail.json results/sim/tail/tail-chunked.json

``--elastic``: DORA again with cluster.elastic (borrowed instances, off by default), against the sync and partial
runs of the given sweep. ``--reprefill``: partial rollout again with its re-prefill priced the second way,
``sim.hardware.reprefill: chunked`` (in chunks beside the decodes: Sarathi, arXiv 2308.16369), against the sync
and DORA runs of the given sweep (neither re-prefills). ``--plot A B``: B's DORA / partial drawn beside A's.
"""

import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.sim.frontier import run_point

SIGMAS = (0.6, 0.8, 1.0, 1.2, 1.4, 1.6)
MODES = ("sync", "partial", "dora")
CONFIG = "configs/sim/paper-64.yaml"


def shape(sigma: float) -> dict:
    return {"workload.response_len.sigma": sigma, "workload.response_len.max": 65536}


def run_all(seeds: tuple[int, ...], workers: int, modes: tuple[str, ...] = MODES, extra: dict | None = None) -> dict:
    base = load_config(CONFIG)
    jobs = {(s, m, seed): (base, {"mode": m, "changes": shape(s) | (extra or {})}, seed)
            for s in SIGMAS for m in modes for seed in seeds}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(run_point, *args) for key, args in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def summarize(runs: dict, seeds: tuple[int, ...]) -> dict:
    out = {"config": CONFIG, "seeds": list(seeds), "sigmas": list(SIGMAS), "by_sigma": {}}
    for s in SIGMAS:
        r = {m: [runs[(s, m, seed)] for seed in seeds] for m in MODES}
        tput = {m: [x["throughput_tokens_per_s"] for x in r[m]] for m in MODES}
        ratio = {b: [d / x for d, x in zip(tput["dora"], tput[b], strict=True)] for b in ("sync", "partial")}
        out["by_sigma"][str(s)] = {
            "runs": r,
            **{f"dora_over_{b}": {"by_seed": ratio[b], "median": statistics.median(ratio[b])} for b in ratio},
            "dora_mean_staleness": statistics.median(x["mean_staleness"] for x in r["dora"]),
            "dora_trainer_wait": {k: statistics.median(x["trainer_wait_fraction"][k] for x in r["dora"])
                                  for k in r["dora"][0]["trainer_wait_fraction"]},
        }
    med = [out["by_sigma"][str(s)]["dora_over_sync"]["median"] for s in SIGMAS]
    out["dora_over_sync_rises_with_sigma"] = all(a < b for a, b in zip(med, med[1:], strict=False))
    return out


def plot(path: Path, chunked: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(path.read_text())
    xs = d["sigmas"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for b, style in (("sync", "o-"), ("partial", "s--")):
        ys = [d["by_sigma"][str(s)][f"dora_over_{b}"]["median"] for s in xs]
        lo = [min(d["by_sigma"][str(s)][f"dora_over_{b}"]["by_seed"]) for s in xs]
        hi = [max(d["by_sigma"][str(s)][f"dora_over_{b}"]["by_seed"]) for s in xs]
        ax.plot(xs, ys, style, label=f"DORA / {b}" + (" (re-prefill blocking)" if b == "partial" and chunked else ""))
        ax.fill_between(xs, lo, hi, alpha=0.2)
    if chunked is not None:
        c = json.loads(chunked.read_text())
        ax.plot(xs, [c["by_sigma"][str(s)]["dora_over_partial"]["median"] for s in xs], "^:",
                label="DORA / partial (re-prefill chunked)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("response length sigma (lognormal, median 1,100, cap 64k)")
    ax.set_ylabel("tokens/s ratio (median of seeds; band: range)")
    ax.set_title("paper-64 at the defaults, steady state")
    ax.legend()
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def rerun(base: dict, mode: str, changes: dict) -> dict:
    """``mode`` again under ``changes``, beside the other modes' runs of the sweep ``base`` (same seeds)."""
    seeds = tuple(base["seeds"])
    runs = {(s, m, seed): r for s in SIGMAS for m in MODES if m != mode
            for seed, r in zip(seeds, base["by_sigma"][str(s)]["runs"][m], strict=True)}
    runs |= run_all(seeds, 2, (mode,), changes)
    return summarize(runs, seeds)


def main() -> None:
    if sys.argv[1:2] == ["--plot"]:
        print(plot(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None))
        return
    again = {"--reprefill": ("partial", {"sim.hardware.reprefill": "chunked"}, "sim.hardware.reprefill=chunked"),
             "--elastic": ("dora", {"cluster.elastic": True}, "cluster.elastic=true")}
    if sys.argv[1:2] and sys.argv[1] in again:
        mode, changes, label = again[sys.argv[1]]
        json.dump(rerun(json.loads(Path(sys.argv[2]).read_text()), mode, changes) | {mode: label}, sys.stdout, indent=2)
        print()
        return
    seeds = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (0, 1, 2)
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    json.dump(summarize(run_all(seeds, workers), seeds), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
