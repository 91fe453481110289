"""The README's summary table, from the committed frontier.json files (and targets*.json where present).

    .venv/bin/python results/sim/staleness/summarize.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


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
        best = min(ok, key=lambda p: p["mean_staleness"]) if ok else None
        depth = statistics.median(r["learned_depth"] for r in lean["runs"])
        print(f"| {f.parent.name} (K={k}) | {eager['throughput_tokens_per_s']:,.0f}, {eager['mean_staleness']:.2f} | "
              f"{lean['throughput_tokens_per_s']:,.0f}, {lean['mean_staleness']:.2f} | "
              f"{lean['throughput_tokens_per_s'] / eager['throughput_tokens_per_s']:.1%} | {depth:.2f} | "
              + (f"{best['label'].split()[-1]}: {best['mean_staleness']:.2f}" if best else "none") + " | "
              f"{partial['throughput_tokens_per_s']:,.0f}, {partial['mean_staleness']:.2f} | "
              f"{lean['throughput_tokens_per_s'] / partial['throughput_tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
