"""A pass/fail reward (used by tests via task.reward_fn): 1 when the response starts with an even token id.
Groups whose samples all pass or all fail are common, which dynamic sampling (batch.filter_groups) filters."""


def first_token_even(tokens):
    return float(bool(tokens) and tokens[0] % 2 == 0)
