"""tools/paper_report.py: every verdict is computed from a comparison of committed data, in one place."""

import ast
import copy
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORDS = ("reproduced", "differs", "agrees", "inconclusive", "consistent", "not yet measured", "not measurable",
         "ours only", "not comparable", "shown, not judged")


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
    assert "91% at 128 outside the range" in _row(report, c3)["verdict"]

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

    def near(s):  # 0.04 +- 2.015 x 0.008: the 90% interval straddles the 0.05 margin
        s["verdict"]["dora-k3-eager ppo_clip"] |= {"gap_to_sync": -0.04}
        return s
    report.edit("results/bench/staleness/learning/summary.json", near)
    assert _row(report, item)["verdict"].startswith("inconclusive: 90% interval [-0.056, -0.024]")


def test_equivalence_is_two_one_sided_tests_against_the_margin(report):
    """More seeds make equivalence easier to show, never harder (a failure-to-reject test did the reverse)."""
    assert report.equivalent(0.0, 0.02, 4, 0.05) is True       # 2.132 x 0.02 = 0.043 inside 0.05
    assert report.equivalent(0.0, 0.03, 4, 0.05) is None       # too noisy to decide
    assert report.equivalent(0.2, 0.03, 4, 0.05) is False      # shown past the margin
    assert report.equivalent(0.03, 0.01, 9, 0.05) is True      # a gap 3 se from 0 is still equivalent
    assert report.equivalent(0.03, 0.01, 4, 0.05) is None      # ... but on 5 seeds it cannot be shown


def test_absolute_figures_diagnostics_and_small_denominators_are_shown_not_judged(report):
    assert _row(report, "DORA throughput, 64 GPUs")["verdict"].startswith("not comparable")
    assert _row(report, "DORA / partial rollout throughput, 64 GPUs, both on DORA's split")["verdict"].startswith(
        "shown, not judged: a diagnostic the paper never ran")
    item = "rollout-only time, sync / DORA, 64 GPUs"
    assert not _row(report, item)["verdict"].startswith("shown")

    def tiny(s):
        s["modes"]["dora"]["rollout_only_fraction"] = 0.005
        return s
    report.edit("results/sim/paper-64/summary.json", tiny)
    assert _row(report, item)["verdict"].startswith("shown, not judged: the denominator is 0.50% of a step")


def test_a_median_that_misses_with_seeds_across_the_papers_figure_is_inconclusive(report):
    item = "KV-reuse ablation: rollout-only time a step, re-prefill / KV, paper-64"

    def seeds(ratios):
        def edit(s):
            runs = s["scenarios"]["paper-64"]["runs"]
            for r, x in zip(runs.values(), ratios, strict=True):
                r["kv"] |= {"rollout_only_fraction": 0.1, "mean_step_time_s": 100.0}
                r["reprefill"] |= {"rollout_only_fraction": 0.1 * x, "mean_step_time_s": 100.0}
            return s
        return edit
    report.edit("results/sim/kv-ablation/summary.json", seeds([1.05, 1.07, 1.2]))
    assert _row(report, item)["verdict"].startswith("inconclusive: its 3 seeds span 1.050-1.200")
    report.edit("results/sim/kv-ablation/summary.json", seeds([1.03, 1.04, 1.06]))
    assert _row(report, item)["verdict"].startswith("differs")
    report.edit("results/sim/kv-ablation/summary.json", seeds([1.08, 1.1, 1.2]))
    assert _row(report, item)["verdict"] == "reproduced"
