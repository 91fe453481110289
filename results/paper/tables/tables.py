"""Appendix C's Tables 1-3 and Fig. 14b from real-model runs (issue 33): reads ``dora-hpc analyze --json`` of a
DORA K=3 run and of a partial-rollout run and writes summary.json here (dora_hpc/analysis/tables.py computes
them), which tools/paper_report.py puts in results/paper/README.md.

    T=results/paper/tables
    .venv/bin/python $T/tables.py $T/analyze-dora-k3.json $T/analyze-partial.json 4 \
        rollout_bound=$T/rollout-bound/analyze-dora-k3-paced.json lean=$T/lean/analyze-dora-k3-lean.json \
        eager=$T/eager/analyze-dora-k3-eager.json  # 4: the runs' group size

Nothing here is a verdict: tools/paper_report.py judges each table from what this writes (each within-bin gap with
its standard error, the cells with too few responses, Table 3's claims as true or false).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dora_hpc.analysis.tables import dora_tables, fig14b, table3, table12

HERE = Path(__file__).resolve().parent
RUNS = ("rollout_bound", "lean", "eager")  # more DORA runs, by name: their tables go under that key


def main(dora_json: str, partial_json: str, group_size: str, *more: str) -> None:
    """``more``: NAME=ANALYSIS for further DORA K=3 runs (NAME one of RUNS): ``rollout_bound``, the run with
    rollout paced to be the bottleneck; ``lean``, under lean admission (staleness spread below K); ``eager``,
    the main run's setting run again (its analysis has the paper's Table 3 bins)."""
    dora = json.loads(Path(dora_json).read_text())["stratified"]
    partial = json.loads(Path(partial_json).read_text())["stratified"]
    g = int(group_size)
    summary = {"table1": table12(dora, g), "table2": table12(partial, g), "table3": table3(dora),
               "fig14b": fig14b(dora), "sources": [dora_json, partial_json],
               "staleness": {"dora": dora["naive"]["by_staleness"], "partial": partial["naive"]["by_staleness"]}}
    for arg in more:
        name, _, path = arg.partition("=")
        if name not in RUNS or not path:
            raise SystemExit(f"tables.py: {arg!r}: give NAME=ANALYSIS with NAME one of {', '.join(RUNS)}")
        summary[name] = dora_tables(path, g)
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {HERE / 'summary.json'}")


if __name__ == "__main__":
    main(*sys.argv[1:])
