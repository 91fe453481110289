"""The architecture's rules, checked on the source: a policy (core/) owns what its mode means."""

import re
from pathlib import Path

from dora_hpc.config import load_config
from dora_hpc.core.policies import MODES, POLICIES, make_policy, traits_of

PKG = Path(__file__).resolve().parent.parent / "dora_hpc"
NAMES = "|".join(MODES)
COMPARE = [re.compile(rf"mode\w*\s*(==|!=)\s*[\"']({NAMES})[\"']"),
           re.compile(rf"[\"']({NAMES})[\"']\s*(==|!=)\s*\w*mode"),
           re.compile(rf"mode\w*\s+(not\s+)?in\s*[(\[{{][^)\]}}]*[\"']({NAMES})[\"']"),
           re.compile(rf"\{{\s*[\"']({NAMES})[\"']\s*:[^}}]*\}}\s*\.get\(\s*\w*mode")]


def test_no_mode_name_is_compared_outside_core():
    """The shell asks the policy's traits (core/policy_base.py: Traits) instead of comparing mode names."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("core/"):
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
        p = make_policy(cfg, 3, mode)
        assert p.name == mode and p.cfg.n_instances == 3 and p.cfg.tbs == 4 and p.cfg.k == 3
        assert p.cfg.rbs == (6 if traits_of(mode, 3).uses_rbs else 4)
    assert make_policy(cfg, 2).name == cfg.mode


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in it (a lazy import inside a function counts)."""
    import ast

    def name(p: Path) -> str:
        parts = list(p.with_suffix("").relative_to(PKG.parent).parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    mods = {name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                comp.append(w := stack.pop())
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert "dora_hpc.train.backend" in graph["dora_hpc.train.fsdp"]  # the walker sees relative imports
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_measurement_layer_sits_below_the_drivers_and_reporting():
    """measure/ imports nothing above it, and no module of sim/ or train/ imports analysis/ (reporting)."""
    graph = import_graph()
    above = ("dora_hpc.analysis", "dora_hpc.sim", "dora_hpc.runtime", "dora_hpc.train", "dora_hpc.bench")
    up = [(m, d) for m, deps in graph.items() if m.startswith("dora_hpc.measure") for d in deps if d.startswith(above)]
    assert up == [], up
    into = [(m, d) for m, deps in graph.items() if m.startswith(("dora_hpc.sim", "dora_hpc.train"))
            for d in deps if d.startswith("dora_hpc.analysis")]
    assert into == [], into


def test_no_function_over_60_lines():
    import ast

    long = [f"{p.relative_to(PKG).as_posix()}:{n.name} ({n.end_lineno - n.lineno + 1})"
            for p in PKG.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_the_launcher_and_rank_0_import_neither_torch_nor_transformers():
    """Each costs seconds of CPU at every start (5 ranks share 2 cores here). The launcher reads the model's
    shape from config.json (engine/spec.py); rank 0 (the orchestrator) touches torch only to verify a
    checkpoint on resume; only the trainers import transformers."""
    import subprocess
    import sys

    code = ("import sys; import dora_hpc.cli, dora_hpc.launch.local, dora_hpc.runtime.main, "
            "dora_hpc.runtime.orchestrator, dora_hpc.data.tasks, dora_hpc.engine.spec, dora_hpc.engine.local_models; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr[-2000:]
