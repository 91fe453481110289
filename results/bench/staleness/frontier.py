"""The runtime's staleness frontier (configs/bench-modes.yaml): tokens/s against mean staleness of every
bench in this folder, one point a case (the median over its repeats). Writes frontier.json and frontier.png.

    .venv/bin/python results/bench/staleness/frontier.py
"""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def points() -> list[dict]:
    out = []
    for f in sorted([HERE / "modes-k2" / "summary.json", *HERE.glob("frontier/*/summary.json")]):
        d = json.loads(f.read_text())
        depth = next((s.split("=")[1] for s in d["sets"] if s.startswith("dora.depth=")), None)
        for case, m in d["modes"].items():
            label = case + (f" depth {depth}" if depth else "")
            runs = m["runs"]
            out.append({"label": label, "bench": f.parent.name, "repeats": len(runs),
                        "throughput_tokens_per_s": statistics.median(r["throughput_tokens_per_s"] for r in runs),
                        "mean_staleness": statistics.median(r["mean_staleness"] for r in runs),
                        "slot_utilization": statistics.median(r["slot_utilization"] for r in runs)})
    return out


def main() -> None:
    pts = points()
    (HERE / "frontier.json").write_text(json.dumps(pts, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for p in pts:
        lean, dora = "lean" in p["label"], "dora" in p["label"]
        ax.plot(p["mean_staleness"], p["throughput_tokens_per_s"], "o" if lean else "s" if dora else "x",
                color="tab:green" if lean else "tab:blue" if dora else "black", ms=7)
        ax.annotate(p["label"], (p["mean_staleness"], p["throughput_tokens_per_s"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=7)
    ax.set_xlabel("mean staleness of trained groups (steps, the whole 12-step run)")
    ax.set_ylabel("trained tokens/s (2-core CPU, paced engine)")
    ax.set_title("runtime frontier, configs/bench-modes.yaml (green: lean, blue: eager)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "frontier.png", dpi=120)
    for p in pts:
        print(f"| {p['label']} | {p['repeats']} | {p['throughput_tokens_per_s']:,.0f} | {p['mean_staleness']:.2f} | "
              f"{p['slot_utilization']:.3f} |")


if __name__ == "__main__":
    main()
