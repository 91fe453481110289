"""The README's summary table, from the committed frontier.json files. ``--steady`` rewrites a frontier made
before the frontier reported the steady-state mean staleness (its points' mean was over every step, the
fill included): each point's and run's mean becomes the steady one from the run's histogram, the old one
is kept as mean_staleness_all_steps, and frontier.md and .png are drawn again.

    .venv/bin/python results/sim/staleness/summarize.py [--steady DIR ...]
"""

import json
import statistics
import sys
from pathlib import Path

from dora_hpc.sim.frontier import markdown_table, plot

HERE = Path(__file__).parent


def histogram_mean(h: dict[str, int]) -> float:
    return sum(int(k) * n for k, n in h.items()) / sum(h.values())


def steady(point: dict) -> float:
    """The median over seeds of the steady-state mean staleness (each run's histogram of the steps started
    in the measured window; runs before the frontier reported it as its mean)."""
    return statistics.median(histogram_mean(r["staleness_histogram"]) for r in point["runs"])


def rewrite_steady(folder: Path) -> None:
    d = json.loads((folder / "frontier.json").read_text())
    for p in d["points"]:
        for r in p["runs"]:
            if "mean_staleness_all_steps" not in r:
                r["mean_staleness_all_steps"] = r["mean_staleness"]
                r["mean_staleness"] = histogram_mean(r["staleness_histogram"])
        p["mean_staleness"] = statistics.median(r["mean_staleness"] for r in p["runs"])
    (folder / "frontier.json").write_text(json.dumps(d, indent=2) + "\n")
    (folder / "frontier.md").write_text(markdown_table(d["points"]))
    plot(d["points"], f"{d['config']}: seeds {','.join(map(str, d['seeds']))}", folder / "frontier.png")


def main() -> None:
    print("| workload (K) | eager tokens/s, mean staleness | lean tokens/s, mean staleness | lean / eager | "
          "learned depth | best fixed depth within 2% of eager | partial, mean staleness | lean / partial |")
    print("|---|---|---|---:|---:|---|---|---:|")
    for f in sorted(HERE.glob("*/frontier.json")):
        d = json.loads(f.read_text())
        pts = {p["label"]: p for p in d["points"]}
        k = max(p["k"] for p in d["points"] if p["k"] is not None and "legacy" in p["label"])
        eager, lean, partial = pts[f"K={k} eager"], pts[f"K={k} lean"], pts["partial"]
        ok = [p for p in d["points"] if p["k"] == k and "depth" in p["label"]
              and p["throughput_tokens_per_s"] >= 0.98 * eager["throughput_tokens_per_s"]]
        best = min(ok, key=steady) if ok else None
        depth = statistics.median(r["learned_depth"] for r in lean["runs"])
        print(f"| {f.parent.name} (K={k}) | {eager['throughput_tokens_per_s']:,.0f}, {steady(eager):.2f} | "
              f"{lean['throughput_tokens_per_s']:,.0f}, {steady(lean):.2f} | "
              f"{lean['throughput_tokens_per_s'] / eager['throughput_tokens_per_s']:.1%} | {depth:.2f} | "
              + (f"{best['label'].split()[-1]}: {steady(best):.2f}" if best else "none") + " | "
              f"{partial['throughput_tokens_per_s']:,.0f}, {steady(partial):.2f} | "
              f"{lean['throughput_tokens_per_s'] / partial['throughput_tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--steady"]:
        for folder in sys.argv[2:]:
            rewrite_steady(Path(folder))
    main()
