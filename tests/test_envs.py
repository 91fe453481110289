"""The built-in environments of multi-turn episodes, driven as the rollout will drive them: init, then a
step per model turn until done (dora_hpc/envs/)."""

from pathlib import Path

import pytest

from dora_hpc.envs import EnvArgError, make_env
from dora_hpc.envs.sandbox import SandboxError


def right_if_42(text: str) -> float:
    return 1.0 if "42" in text else 0.0


PROMPT = [{"role": "user", "content": "What is 6 * 7?"}]


def play(env, actions):
    """The episode's steps for the model turns ``actions`` (until one ends it); skipped where the sandbox
    cannot run tool code (no network namespace)."""
    messages, _ = env.init(PROMPT)
    assert messages == PROMPT
    out = []
    for a in actions:
        try:
            out.append(env.step(a))
        except SandboxError as e:
            pytest.skip(str(e))
        if out[-1]["done"]:
            break
    return out


@pytest.mark.parametrize("actions,turns,reward", [
    (["42"], 1, 1.0),                            # right at once: the whole score
    (["41", "40", "42"], 3, 1 / 3),              # right at the last of 3 attempts: a third of it
    (["41", "42", "0"], 2, 2 / 3),
    (["1", "2", "3"], 3, 0.0),                   # never right: done after max_turns, nothing
])
def test_retry_gives_feedback_and_rewards_the_attempt_that_got_it_right(actions, turns, reward):
    steps = play(make_env("retry", right_if_42, max_turns=3, timeout_s=5), actions)
    assert len(steps) == turns and steps[-1]["done"] and steps[-1]["reward"] == pytest.approx(reward)
    assert all(s["observations"] == [{"role": "user", "content": "That is not right. Try again."}] and
               s["reward"] == 0.0 and not s["done"] for s in steps[:-1])
    assert steps[-1]["observations"] == [] and steps[-1]["metadata"]["attempt"] == turns


def test_python_tool_runs_the_code_block_and_scores_the_final_answer():
    env = make_env("python_tool", right_if_42, max_turns=3, timeout_s=5)
    first, last = play(env, ["Let me compute.\n```python\nprint(6 * 7)\n```", "The answer is 42."])
    assert not first["done"] and first["reward"] == 0.0 and first["metadata"]["ran_code"]
    assert first["observations"] == [{"role": "user", "content": "Output (exit 0):\n42\n"}]
    assert last["done"] and last["reward"] == 1.0 and not last["metadata"]["ran_code"]


def test_python_tool_reports_a_timeout_and_its_last_turn_is_the_answer():
    env = make_env("python_tool", right_if_42, max_turns=2, timeout_s=1)
    first, last = play(env, ["```python\nwhile True: pass\n```", "```python\nprint(42)\n```"])
    assert first["observations"][0]["content"].startswith("Output (timed out):") and first["metadata"]["timed_out"]
    assert last["done"] and last["reward"] == 1.0  # the last turn is scored as it stands, its code not run


def test_an_unknown_environment_or_argument_names_the_key():
    with pytest.raises(EnvArgError, match="env.name: unknown environment 'chess'"):
        make_env("chess", right_if_42, max_turns=2, timeout_s=1)
    with pytest.raises(EnvArgError, match="env.args: retry .*'hint'"):
        make_env("retry", right_if_42, max_turns=2, timeout_s=1, args={"hint": "x"})
    with pytest.raises(EnvArgError, match="env.max_turns: 0"):
        make_env("retry", right_if_42, max_turns=0, timeout_s=1)
    with pytest.raises(EnvArgError, match="env.args: retry needs latency_s"):
        make_env("retry", right_if_42, max_turns=2, timeout_s=1, args={"latency_s": -1.0})


def test_a_step_latency_waits_as_drawn_and_as_long_again_when_the_step_is_re_run(monkeypatch):
    from dora_hpc.envs import builtin

    slept = []
    monkeypatch.setattr(builtin.time, "sleep", slept.append)

    def wait_of(action):
        env = make_env("retry", right_if_42, max_turns=3, timeout_s=5,
                       args={"latency_s": 2.0, "latency_sigma": 1.0, "latency_max_s": 10.0})
        env.step(action)
        return slept[-1]

    waits = {a: wait_of(a) for a in map(str, range(40))}
    assert 0 < min(waits.values()) and max(waits.values()) == 10.0  # drawn; the tail capped
    assert 1.0 < sorted(waits.values())[20] < 4.0  # about the median
    assert all(wait_of(a) == w for a, w in waits.items())  # a function of the turn and the action
    n = len(slept)
    make_env("retry", right_if_42, max_turns=3, timeout_s=5).step("1")
    assert len(slept) == n  # no latency unless asked for


# -- the worker pool that runs environment steps off the rollout rank's loop ------------------------------
def _pool(tmp_path, task="even_tokens", workers=1, timeout_s=5.0, **cfg):
    import os

    from dora_hpc.config import load_config
    from dora_hpc.engine.local_models import build_tiny_model
    from dora_hpc.envs.pool import EnvPool

    os.environ["PYTHONPATH"] = str(Path(__file__).parent)  # the workers import faulty_env
    model = build_tiny_model()
    c = load_config(None, [f"task.name={task}", *[f"{k}={v}" for k, v in cfg.items()]])
    return EnvPool(workers, timeout_s, {"cfg_json": c.model_dump_json(), "vocab_size": 512,
                                        "model_dir": str(model)})


def _results(pool, n, limit_s=60.0):
    import time

    out, t = [], time.monotonic()
    while len(out) < n and time.monotonic() - t < limit_s:
        out += pool.poll(0.05)
    return {r.job: r for r in out}


def test_the_pool_runs_steps_in_workers_and_survives_environments_that_raise_hang_or_die(tmp_path):
    from faulty_env import FaultyEnv

    from dora_hpc.envs import Scorer

    pool = _pool(tmp_path, workers=2, timeout_s=2.0)
    try:
        envs = {g: FaultyEnv(Scorer(g), max_turns=3, timeout_s=2.0) for g in (0, 1, 2, 3)}
        for env in envs.values():
            env.turn = 1  # the second step: where FaultyEnv fails (group % 8 = 1 raises, 2 hangs, 3 dies)
        jobs = {g: pool.submit(env, "2 4 6 7") for g, env in envs.items()}
        dropped = pool.submit(envs[0], "8 8")
        pool.cancel(dropped)
        got = _results(pool, 4)
        assert dropped not in got and set(got) == set(jobs.values())
        ok = got[jobs[0]]
        assert not ok.error and ok.env.turn == 2 and ok.output["reward"] == pytest.approx(0.75 / 3)
        assert "RuntimeError: the tool crashed" in got[jobs[1]].error and got[jobs[1]].env is None
        assert got[jobs[2]].error == "environment step timed out after 2s"
        assert "environment worker died (exit code 7)" in got[jobs[3]].error
        assert pool.replaced == 2 and len(pool.workers) == 2  # the killed and the dead one, replaced
        again = pool.submit(envs[0], "2 2")  # and the pool goes on
        assert not _results(pool, 1)[again].error
    finally:
        pool.close()


def test_skyrl_gym_environments_run_unchanged_and_their_python_tool_has_no_network(tmp_path):
    pytest.importorskip("skyrl_gym")
    from dora_hpc.envs import Scorer, bind_task
    from dora_hpc.envs.sandbox import SandboxError, run_python

    try:
        run_python("pass", timeout_s=5)
    except SandboxError as e:
        pytest.skip(str(e))
    pool = _pool(tmp_path, task="reasoning_gym", **{"task.dataset_args": "{max_terms: 2, max_digits: 1}"})
    try:
        from dora_hpc.config import load_config
        from dora_hpc.data.tasks import make_task
        from dora_hpc.engine.local_models import build_tiny_model

        task = make_task(load_config(None, ["task.name=reasoning_gym", "task.dataset_args={max_terms: 2, "
                                            "max_digits: 1}"]), 512, build_tiny_model())
        bind_task(task)
        answer = task.ground_truth(0)
        gsm = make_env("skyrl:gsm8k_multi_turn", Scorer(0), max_turns=2, timeout_s=5)
        gsm.init(PROMPT)
        code = make_env("skyrl:searchcode", Scorer(0), max_turns=3, timeout_s=5)
        code.init(PROMPT)
        jobs = [pool.submit(gsm, "I think it is 0.5"), pool.submit(gsm, f"#### {answer}"),
                pool.submit(code, "<tool><python>print(6 * 7)</python></tool>"),
                pool.submit(code, "<tool><python>import socket\nsocket.create_connection(('1.1.1.1', 80), 2)"
                                  "</python></tool>")]
        got = _results(pool, 4)
        wrong, right, tool, net = (got[j] for j in jobs)
        assert not wrong.output["done"]
        assert wrong.output["observations"][0]["role"] == "user" and wrong.output["reward"] < 1
        assert right.output["done"] and right.output["reward"] == 1.0
        assert tool.output["observations"] == [{"role": "user", "content": "42"}]
        assert "Network is unreachable" in net.output["observations"][0]["content"]
    finally:
        pool.close()
