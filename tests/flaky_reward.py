"""A user reward function that raises on some inputs (used by tests/test_runtime.py via task.reward_fn)."""


def flaky_reward(tokens):
    if len(tokens) % 3 == 0:
        raise ValueError("reward service unavailable")
    return sum(1 for t in tokens if t % 2 == 0) / len(tokens)
