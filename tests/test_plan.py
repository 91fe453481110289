"""dora-hpc plan on a real local run: the simulator fitted to the run's own logs reproduces its measured
train-step interval within 15%, and the plan names a split, K and elastic setting for the next submission."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dora_hpc.cli"]


def test_plan_fits_a_real_run_and_recommends_the_next_split(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run(CLI + ["run", "configs/bench-modes.yaml", "--run-dir", str(run_dir)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run(CLI + ["plan", str(run_dir), "--out", str(tmp_path / "plan")], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((tmp_path / "plan" / "plan.json").read_text())
    check = result["fit_check"]
    assert check["within"] and abs(check["relative_error"]) <= 0.15, check
    assert f"{check['relative_error']:+.1%}" in p.stdout  # the fit-check figure is in the output
    assert "recommended: --set cluster.rollout_instances=" in p.stdout
    assert "the logged run's trainer waited: " in p.stdout and "; re-simulated: " in p.stdout  # Policy.train_wait
    assert 0 < sum(check["simulated_trainer_wait"].values()) < 1
    assert 0 < sum(check["measured_trainer_wait"].values()) < 1  # from the run's trainer_wait ops
    rates = [r["predicted_tokens_per_s"] for r in result["candidates"]]
    assert rates == sorted(rates, reverse=True) and len(rates) == result["n_candidates"] > 4
    fitted = result["fitted"]
    assert fitted["train_s_per_token"] > 0 and fitted["engine_step_s"] >= 0.02  # the config's paced step time
    assert 2 <= fitted["response_len"]["min"] <= fitted["response_len"]["max"] <= 160


def test_plan_of_something_that_is_no_run_exits_2(tmp_path):
    p = subprocess.run(CLI + ["plan", str(tmp_path / "nothing"), "--out", str(tmp_path / "plan")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "plan:" in p.stderr and "Traceback" not in p.stderr
