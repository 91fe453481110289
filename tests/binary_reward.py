"""A pass/fail reward (used by tests via task.reward_fn): 1 when the response starts with an even token id.
Groups whose samples all pass or all fail are common, which dynamic sampling (batch.filter_groups) filters."""


def first_token_even(tokens):
    return float(bool(tokens) and tokens[0] % 2 == 0)


def first_token_quarter(tokens):
    """1 when the response starts with a token id divisible by 4 (about a quarter of them): about a third of the
    groups of 4 all fail, so a short run filters some however few groups its admission starts."""
    return float(bool(tokens) and tokens[0] % 4 == 0)
