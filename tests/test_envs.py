"""The built-in environments of multi-turn episodes, driven as the rollout will drive them: init, then a
step per model turn until done (dora_hpc/envs/)."""

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
