"""``dora-hpc bench modes|convergence`` end to end on short real runs (the full benchmarks are in results/)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dora_hpc.cli"]
SHORT = ["--set", "train.max_steps=3", "--set", "cluster.rollout_instances=2", "--set", "batch.tbs=4",
         "--set", "batch.rbs=6"]
KEYS = {"throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "slot_utilization",
        "bubble_fraction", "max_staleness", "reprefill_tokens", "migrations", "overheads",
        "engine_steps_per_trained_token", "slot_utilization_limit", "runs"}


def bench(*args, timeout=600):
    return subprocess.run(CLI + ["bench", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_bench_modes_runs_real_runs_and_summarises_them(tmp_path):
    out = tmp_path / "modes"
    p = bench("modes", "configs/tiny-cpu.yaml", "--out", str(out), "--modes", "sync,dora-k1", "--repeats", "1",
              "--no-unpaced", *SHORT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert set(s["modes"]) == {"sync", "dora-k1"}
    for name, m in s["modes"].items():
        assert KEYS <= set(m), name
        assert m["throughput_tokens_per_s"] > 0 and 0 < m["slot_utilization"] <= 1
        assert m["engine_steps_per_trained_token"] > 0 and len(m["runs"]) == 1
    assert s["modes"]["sync"]["max_staleness"] == 0 and s["modes"]["sync"]["migrations"] == 0
    assert s["modes"]["dora-k1"]["max_staleness"] <= 1
    assert s["ratios"]["dora-k1/sync"] > 0 and (out / "modes.png").stat().st_size > 10_000
    assert (out / "runs" / "sync-r0" / "launch.json").exists()
    again = bench("modes", "configs/tiny-cpu.yaml", "--out", str(out), "--modes", "sync", "--repeats", "1",
                  "--no-unpaced", *SHORT)
    assert again.returncode == 1 and "earlier benchmark" in again.stderr  # never mixes two benchmarks' runs


@pytest.mark.slow
def test_bench_agent_gateway_times_the_same_episodes_through_the_endpoint_and_an_environment(tmp_path):
    out = tmp_path / "gw"
    p = bench("agent-gateway", "--episodes", "2", "--turns", "3", "--repeats", "1", "--out", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    for case in ("env", "agent"):
        run, = s["runs"][case]
        assert run["episodes"] == 2 and run["turns"] == 6 and run["errors"] == []
        assert run["gap_ms"]["n"] == 4 and run["turns_per_s"] > 0  # two gaps an episode: between its 3 turns
    assert s["runs"]["agent"][0]["first_ms"]["n"] == 2 and (out / "agent-gateway.png").exists()
    assert bench("agent-gateway", "--turns", "1", "--out", str(tmp_path / "x")).returncode == 2


def test_bench_rejects_a_bad_mode_or_missing_config_before_running_anything(tmp_path):
    p = bench("modes", "configs/tiny-cpu.yaml", "--out", str(tmp_path / "x"), "--modes", "sync,dora-k9")
    assert p.returncode == 2 and "dora-k9" in p.stderr and not (tmp_path / "x").exists()
    p = bench("ablation", "--out", str(tmp_path / "y"))
    assert p.returncode == 2 and "CONFIG is required" in p.stderr
    p = bench("ablation", "configs/tiny-cpu.yaml", "--ablation", "nope", "--out", str(tmp_path / "z"))
    assert p.returncode == 2 and "nope" in p.stderr and not (tmp_path / "z").exists()
    p = bench("ablation", "configs/tiny-cpu.yaml", "--run-timeout", "0", "--out", str(tmp_path / "u"))
    assert p.returncode == 2 and "--run-timeout" in p.stderr and not (tmp_path / "u").exists()
    p = bench("convergence", "configs/tiny-cpu.yaml", "--losses", "ppo_clip,adam", "--out", str(tmp_path / "w"))
    assert p.returncode == 2 and "adam" in p.stderr and not (tmp_path / "w").exists()
    p = bench("convergence", "configs/tiny-cpu.yaml", "--cases", "dora-k2", "--out", str(tmp_path / "v"))
    assert p.returncode == 2 and "sync" in p.stderr and not (tmp_path / "v").exists()


def test_a_set_that_a_case_or_loss_would_override_is_refused_naming_both(tmp_path):
    """The cases' own KEY=VALUEs come after the user's --set, so a --set of the same key would silently
    lose: it is refused (exit 2, one line) before anything runs."""
    p = bench("convergence", "configs/bench-convergence.yaml", "--set", "train.policy_loss=decoupled",
              "--set", "train.is_correction=truncate", "--out", str(tmp_path / "c"))
    assert p.returncode == 2 and not (tmp_path / "c").exists()
    assert "--set train.policy_loss=decoupled" in p.stderr and "--losses ppo_clip" in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    p = bench("convergence", "configs/bench-convergence.yaml", "--cases", "sync,dora-k2", "--set", "dora.k=4",
              "--out", str(tmp_path / "c"))
    assert p.returncode == 2 and "--cases dora-k2 sets dora.k" in p.stderr, p.stderr
    p = bench("modes", "configs/tiny-cpu.yaml", "--modes", "sync,dora-k1", "--set", "mode=partial",
              "--out", str(tmp_path / "m"))
    assert p.returncode == 2 and "--set mode=partial: --modes sync sets mode" in p.stderr, p.stderr
    p = bench("modes", "configs/tiny-cpu.yaml", "--set", "engine.pacing=false", "--out", str(tmp_path / "m"))
    assert p.returncode == 2 and "the paced pass sets engine.pacing" in p.stderr, p.stderr
    p = bench("ablation", "configs/tiny-cpu.yaml", "--set", "dora.kv_migration=false", "--out", str(tmp_path / "a"))
    assert p.returncode == 2 and "--ablation kv-migration" in p.stderr and not (tmp_path / "a").exists()
    from dora_hpc.bench.convergence_bench import cases
    from dora_hpc.bench.modes_bench import refuse_overridden

    refuse_overridden(["train.lr=1e-3", "dora.k=9"], {"--losses ppo_clip": (cases(["ppo_clip"], ["sync"])["sync"], "")})


def test_convergence_cases_run_every_mode_under_every_loss():
    from dora_hpc.bench.convergence_bench import cases

    assert list(cases(["ppo_clip"])) == ["sync", "dora-k1", "dora-k3"]
    both = cases(["ppo_clip", "decoupled+truncate"])
    assert list(both)[3:] == ["sync decoupled+truncate", "dora-k1 decoupled+truncate", "dora-k3 decoupled+truncate"]
    assert both["dora-k3 decoupled+truncate"] == ["train.policy_loss=decoupled", "train.is_correction=truncate",
                                                  "mode=dora", "dora.k=3"]
    assert list(cases(["ppo_clip"], ["dora-k2", "sync"])) == ["sync", "dora-k2"]  # sync first: the baseline


def test_reach_is_the_first_step_whose_three_step_mean_gets_there():
    from dora_hpc.bench.convergence_bench import reach

    assert reach([0.1, 0.5, 0.9, 1.0, 1.0], [1, 2, 3, 4, 5], 0.8) == {"step": 4, "t": 5}
    assert reach([0.9, 0.9, 0.9], [1, 2, 3], 0.9) == {"step": 2, "t": 3}
    assert reach([0.1, 0.2, 0.3], [1, 2, 3], 0.9) is None


@pytest.mark.slow
def test_bench_convergence_reads_reward_curves_from_the_logs_and_scores_held_out_prompts(tmp_path):
    out = tmp_path / "conv"
    p = bench("convergence", "configs/tiny-cpu.yaml", "--out", str(out), "--seeds", "0", "--cases", "sync,dora-k2",
              "--eval", "6", *SHORT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert set(s["cases"]) == {"sync", "dora-k2"}
    for c in s["cases"].values():
        assert len(c["curves"]["0"]) == 3 and all(0 <= r <= 1 for r in c["curves"]["0"])
    assert set(s["verdict"]) == {"dora-k2"} and (out / "convergence.png").exists()
    assert s["cases"]["sync"]["reach"]["reward"] == 0.95 * s["cases"]["sync"]["final"]
    # held-out: the initial model once, each run's final checkpoint (step 3), on 6 prompts training never drew
    initial = json.loads((out / "runs" / "initial-s0.eval.json").read_text())
    final = json.loads((out / "runs" / "dora-k2-s0.eval.json").read_text())
    assert initial["step"] == 0 and final["step"] == 3 and initial["n"] == final["n"] == 6
    assert s["cases"]["dora-k2"]["heldout_final_by_seed"]["0"] == final["greedy"]["mean_reward"]
    v = s["heldout"]["verdict"]["dora-k2"]
    assert v["gain_over_initial_by_seed"]["0"] == final["greedy"]["mean_reward"] - initial["greedy"]["mean_reward"]
    assert "held-out greedy mean reward" in p.stdout


def test_a_run_past_run_timeout_fails_the_bench_naming_its_log_and_leaves_no_rank_running(tmp_path):
    out = tmp_path / "t"
    p = bench("ablation", "configs/tiny-cpu.yaml", "--repeats", "1", "--run-timeout", "6", "--out", str(out),
              "--set", "train.max_steps=200", timeout=120)
    assert p.returncode == 1 and "--run-timeout" in p.stderr and "kv-migration-r0.log" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the timed-out run still alive: {left}"
