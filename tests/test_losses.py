"""The policy losses, corrections and aggregations on a hand-computed 2-group batch (train/losses.py).

The batch: group 0 = samples 0, 1 (advantages +1, -1); group 1 = samples 2, 3 (advantages -1, +1); each
sample has two response tokens except sample 3, which has one. Log-ratios are chosen so every case below
lands in a known branch of the clip.
"""

import math

import pytest
import torch

from dora_hpc.core.trajectory import Trajectory
from dora_hpc.train.grpo import group_advantages
from dora_hpc.train.losses import LossConfig, aggregate, k3, policy_loss

L = math.log
ADV = torch.tensor([[1.0], [-1.0], [-1.0], [1.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])


def near(got, want, tol=1e-6):
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return torch.allclose(got, want, atol=tol, rtol=0)


def run(cfg, new, prox, behav, adv=ADV, mask=MASK):
    new = torch.tensor(new, requires_grad=True)
    per_tok, st = policy_loss(new, torch.tensor(prox), torch.tensor(behav), adv, mask, cfg)
    (per_tok * mask).sum().backward()
    return per_tok.detach(), new.grad, st


def test_ppo_clip_clips_where_it_changes_the_loss_and_counts_the_band_apart():
    # ratios pi/pi_behav: s0 (A+) 1.5 | 1.0; s1 (A-) 1.5 | 0.5; s2 (A-) 0.9 | 1.1; s3 (A+) 1.2
    new = [[L(1.5), 0.0], [L(1.5), L(0.5)], [L(0.9), L(1.1)], [L(1.2), 0.0]]
    zero = [[0.0, 0.0]] * 4
    per_tok, grad, st = run(LossConfig(), new, new, zero)
    want = [[-1.28, -1.0], [1.5, 0.8], [0.9, 1.1], [-1.2, -1.0]]  # s3 token 2 is masked at aggregation
    assert near(per_tok, want, 1e-6)
    # clipped tokens get no gradient; elsewhere d(-A * ratio)/d log pi = -A * ratio
    assert near(grad, [[0.0, -1.0], [1.5, 0.0], [0.9, 1.1], [-1.2, 0.0]], 1e-6)
    assert st["clip_high"].tolist() == [[1, 0], [0, 0], [0, 0], [0, 0]]
    assert st["clip_low"].tolist() == [[0, 0], [0, 1], [0, 0], [0, 0]]
    assert st["clip_band"].tolist() == [[1, 0], [1, 1], [0, 0], [0, 0]]  # s1's 1.5 left the band, unclipped


def test_decoupled_weights_stale_tokens_by_prox_over_behaviour_and_corrections_act_on_that_weight():
    # the trainer holds the proximal weights (new == prox): the ratio is 1, w = pi_prox / pi_behav
    prox = [[L(1.2), L(3.0)], [L(0.4), 0.0], [L(1.5), L(0.8)], [L(2.5), 0.0]]
    behav = [[0.0, 0.0]] * 4
    w = [[1.2, 3.0], [0.4, 1.0], [1.5, 0.8], [2.5, 1.0]]
    for corr, w_c in (("none", w),
                      ("truncate", [[1.2, 2.0], [0.4, 1.0], [1.5, 0.8], [2.0, 1.0]]),
                      ("mask", [[1.2, 0.0], [0.0, 1.0], [1.5, 0.8], [0.0, 1.0]])):
        per_tok, grad, st = run(LossConfig(policy_loss="decoupled", is_correction=corr), prox, prox, behav)
        a = ADV.expand(4, 2)
        assert near(per_tok, (-a * torch.tensor(w_c)).tolist(), 1e-6), corr
        assert near(grad, (-a * torch.tensor(w_c) * MASK).tolist(), 1e-6), corr
        assert near(st["is_weight"], w, 1e-6)
    assert st["is_masked"].tolist() == [[0, 1], [1, 0], [0, 0], [1, 0]]
    _, _, st = run(LossConfig(policy_loss="decoupled", is_correction="truncate"), prox, prox, behav)
    assert st["is_truncated"].tolist() == [[0, 1], [0, 0], [0, 0], [1, 0]]


def test_m2po_masks_the_largest_squared_log_weights_until_the_rest_have_a_small_second_moment():
    """The batch above: log(w)^2 of its 7 tokens is 1.207 (w 3.0), 0.840 (0.4 and 2.5), 0.164 (1.5), 0.050 (0.8),
    0.033 (1.2) and 0; the padded token does not count. Masking the 3 largest leaves a mean of 0.062, the 4
    largest 0.028."""
    prox = [[L(1.2), L(3.0)], [L(0.4), 0.0], [L(1.5), L(0.8)], [L(2.5), L(9.0)]]  # the padded token's w: 9
    behav = [[0.0, 0.0]] * 4
    for m2, w_c in ((0.1, [[1.2, 0.0], [0.0, 1.0], [1.5, 0.8], [0.0, 9.0]]),
                    (0.04, [[1.2, 0.0], [0.0, 1.0], [0.0, 0.8], [0.0, 9.0]]),
                    (0.5, [[1.2, 3.0], [0.4, 1.0], [1.5, 0.8], [2.5, 9.0]])):
        per_tok, _, st = run(LossConfig(policy_loss="decoupled", is_correction="m2po", is_m2=m2), prox, prox, behav)
        assert near(per_tok, (-ADV.expand(4, 2) * torch.tensor(w_c)).tolist(), 1e-5), m2
        assert int((st["is_masked"] * MASK).sum()) == {0.1: 3, 0.04: 4, 0.5: 0}[m2]


def test_decoupled_equals_ppo_clip_on_samples_of_staleness_0():
    g = torch.Generator().manual_seed(0)
    new = (torch.randn(4, 2, generator=g) * 0.3).tolist()
    behav = (torch.randn(4, 2, generator=g) * 0.01).tolist()  # the engine's numerical gap, no staleness
    a = run(LossConfig(), new, behav, behav)  # the trainer's start-of-step weights sampled them
    b = run(LossConfig(policy_loss="decoupled"), new, behav, behav)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_ppo_clip_with_truncation_rescales_by_the_corrected_mismatch():
    new = prox = [[L(3.0), 0.0]] * 4  # the trainer finds the first token 3x likelier than the engine did
    per_tok, _, _ = run(LossConfig(is_correction="truncate", is_cap=2.0), new, prox, [[0.0, 0.0]] * 4)
    # ratio 3 > 1.28: clipped for A>0 (-1.28), not for A<0 (+3); then * min(3, 2) / 3
    assert per_tok[:, 0].tolist() == pytest.approx([-1.28 * 2 / 3, 2.0, 2.0, -1.28 * 2 / 3], abs=1e-6)


def test_gspo_clips_one_geometric_mean_ratio_per_sequence():
    new = [[0.2, 0.4], [0.2, 0.4], [0.0, 0.1], [0.5, 9.0]]  # sample 3's second token is masked out
    zero = [[0.0, 0.0]] * 4
    per_tok, grad, _ = run(LossConfig(policy_loss="gspo"), new, new, zero)
    r = [math.exp(0.3), math.exp(0.3), math.exp(0.05), math.exp(0.5)]
    want = [-1.28, r[1], r[2], -1.28]  # A+ above the band: clipped; A-: unclipped
    assert near(per_tok, [[x, x] for x in want], 1e-5)
    # d(-A r)/d log pi_t = -A r / n for each of the n tokens; summed over the n tokens that carry it: -A r
    assert near(grad[1], [r[1]] * 2, 1e-5) and grad[0].tolist() == [0.0, 0.0]


def test_dual_clip_caps_a_negative_advantage_token_counts_where_it_did_and_log_ratios_are_clamped():
    new = [[L(5.0), 100.0], [L(5.0), 100.0], [L(2.0), L(5.0)], [L(5.0), 100.0]]
    per_tok, grad, st = run(LossConfig(clip_ratio_c=3.0), new, new, [[0.0, 0.0]] * 4)
    assert per_tok[1].tolist() == pytest.approx([3.0, 3.0])  # 5 and e^20, both capped at c * |A|
    assert per_tok[2].tolist() == pytest.approx([2.0, 3.0])  # ratio 2 < c: the plain PPO loss
    assert per_tok[0].tolist() == pytest.approx([-1.28, -1.28])
    assert st["dual_clip"].tolist() == [[0, 0], [1, 1], [0, 1], [0, 0]]  # only A < 0 tokens the cap set
    assert grad[1].tolist() == [0.0, 0.0] and grad[2, 0].item() == pytest.approx(2.0)  # capped: no gradient
    _, _, st = run(LossConfig(), new, new, [[0.0, 0.0]] * 4)
    assert not st["dual_clip"].any()  # off by default
    new = [[L(5.0), 100.0]] * 4
    per_tok, _, _ = run(LossConfig(), new, new, [[0.0, 0.0]] * 4)
    assert per_tok[1, 1].item() == pytest.approx(math.exp(20.0), rel=1e-5)  # finite, not inf


# sequence-level weights: prox - behav per token; sample 3's second token is masked out, so its 7x is not counted
SEQ_PROX = [[L(1.2), L(3.0)], [L(0.4), 0.0], [L(1.5), L(0.8)], [L(2.5), L(7.0)]]
SEQ_W = [3.6, 0.4, 1.2, 2.5]  # the product of each sample's unmasked token ratios


@pytest.mark.parametrize("corr,w_c,truncated,masked", [
    ("none", SEQ_W, [0, 0, 0, 0], [0, 0, 0, 0]),
    ("truncate", [2.0, 0.4, 1.2, 2.0], [1, 0, 0, 1], [0, 0, 0, 0]),
    ("mask", [0.0, 0.0, 1.2, 0.0], [0, 0, 0, 0], [1, 1, 0, 1]),  # band [0.5, 2]: whole samples masked
])
def test_sequence_level_weights_are_each_samples_product_of_ratios_and_corrections_act_on_whole_samples(
        corr, w_c, truncated, masked):
    cfg = LossConfig(policy_loss="decoupled", is_correction=corr, is_level="sequence")
    per_tok, grad, st = run(cfg, SEQ_PROX, SEQ_PROX, [[0.0, 0.0]] * 4)
    every = torch.tensor(w_c)[:, None].expand(4, 2)
    assert near(per_tok, (-ADV * every).tolist(), 1e-5)  # ratio pi_new / pi_prox = 1: the loss is -A w_c
    assert near(grad, (-ADV * every * MASK).tolist(), 1e-5)
    assert near(st["is_weight"], torch.tensor(SEQ_W)[:, None].expand(4, 2).tolist(), 1e-5)
    assert st["is_truncated"].tolist() == [[x, x] for x in truncated]
    assert st["is_masked"].tolist() == [[x, x] for x in masked]


def test_sequence_level_truncation_under_ppo_clip_rescales_whole_samples_and_the_sum_is_clamped():
    new = [[L(1.2), L(3.0)], [15.0, 15.0], [L(1.5), L(0.8)], [L(2.5), 0.0]]  # sample 1: log w = 30 -> 20
    cfg = LossConfig(is_correction="truncate", is_cap=2.0, is_level="sequence")
    per_tok, _, st = run(cfg, new, new, [[0.0, 0.0]] * 4)
    plain, _, _ = run(LossConfig(), new, new, [[0.0, 0.0]] * 4)
    scale = torch.tensor([2.0 / 3.6, 2.0 / math.exp(20.0), 1.0, 2.0 / 2.5])[:, None]
    assert near(per_tok, (plain * scale).tolist(), 1e-5)
    assert st["is_weight"][1, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)  # finite: the sum is clamped
    token = run(LossConfig(is_correction="truncate", is_cap=2.0), new, new, [[0.0, 0.0]] * 4)[0]
    assert near(token[2], (plain[2]).tolist())  # token level: 1.5 and 0.8 stay under the cap, as here
    assert not near(token[0], per_tok[0].tolist())  # but sample 0's first token (1.2) is not rescaled there


def test_k3_is_clamped():
    assert k3(torch.tensor([0.5]), torch.tensor([0.0])).item() == pytest.approx(math.exp(0.5) - 1.5)
    assert k3(torch.tensor([30.0]), torch.tensor([0.0])).item() == 10.0
    assert k3(torch.tensor([30.0]), torch.tensor([0.0]), clamp=None).item() == pytest.approx(math.exp(20) - 21)


def test_aggregations_and_advantages():
    per_tok = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0], [6.0, 99.0]])
    assert aggregate(per_tok, MASK, "token", 7, 4, 10).item() == pytest.approx(18 / 7)
    assert aggregate(per_tok, MASK, "sequence", 7, 4, 10).item() == pytest.approx((2 + 2 + 2 + 6) / 4)
    assert aggregate(per_tok, MASK, "constant", 7, 4, 10).item() == pytest.approx(18 / 40)
    rewards = ((1.0, 0), (0.0, 0), (0.5, 1), (0.5, 1))
    samples = [Trajectory(i, g, -1, [1], [2], [0.0], r) for i, (r, g) in enumerate(rewards)]
    assert group_advantages(samples, std_norm=False) == [0.5, -0.5, 0.0, 0.0]  # Dr. GRPO
    std = math.sqrt(0.5)  # sample std of (1, 0)
    assert group_advantages(samples) == pytest.approx([0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5)
