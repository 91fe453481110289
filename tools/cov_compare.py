"""Line coverage of two test runs (tools/coverage.sh's results/tests/coverage-NAME.json), compared.

  cov_compare.py OLD.json NEW.json            per file: lines OLD covers that NEW does not, and the points lost;
                                              exits 1 if a file loses more than --max-drop points (0.5)
    [--stable OLD2.json ...]                  OLD's lines: only those every one of these runs covers too (runs are
                                              timing-dependent: a second run of the same tests tells which lines)
  cov_compare.py --tier A.json B.json         "A covers X% of the lines B covers" (exits 1 under --min, if given)
  cov_compare.py --export RAW.json OUT.json   coverage.py's `json --show-contexts` report -> OUT.json (coverage.sh)
  cov_compare.py --subset RUN.json OUT.json   RUN as if only some of its tests had run, from each line's contexts
    (--keep IDS.txt | --drop PATTERN ...)     (import time counts as run): the tests IDS.txt lists (pytest node ids,
                                              one a line), or all but those whose id contains a PATTERN

Both runs must measure the same code: line numbers are compared as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

Lines = dict[str, set[int]]


def export(raw: dict) -> dict:
    """{"files": {file: {"covered": [line...], "statements": n, "percent": p}}, "total": {...},
    "tests": [context...], "contexts": {file: {line: [index into tests...]}}}"""
    files, contexts, tests, index = {}, {}, [], {}
    for name, f in sorted(raw["files"].items()):
        s = f["summary"]
        files[name] = {"covered": sorted(f["executed_lines"]), "statements": s["num_statements"],
                       "percent": round(s["percent_covered"], 2)}
        by_line = {}
        for line, names in sorted(f.get("contexts", {}).items(), key=lambda kv: int(kv[0])):
            by_line[line] = sorted({index.setdefault(n, len(index)) for n in names})
        if by_line:
            contexts[name] = by_line
    tests = sorted(index, key=index.get)
    t = raw["totals"]
    total = {"covered": t["covered_lines"], "statements": t["num_statements"],
             "percent": round(t["percent_covered"], 2)}
    return {"files": files, "total": total, "tests": tests, "contexts": contexts}


def subset(run: dict, keep) -> dict:
    """RUN with only the lines some kept test reached (``keep(node_id)``; import time, context "", is kept)."""
    tests = [t.split("|")[0] for t in run["tests"]]
    kept = {i for i, t in enumerate(tests) if t == "" or keep(t)}
    files = {}
    for name, f in run["files"].items():
        by_line = run["contexts"].get(name, {})
        lines = sorted(n for n in f["covered"] if kept.intersection(by_line.get(str(n), [])))
        files[name] = {**f, "covered": lines, "percent": round(100.0 * len(lines) / f["statements"], 2)
                       if f["statements"] else 100.0}
    n, total = sum(len(f["covered"]) for f in files.values()), run["total"]["statements"]
    return {**run, "files": files, "total": {"covered": n, "statements": total, "percent": round(100.0 * n / total, 2)}}


def covered(run: dict) -> Lines:
    return {name: set(f["covered"]) for name, f in run["files"].items()}


def compare(old: dict, new: dict, max_drop: float) -> list[str]:
    """Print every file with lines OLD covers and NEW does not; the files losing more than max_drop points."""
    flagged = []
    print(f"{'file':<52} {'lost':>5} {'old %':>7} {'new %':>7} {'points':>7}")
    for name, f in old["files"].items():
        g = new["files"].get(name, {"covered": [], "percent": 0.0})
        lost = sorted(set(f["covered"]) - set(g["covered"]))
        drop = f["percent"] - g["percent"]
        if lost or drop > 0:
            flag = drop > max_drop
            flagged += [name] if flag else []
            print(f"{name:<52} {len(lost):>5} {f['percent']:>7.2f} {g['percent']:>7.2f} {-drop:>+7.2f}"
                  f"{'  <-- over ' + str(max_drop) if flag else ''}")
            print(f"    lines: {spans(lost)}")
    o, n = old["total"], new["total"]
    print(f"total: {o['percent']:.2f}% -> {n['percent']:.2f}% ({n['percent'] - o['percent']:+.2f} points); "
          f"{len(flagged)} files lose more than {max_drop} points")
    return flagged


def stable(run: dict, others: list[dict]) -> dict:
    """RUN with only the lines every one of OTHERS covers too, and its percentages recomputed."""
    files = {}
    for name, f in run["files"].items():
        lines = set(f["covered"]).intersection(*(set(o["files"].get(name, {"covered": []})["covered"]) for o in others))
        files[name] = {**f, "covered": sorted(lines), "percent": round(100.0 * len(lines) / f["statements"], 2)
                       if f["statements"] else 100.0}
    n, total = sum(len(f["covered"]) for f in files.values()), run["total"]["statements"]
    return {**run, "files": files, "total": {"covered": n, "statements": total, "percent": round(100.0 * n / total, 2)}}


def tier(a: dict, b: dict) -> float:
    """The share (%) of the lines B covers that A covers too."""
    la, lb = covered(a), covered(b)
    want = sum(len(lines) for lines in lb.values())
    have = sum(len(lines & la.get(name, set())) for name, lines in lb.items())
    return 100.0 * have / want if want else 100.0


def spans(lines: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    out: list[list[int]] = []
    for n in lines:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", type=Path)
    p.add_argument("second", type=Path)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tier", action="store_true", help="FIRST covers what share of the lines SECOND covers")
    mode.add_argument("--export", action="store_true", help="FIRST: coverage.py's JSON report; SECOND: output")
    mode.add_argument("--subset", action="store_true", help="FIRST: a run; SECOND: output; with --keep or --drop")
    p.add_argument("--keep", type=Path, help="--subset: a file of the pytest node ids to keep")
    p.add_argument("--drop", nargs="+", default=[], help="--subset: drop the tests whose id contains one of these")
    p.add_argument("--max-drop", type=float, default=0.5, help="points a file may lose (default 0.5)")
    p.add_argument("--stable", type=Path, nargs="+", default=[], help="other runs of OLD's tests: see above")
    p.add_argument("--min", type=float, default=None, help="--tier: exit 1 under this share (%%)")
    args = p.parse_args(argv)
    first = json.loads(args.first.read_text())
    if args.export:
        run = export(first)
        args.second.write_text(json.dumps(run, separators=(",", ":")) + "\n")
        t = run["total"]
        print(f"{args.second}: {t['covered']}/{t['statements']} lines ({t['percent']:.2f}%) in {len(run['files'])} "
              f"files, {len(run['tests'])} contexts")
        return 0
    if args.subset:
        if args.keep:
            ids = set(args.keep.read_text().split())
            run = subset(first, lambda t: t in ids)
        else:
            run = subset(first, lambda t: not any(pat in t for pat in args.drop))
        args.second.write_text(json.dumps(run, separators=(",", ":")) + "\n")
        t = run["total"]
        print(f"{args.second}: {t['covered']}/{t['statements']} lines ({t['percent']:.2f}%)")
        return 0
    second = json.loads(args.second.read_text())
    if args.tier:
        share = tier(first, second)
        print(f"{args.first} covers {share:.2f}% of the lines {args.second} covers")
        return 1 if args.min is not None and share < args.min else 0
    if args.stable:
        first = stable(first, [json.loads(f.read_text()) for f in args.stable])
    return 1 if compare(first, second, args.max_drop) else 0


if __name__ == "__main__":
    sys.exit(main())
