"""tools/paper_report.py: every verdict is computed from a comparison of committed data, in one place."""

import ast
import copy
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORDS = ("reproduced", "differs", "agrees", "inconclusive", "consistent", "not yet measured", "not measurable",
         "ours only")


@pytest.fixture
def report(monkeypatch):
    """The report module, with ``edit(path, change)`` to alter what one committed summary holds."""
    spec = importlib.util.spec_from_file_location("paper_report", REPO / "tools" / "paper_report.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "paper_report", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    edits = {}
    real = mod.load

    def load(path):
        data = real(path)
        return edits[path](copy.deepcopy(data)) if path in edits and data is not None else data

    monkeypatch.setattr(mod, "load", load)
    mod.edit = edits.__setitem__
    return mod


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_verdict_is_written_outside_judge():
    """A verdict word appears as a string only in ``judge`` (tools/paper_report.py) and nowhere in the tables'
    script, which writes comparisons, not verdicts."""
    tree = ast.parse((REPO / "tools" / "paper_report.py").read_text())
    judge = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "judge")
    inside = set(map(id, ast.walk(judge)))
    outside = [s for n in ast.walk(tree) if id(n) not in inside and isinstance(n, ast.Constant)
               and isinstance(s := n.value, str) and s.lstrip().lower().startswith(WORDS)]
    outside = [s for s in outside if s not in (judge.body[0].value.value,)]
    assert outside == [], outside
    tables = _strings(ast.parse((REPO / "results" / "paper" / "tables" / "tables.py").read_text()))
    assert not [s for s in tables if s.lstrip().lower().startswith(WORDS)]


def test_every_row_takes_its_verdict_from_judge_on_a_computed_outcome():
    """Structurally: each Row(...) gets its verdict (the 7th field) from a judge(...) call whose outcome is not a
    literal True or False."""
    tree = ast.parse((REPO / "tools" / "paper_report.py").read_text())
    rows = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Row"]
    assert len(rows) > 15
    for call in rows:
        verdict = call.args[6] if len(call.args) > 6 else next(k.value for k in call.keywords if k.arg == "verdict")
        assert isinstance(verdict, ast.Call) and verdict.func.id == "judge", ast.unparse(call)[:200]
        outcome = verdict.args[0] if verdict.args else None
        assert not (isinstance(outcome, ast.Constant) and isinstance(outcome.value, bool)), ast.unparse(verdict)


def _row(report, item: str):
    text, summary = report.report()
    rows = [r for rows in summary.values() for r in rows if r["item"].startswith(item)]
    assert len(rows) == 1, item
    return rows[0]


def test_every_row_says_whether_it_is_like_for_like_and_has_a_verdict_from_judge(report):
    _, summary = report.report()
    rows = [r for rows in summary.values() for r in rows]
    assert len(rows) > 40
    for r in rows:
        assert r["like"] and r["verdict"].startswith(WORDS), r


def test_verdicts_follow_the_data(report):
    """Change a committed figure and the verdict follows: each kind of comparison, once each way."""
    item = "sync rollout-only share of a step, 64 GPUs"
    assert _row(report, item)["verdict"] == "reproduced"  # 64% against 65%

    def share(s):
        s["modes"]["sync"]["rollout_only_fraction"] = 0.3
        return s
    report.edit("results/sim/paper-64/summary.json", share)
    assert _row(report, item)["verdict"].startswith("differs")
    free = "overhead, 128 GPUs: free-cache"
    assert _row(report, free)["verdict"].startswith("agrees")  # 0.02% against < 0.03%
    report.edit("results/sim/paper-128/summary.json",
                lambda s: s | {"modes": s["modes"] | {"dora": s["modes"]["dora"] | {
                    "overheads": s["modes"]["dora"]["overheads"] | {"offload": 0.01}}}})
    assert _row(report, free)["verdict"].startswith("differs")


def test_the_c3_verdict_names_the_scale_that_falls_outside_the_range(report):
    c3 = "C.3: sync long-tail bubble"
    assert "90% at 128 outside the range" in _row(report, c3)["verdict"]

    def shift(s):
        s["modes"]["sync"]["bubble_fraction"] = 0.5
        return s
    report.edit("results/sim/paper-64/summary.json", shift)
    verdict = _row(report, c3)["verdict"]
    assert verdict.startswith("differs") and "50% at 64 outside the range" in verdict


def test_a_reward_claim_needs_five_seeds_and_is_two_sided(report):
    item = "convergence: DORA K=3 vs sync under ppo_clip"
    assert _row(report, item)["verdict"].startswith("differs")  # -0.146, paired se 0.008, 6 seeds

    def small(s):
        s["verdict"]["dora-k3-eager ppo_clip"] |= {"gap_to_sync": 0.01}
        return s
    report.edit("results/bench/staleness/learning/summary.json", small)
    assert _row(report, item)["verdict"] == "reproduced"
    report.edit("results/bench/staleness/learning/summary.json",
                lambda s: small(s) | {"seeds": s["seeds"][:3]})
    assert _row(report, item)["verdict"].startswith("inconclusive")
