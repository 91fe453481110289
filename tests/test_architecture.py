"""The architecture's rules, checked on the source: a policy (core/) owns what its mode means."""

import re
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.core.policies import MODES, POLICIES, build_policy, traits_of

PKG = Path(__file__).resolve().parent.parent / "dora_hpc"
NAMES = "|".join(MODES)
COMPARE = [re.compile(rf"mode\w*\s*(==|!=)\s*[\"']({NAMES})[\"']"),
           re.compile(rf"[\"']({NAMES})[\"']\s*(==|!=)\s*\w*mode"),
           re.compile(rf"mode\w*\s+(not\s+)?in\s*[(\[{{][^)\]}}]*[\"']({NAMES})[\"']"),
           re.compile(rf"\{{\s*[\"']({NAMES})[\"']\s*:[^}}]*\}}\s*\.get\(\s*\w*mode")]


def test_no_mode_name_is_compared_outside_core_and_config():
    """The shell asks the policy's traits (core/policy_base.py: Traits) instead of comparing mode names."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("core/") or rel == "config.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in COMPARE):
                found.append(f"dora_hpc/{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_checker_finds_what_it_forbids():
    bad = ['if cfg.mode != "partial":', 'rbs = b.tbs if mode in ("sync", "one_step") else b.rbs',
           'offload = mode == "dora" and x', 'bound = {"sync": 0, "dora": k}.get(mode)']
    assert all(any(p.search(b) for p in COMPARE) for b in bad)
    assert not any(p.search('if mode == "required":') for p in COMPARE)  # a resume mode, not a policy's


def test_traits_say_what_each_mode_means():
    t = {m: traits_of(m, 3) for m in MODES}
    assert [m for m in MODES if t[m].uses_rbs] == ["partial", "oversample", "dora"]
    assert {m: t[m].staleness_bound for m in MODES} == {"sync": 0, "one_step": 1, "partial": None,
                                                        "oversample": 0, "dora": 3}
    assert [m for m in MODES if not t[m].single_version] == ["partial"]
    assert [m for m in MODES if t[m].kv_offload] == ["dora"] and t["dora"].keep_versions == 5
    assert {m: t[m].placement for m in MODES} == {"sync": "colocated", "one_step": "disaggregated",
                                                  "partial": "colocated", "oversample": "colocated",
                                                  "dora": "disaggregated"}
    assert set(POLICIES) == set(MODES)


def test_build_policy_is_where_a_run_config_becomes_a_policy_config():
    cfg = load_config("configs/tiny-cpu.yaml", ["batch.tbs=4", "batch.rbs=6", "dora.k=3"])
    for mode in MODES:
        p = build_policy(cfg, 3, mode)
        assert p.name == mode and p.cfg.n_instances == 3 and p.cfg.tbs == 4 and p.cfg.k == 3
        assert p.cfg.rbs == (6 if traits_of(mode, 3).uses_rbs else 4)
    assert build_policy(cfg, 2).name == cfg.mode
