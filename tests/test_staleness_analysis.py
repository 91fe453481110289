"""analysis/staleness.py: the naive vs difficulty-stratified comparison on rows with known answers."""

import numpy as np
import pytest

from dora_hpc.analysis.staleness import stratified


def test_stratifying_by_difficulty_removes_a_confounded_naive_gap():
    # group 0: easy, fresh; group 1: hard (1 of 4 passes), stale; group 2: easy, stale
    group = np.repeat([0, 1, 2], 4)
    stale = np.repeat([0, 1, 1], 4)
    reward = np.array([1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1], dtype=float)
    length = np.array([10] * 4 + [40] * 4 + [12] * 4)
    s = stratified(stale, reward, group, length)
    assert s["naive"]["by_staleness"] == {"0": {"n": 4, "pass_rate": 1.0}, "1": {"n": 8, "pass_rate": 0.625}}
    assert s["naive"]["delta"] == pytest.approx(-0.375)   # stale looks worse ...
    easy = next(r for r in s["rows"] if r["bin"] == "[0.75, 1.00]")
    hard = next(r for r in s["rows"] if r["bin"] == "[0.25, 0.50)")
    assert easy["delta"] == 0.0 and easy["n"] == 8        # ... but not at equal difficulty
    assert hard["delta"] is None and hard["by_staleness"] == {"1": {"n": 4, "pass_rate": 0.25}}
    assert s["median_length_by_staleness"] == {"0": 10.0, "1": 26.0}  # stale responses are longer
    t3 = {r["bin"]: r for r in s["by_difficulty"]}
    assert t3["[0.25, 0.50)"]["reward_variance"] == pytest.approx(0.1875) and t3["[0.25, 0.50)"]["mean_length"] == 40
    assert t3["[0.00, 0.25)"] == {"bin": "[0.00, 0.25)", "groups": 0, "reward_variance": None, "mean_length": None,
                                  "mean_staleness": None}


def test_difficulty_is_a_prompts_pass_rate_over_the_run_when_the_run_says_which_prompt_a_group_got():
    """Prompt 0 is asked twice, fresh (group 0: 1 of 4 right) and stale (group 2: 3 of 4): its pass rate over
    the run is 0.5, so both groups land in one bin and are compared with each other. Binned by group, the
    stale group is compared with another prompt's (group 1, all right). Table 3 still bins groups by their own
    pass rate."""
    group = np.repeat([0, 1, 2], 4)
    prompt = np.repeat([0, 1, 0], 4)
    stale = np.repeat([0, 0, 1], 4)
    reward = np.array([1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0], dtype=float)
    length = np.full(12, 10)
    by_group = stratified(stale, reward, group, length)
    by_prompt = stratified(stale, reward, group, length, prompt=prompt)
    assert by_group["difficulty_of"] == "group" and by_prompt["difficulty_of"] == "prompt"
    mid = next(r for r in by_prompt["rows"] if r["bin"] == "[0.50, 0.75)")
    assert mid["by_staleness"] == {"0": {"n": 4, "pass_rate": 0.25}, "1": {"n": 4, "pass_rate": 0.75}}
    assert mid["delta"] == pytest.approx(0.5)
    easy = next(r for r in by_group["rows"] if r["bin"] == "[0.75, 1.00]")
    assert easy["delta"] == pytest.approx(-0.25) and by_group["rows"][1]["delta"] is None
    assert by_prompt["by_difficulty"] == by_group["by_difficulty"]


def test_table3_in_the_papers_bins_places_each_group_by_k_of_16_and_leaves_out_groups_with_none_right():
    """Groups of 16 with 0, 2, 6, 10, 13 and 16 right land in no bin, Hard, Medium-Hard, Medium-Easy, Easy and
    Very Easy; groups of 4 with 1 right (4 of 16) are Medium-Hard, so Hard needs more than 4 samples a group."""
    ks, g = [0, 2, 6, 10, 13, 16], 16
    group = np.repeat(np.arange(len(ks)), g)
    reward = np.concatenate([[1.0] * k + [0.0] * (g - k) for k in ks])
    stale = np.repeat(np.arange(len(ks)), g) % 2
    length = np.repeat(np.arange(len(ks)) * 10, g)
    t3 = stratified(stale, reward, group, length)["by_difficulty_paper_bins"]
    assert [r["groups"] for r in t3] == [1, 1, 1, 1, 1]
    assert [r["mean_length"] for r in t3] == [10, 20, 30, 40, 50]
    assert t3[1]["reward_variance"] == pytest.approx(6 / 16 * 10 / 16)
    four = stratified(np.zeros(8), np.array([1, 0, 0, 0, 1, 1, 1, 1.0]), np.repeat([0, 1], 4), np.ones(8))
    assert [r["groups"] for r in four["by_difficulty_paper_bins"]] == [0, 1, 0, 0, 1]
