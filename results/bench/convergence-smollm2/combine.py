"""Seeds 0-3 together, from the two benchmark runs' summary.json (seeds 0,1 here; seeds 2,3 in s23/).

    python results/bench/convergence-smollm2/combine.py results/bench/convergence-smollm2 \
        results/bench/convergence-smollm2/s23 > results/bench/convergence-smollm2/combined.json
"""

import json
import statistics
import sys
from pathlib import Path


def per_seed(summaries: list[dict], case: str) -> dict[str, dict]:
    out = {}
    for s in summaries:
        c = s["cases"][case]
        for i, seed in enumerate(s["seeds"]):
            k = str(seed)
            out[k] = {"heldout": c["heldout_final_by_seed"][k], "train_final": c["final_by_seed"][i],
                      "seconds": c["times"][k][-1], "reach": c["reach"]["by_seed"][k],
                      "initial": s["heldout"]["initial_by_seed"][k]}
    return out


def main(dirs: list[str]) -> dict:
    summaries = [json.loads((Path(d) / "summary.json").read_text()) for d in dirs]
    out = {}
    for case in ("sync", "dora-k2"):
        seeds = per_seed(summaries, case)
        held = [v["heldout"] for v in seeds.values()]
        train = [v["train_final"] for v in seeds.values()]
        out[case] = {"by_seed": seeds, "heldout_mean": statistics.fmean(held), "heldout_sd": statistics.stdev(held),
                     "train_final_mean": statistics.fmean(train), "train_final_sd": statistics.stdev(train),
                     "seconds_median": statistics.median(v["seconds"] for v in seeds.values())}
    s, d = out["sync"], out["dora-k2"]
    out["dora_minus_sync"] = {"heldout": d["heldout_mean"] - s["heldout_mean"],
                              "train_final": d["train_final_mean"] - s["train_final_mean"],
                              "time_ratio": d["seconds_median"] / s["seconds_median"]}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))
