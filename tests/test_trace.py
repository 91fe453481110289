"""``dora-hpc analyze --trace``: a run's logs as a Perfetto/Chrome trace (analysis/trace.py)."""

import json
import re
from collections import Counter

from dora_hpc.analysis.basic import analyze
from dora_hpc.config import load_config
from dora_hpc.sim.cluster import Simulator
from dora_hpc.store.shards import read_table


def check_trace(path, run_dir) -> Counter:
    """The Trace Event Format's rules Perfetto's JSON importer relies on, and the run's counts: every event
    placed and timed, slices with a duration, each async begin ended after it, every train step and trainer wait
    once. Returns the events by category."""
    events = json.loads(path.read_text())["traceEvents"]
    open_: dict = {}
    for e in events:
        assert {"ph", "pid", "name"} <= e.keys(), e
        if e["ph"] == "M":
            continue
        assert e["ts"] >= 0 and "tid" in e, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        elif e["ph"] == "b":
            open_[(e["cat"], e["id"])] = e["ts"]
        elif e["ph"] == "e":
            assert e["ts"] >= open_.pop((e["cat"], e["id"])), e
    assert not open_
    cats = Counter(e.get("cat") for e in events if e["ph"] in "Xbi")
    ops, steps = read_table(run_dir, "events", "ops"), read_table(run_dir, "train", "steps", ["step"])
    waits = sum(1 for k, a, b in zip(ops["kind"], ops["t_start"], ops["t_end"], strict=True)
                if k == "trainer_wait" and b > a)
    assert cats["train"] == len(steps["step"]) and cats["wait"] == waits
    assert cats["engine"] > 0 and all(re.fullmatch(r"v\d+", e["name"]) for e in events if e.get("cat") == "engine")
    return cats


def test_a_simulated_runs_trace_has_its_instances_steps_waits_and_gating_requests(tmp_path):
    cfg = load_config("configs/sim/small.yaml")
    sim = Simulator(cfg, "dora", timeline=False).run()
    sim.write_logs(tmp_path / "run")
    a = analyze(tmp_path / "run", trace=tmp_path / "trace.json")
    cats = check_trace(tmp_path / "trace.json", tmp_path / "run")
    assert a["trace"]["events"]["train"] == cfg.sim.steps
    held = a["window_gate"]["waits"] + (a["tail_gate"] or {"waits": 0})["waits"]
    assert 0 < cats["gating"] <= held  # one mark a wait whose gating requests finished inside it
    tids = {e["tid"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
            if e.get("cat") == "engine"}
    assert tids == {2 + i for i in range(len(sim.inst))}  # one track per rollout instance
    assert cats["op"] > 0  # weight loads and migrations beside the engine steps
