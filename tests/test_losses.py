"""Tests of gpufleet.rl.losses.policy_loss against hand-computed values (float64).

Inputs are built from a table of per-token log-ratios d = logprobs - old_logprobs, so the
ratio r = exp(d) is known and every expected number below is worked out by hand in a comment.
PPO clip with A > 0 keeps min(r, 1 + eps_high) * A; with A < 0 keeps max(r, 1 - eps) * A
(the min of the two products), and the per-token loss is minus that.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpufleet.rl.losses import LEVELS, LossOptions, policy_loss

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the PPO-clip types the hand cases below cover

F64 = torch.float64
LOSS_KEYS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"}


def make_inputs(log_ratio, advantages, mask, base=None):
    """logprobs (leaf, requires grad), old_logprobs = logprobs - log_ratio, advantages, mask."""
    d = torch.tensor(log_ratio, dtype=F64)
    if base is None:
        base = -0.25 * torch.arange(1, d.numel() + 1, dtype=F64).reshape(d.shape)  # any values
    logprobs = base.clone().requires_grad_(True)
    old = (base - d).detach()
    return logprobs, old, torch.tensor(advantages, dtype=F64), torch.tensor(mask, dtype=F64)


def loss_and_grad(logprobs, *args, **kwargs):
    if logprobs.grad is not None:
        logprobs.grad = None
    loss, stats = policy_loss(logprobs, *args, **kwargs)
    loss.backward()
    return loss.detach(), logprobs.grad.clone(), stats


# ---------------------------------------------------------------------------------------------
# Case A (token level): ratios r = [[1.1, 1.5, 0.5], [0.9, 0.7, 1.3]], A = [1, -2],
# mask [[1, 1, 0], [1, 1, 1]], eps = 0.2.
#   row 0 (A = +1): r=1.1 -> min(1.1, 1.1) = 1.1 -> loss -1.1
#                   r=1.5 -> min(1.5, 1.2) = 1.2 -> loss -1.2 (high clip)
#                   r=0.5 masked
#   row 1 (A = -2): r=0.9 -> min(-1.8, -1.8) -> loss 1.8
#                   r=0.7 -> min(-1.4, 0.8*-2=-1.6) = -1.6 -> loss 1.6 (low clip)
#                   r=1.3 -> min(-2.6, 1.2*-2=-2.4) = -2.6 -> loss 2.6 (not clipped: pessimistic side)
#   grpo    = ((-1.1 - 1.2)/2 + (1.8 + 1.6 + 2.6)/3) / 2 = (-1.15 + 2.0) / 2 = 0.425
#   bnpo    = (-2.3 + 6.0) / 5 = 0.74 ; dapo the same
#   dr_grpo = 3.7 / (B=2 * L=4) = 0.4625
#   stats over 5 valid tokens: low 1/5, high 1/5, region 2/5
# ---------------------------------------------------------------------------------------------
CASE_A = dict(
    log_ratio=[[math.log(1.1), math.log(1.5), math.log(0.5)], [math.log(0.9), math.log(0.7), math.log(1.3)]],
    advantages=[1.0, -2.0],
    mask=[[1, 1, 0], [1, 1, 1]],
)
CASE_A_LOSS = {"grpo": 0.425, "bnpo": 0.74, "dapo": 0.74, "dr_grpo": 0.4625}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_level_hand_values(loss_type):
    logprobs, old, adv, mask = make_inputs(**CASE_A)
    loss, stats = policy_loss(logprobs, old, adv, mask, loss_type=loss_type, max_completion_length=4)
    assert loss.item() == pytest.approx(CASE_A_LOSS[loss_type], abs=1e-12)
    assert stats["clip_ratio/low_mean"] == pytest.approx(0.2)
    assert stats["clip_ratio/high_mean"] == pytest.approx(0.2)
    assert stats["clip_ratio/region_mean"] == pytest.approx(0.4)
    assert stats["kl"] == 0.0
    assert set(stats) == LOSS_KEYS
    assert all(type(v) is float for v in stats.values())


# ---------------------------------------------------------------------------------------------
# Case B: log-ratios d = [[0.3, -0.1, 5.0], [-0.6, 0.0, -0.3]], A = [1, -2], mask as case A.
# Sequence level (GSPO): mean log-ratio over valid tokens
#   row 0: (0.3 - 0.1)/2 = 0.1 -> s0 = e^0.1 = 1.1051709180756477 (in [0.8, 1.2]) -> loss -s0 per token
#   row 1: (-0.6 + 0 - 0.3)/3 = -0.3 -> s1 = e^-0.3 = 0.7408 < 0.8 with A < 0 -> clipped: loss 1.6 per token
#   grpo    = (-1.1051709180756477 + 1.6) / 2 = 0.24741454096217613
#   bnpo    = (2 * -1.1051709180756477 + 3 * 1.6) / 5 = 2.5896581638487046 / 5 = 0.5179316327697409
#   dr_grpo = 2.5896581638487046 / 8 = 0.3237072704810881
#   stats: sequence 1 of 2 is low-clipped (TRL counts sequences at this level): low 1/2, high 0, region 1/2
# Token level on the same inputs:
#   row 0 (A=+1): e^0.3 = 1.34986 -> clipped to 1.2 -> -1.2 ; e^-0.1 = 0.9048374180359595 -> -0.90484
#   row 1 (A=-2): e^-0.6 = 0.54881 -> min(-1.0976, -1.6) -> 1.6 (clipped) ; e^0 = 1 -> 2.0 ;
#                 e^-0.3 = 0.74082 -> min(-1.4816, -1.6) -> 1.6 (clipped)
#   grpo    = (-2.1048374180359595/2 + 5.2/3) / 2 = (-1.0524187090179798 + 1.7333333333333334)/2
#           = 0.3404573121576768
#   bnpo    = (-2.1048374180359595 + 5.2) / 5 = 0.6190325163928081
#   dr_grpo = 3.0951625819640405 / 8 = 0.38689532274550506
#   stats: low = tokens (1,0),(1,2) = 2/5, high = token (0,0) = 1/5, region 3/5
# ---------------------------------------------------------------------------------------------
CASE_B = dict(
    log_ratio=[[0.3, -0.1, 5.0], [-0.6, 0.0, -0.3]], advantages=[1.0, -2.0], mask=[[1, 1, 0], [1, 1, 1]]
)
CASE_B_LOSS = {
    "sequence": {
        "grpo": 0.24741454096217613,
        "bnpo": 0.5179316327697409,
        "dapo": 0.5179316327697409,
        "dr_grpo": 0.3237072704810881,
    },
    "token": {
        "grpo": 0.3404573121576768,
        "bnpo": 0.6190325163928081,
        "dapo": 0.6190325163928081,
        "dr_grpo": 0.38689532274550506,
    },
}
CASE_B_STATS = {"sequence": (0.5, 0.0, 0.5), "token": (0.4, 0.2, 0.6)}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_case_b_hand_values_every_loss_type_and_level(loss_type, level):
    logprobs, old, adv, mask = make_inputs(**CASE_B)
    loss, stats = policy_loss(
        logprobs, old, adv, mask, loss_type=loss_type, level=level, max_completion_length=4
    )
    assert loss.item() == pytest.approx(CASE_B_LOSS[level][loss_type], abs=1e-12)
    low, high, region = CASE_B_STATS[level]
    assert stats["clip_ratio/low_mean"] == pytest.approx(low)
    assert stats["clip_ratio/high_mean"] == pytest.approx(high)
    assert stats["clip_ratio/region_mean"] == pytest.approx(region)


def test_token_level_gradient_hand_values():
    # grpo, token level, case B. d loss / d logp_t = -A * r_t / (n_i * B) when the unclipped term
    # is selected, 0 when the clipped (constant) term is:
    #   (0,0) clipped -> 0 ; (0,1) -> -1 * 0.9048374180359595 / (2 * 2) = -0.22620935450898988 ; (0,2) masked 0
    #   (1,0) clipped -> 0 ; (1,1) r = 1 -> +2 * 1 / (3 * 2) = 1/3 ; (1,2) clipped -> 0
    logprobs, old, adv, mask = make_inputs(**CASE_B)
    _, grad, _ = loss_and_grad(logprobs, old, adv, mask, loss_type="grpo", level="token")
    expected = torch.tensor([[0.0, -0.22620935450898988, 0.0], [0.0, 1.0 / 3.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("loss_type", "row0_grad"),
    [
        # grpo: row-0 loss -A0*s0/B, s0 = exp(mean of 2 log-ratios) -> d/dlogp_t = -s0 / (2 * 2)
        ("grpo", -1.1051709180756477 / 4),
        # bnpo: row-0 loss 2 * (-s0) / 5 -> d/dlogp_t = -2 * s0 * (1/2) / 5 = -s0 / 5
        ("bnpo", -1.1051709180756477 / 5),
        # dr_grpo (L=4): 2 * (-s0) / 8 -> -s0 / 8
        ("dr_grpo", -1.1051709180756477 / 8),
    ],
)
def test_sequence_level_gradient_hand_values(loss_type, row0_grad):
    # Row 1's sequence ratio is clipped (constant) -> zero gradient on every token of row 1.
    logprobs, old, adv, mask = make_inputs(**CASE_B)
    _, grad, _ = loss_and_grad(
        logprobs, old, adv, mask, loss_type=loss_type, level="sequence", max_completion_length=4
    )
    expected = torch.tensor([[row0_grad, row0_grad, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------
# Clipping, both sides, and DAPO clip-higher.
# ---------------------------------------------------------------------------------------------
def test_clip_high_symmetric_and_clip_higher():
    # A = +1, ratios [1.25, 1.5, 0.7], all valid, grpo.
    # eps = 0.2 (symmetric): min(1.25, 1.2) = 1.2 ; min(1.5, 1.2) = 1.2 ; min(0.7, 0.8) = 0.7
    #   loss = -(1.2 + 1.2 + 0.7)/3 = -1.0333333333333334 ; high clip 2/3
    # eps_high = 0.28: 1.25 unclipped ; min(1.5, 1.28) = 1.28 ; 0.7
    #   loss = -(1.25 + 1.28 + 0.7)/3 = -1.0766666666666667 ; high clip 1/3
    #   grad = -r/3 on unclipped tokens: [-1.25/3, 0, -0.7/3]
    kw = dict(log_ratio=[[math.log(1.25), math.log(1.5), math.log(0.7)]], advantages=[1.0], mask=[[1, 1, 1]])
    logprobs, old, adv, mask = make_inputs(**kw)
    loss, grad, stats = loss_and_grad(logprobs, old, adv, mask, epsilon=0.2)
    assert loss.item() == pytest.approx(-1.0333333333333334, abs=1e-12)
    assert stats["clip_ratio/high_mean"] == pytest.approx(2 / 3)
    assert stats["clip_ratio/low_mean"] == 0.0  # r = 0.7 < 0.8 but A > 0: not a clip
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.7 / 3]], dtype=F64), atol=1e-12, rtol=0)

    loss, grad, stats = loss_and_grad(logprobs, old, adv, mask, epsilon=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.0766666666666667, abs=1e-12)
    assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert stats["clip_ratio/region_mean"] == pytest.approx(1 / 3)
    torch.testing.assert_close(
        grad, torch.tensor([[-1.25 / 3, 0.0, -0.7 / 3]], dtype=F64), atol=1e-12, rtol=0
    )


def test_clip_low_negative_advantage():
    # A = -1, ratios [0.5, 0.9, 1.5], eps = 0.2, grpo:
    #   r=0.5: min(-0.5, 0.8*-1 = -0.8) = -0.8 -> loss 0.8 (low clip, grad 0)
    #   r=0.9: -0.9 -> 0.9 ; r=1.5: min(-1.5, -1.2) = -1.5 -> 1.5 (unclipped: A < 0 never clips high)
    #   loss = 3.2 / 3 ; grad = -A r / 3 = [0, 0.3, 0.5] ; low 1/3, high 0, region 1/3
    kw = dict(log_ratio=[[math.log(0.5), math.log(0.9), math.log(1.5)]], advantages=[-1.0], mask=[[1, 1, 1]])
    logprobs, old, adv, mask = make_inputs(**kw)
    loss, grad, stats = loss_and_grad(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx(3.2 / 3, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.3, 0.5]], dtype=F64), atol=1e-12, rtol=0)
    assert stats["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert stats["clip_ratio/high_mean"] == 0.0
    assert stats["clip_ratio/region_mean"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------------------------------------
# KL (k3): ref - logp = x -> kl = e^x - x - 1 ; d kl / d logp = 1 - e^x.
#   x = 0.5:  e^0.5 - 1.5 = 0.14872127070012819
#   x = -0.5: e^-0.5 + 0.5 - 1 = 0.10653065971263342
#   mean over the 2 valid tokens = 0.1276259652063808
# ---------------------------------------------------------------------------------------------
def kl_inputs(advantage):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = logprobs.detach().clone()  # ratio 1 everywhere
    ref = logprobs.detach() + torch.tensor([[0.5, -0.5, 3.0]], dtype=F64)  # last token masked
    mask = torch.tensor([[1, 1, 0]], dtype=F64)
    return logprobs, old, torch.tensor([advantage], dtype=F64), mask, ref


def test_kl_value_and_gradient():
    logprobs, old, adv, mask, ref = kl_inputs(0.0)  # A = 0: the policy term is 0
    loss, grad, stats = loss_and_grad(logprobs, old, adv, mask, ref_logprobs=ref, beta=0.1)
    # grpo: 0.1 * 0.1276259652063808
    assert loss.item() == pytest.approx(0.01276259652063808, abs=1e-12)
    assert stats["kl"] == pytest.approx(0.1276259652063808, abs=1e-12)
    # grad = beta / n * (1 - e^x): 0.05 * (1 - 1.6487212707001282), 0.05 * (1 - 0.6065306597126334), 0
    expected = torch.tensor([[-0.03243606353500641, 0.01967346701436833, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)

    # dr_grpo, L = 4: 0.1 * (0.14872127070012819 + 0.10653065971263342) / (1 * 4)
    loss, _ = policy_loss(
        logprobs, old, adv, mask, ref_logprobs=ref, beta=0.1, loss_type="dr_grpo", max_completion_length=4
    )
    assert loss.item() == pytest.approx(0.00638129826031904, abs=1e-12)


def test_kl_adds_to_policy_term():
    # A = 1, ratio 1: policy loss -1 per token; grpo mean -1 ; + 0.1 * 0.1276259652063808
    logprobs, old, adv, mask, ref = kl_inputs(1.0)
    loss, _ = policy_loss(logprobs, old, adv, mask, ref_logprobs=ref, beta=0.1)
    assert loss.item() == pytest.approx(-1.0 + 0.01276259652063808, abs=1e-12)


def test_kl_stat_without_penalty_and_without_ref():
    logprobs, old, adv, mask, ref = kl_inputs(1.0)
    loss_ref, stats_ref = policy_loss(logprobs, old, adv, mask, ref_logprobs=ref, beta=0.0)
    loss_noref, stats_noref = policy_loss(logprobs, old, adv, mask)
    assert loss_ref.item() == pytest.approx(-1.0, abs=1e-12)  # beta 0: no penalty
    assert loss_noref.item() == pytest.approx(-1.0, abs=1e-12)
    assert stats_ref["kl"] == pytest.approx(0.1276259652063808, abs=1e-12)  # still reported
    assert stats_noref["kl"] == 0.0


# ---------------------------------------------------------------------------------------------
# normalizer replaces the final denominator (case A: sum of per-sequence means 0.85, token sum 3.7).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loss_type", "normalizer", "expected"),
    [
        ("grpo", 5.0, 0.85 / 5),  # (-1.15 + 2.0) / 5 = 0.17
        ("bnpo", 10.0, 0.37),  # 3.7 / 10
        ("dapo", 10.0, 0.37),
        ("dr_grpo", 10.0, 0.37),  # max_completion_length not needed when normalizer is given
    ],
)
def test_normalizer_replaces_denominator(loss_type, normalizer, expected):
    logprobs, old, adv, mask = make_inputs(**CASE_A)
    loss, _ = policy_loss(logprobs, old, adv, mask, loss_type=loss_type, normalizer=normalizer)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_normalizer_overrides_max_completion_length():
    logprobs, old, adv, mask = make_inputs(**CASE_A)
    loss, _ = policy_loss(
        logprobs, old, adv, mask, loss_type="dr_grpo", max_completion_length=4, normalizer=10.0
    )
    assert loss.item() == pytest.approx(0.37, abs=1e-12)  # not 3.7 / 8


# ---------------------------------------------------------------------------------------------
# Masks.
# ---------------------------------------------------------------------------------------------
def random_batch(seed, b=4, t=6, lengths=(6, 3, 1, 4), scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=gen, dtype=F64) * 3
    old = logprobs + torch.randn(b, t, generator=gen, dtype=F64) * scale
    ref = logprobs + torch.randn(b, t, generator=gen, dtype=F64) * scale
    adv = torch.randn(b, generator=gen, dtype=F64)
    mask = (torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(F64)
    return logprobs, old, ref, adv, mask


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_tokens_change_neither_loss_nor_gradient(loss_type, level):
    logprobs, old, ref, adv, mask = random_batch(0)
    kw = dict(loss_type=loss_type, level=level, beta=0.05, max_completion_length=6)

    lp1 = logprobs.clone().requires_grad_(True)
    loss1, grad1, stats1 = loss_and_grad(lp1, old, adv, mask, ref_logprobs=ref, **kw)

    pad = mask == 0
    garbage = torch.tensor([50.0, -float("inf"), float("nan"), -40.0, 7.0], dtype=F64)
    fill = garbage.repeat(int(pad.sum()))[: int(pad.sum())]
    lp2 = logprobs.clone()
    lp2[pad] = fill
    lp2.requires_grad_(True)
    old2, ref2 = old.clone(), ref.clone()
    old2[pad] = -fill.flip(0)
    ref2[pad] = fill * 3
    loss2, grad2, stats2 = loss_and_grad(lp2, old2, adv, mask, ref_logprobs=ref2, **kw)

    assert torch.isfinite(loss1)
    assert torch.equal(loss1, loss2)
    assert torch.equal(grad1, grad2)
    assert stats1 == stats2
    assert torch.all(grad1[pad] == 0)
    assert torch.any(grad1[~pad] != 0)  # the valid tokens do get a gradient


def test_bool_float_and_int_masks_agree():
    logprobs, old, ref, adv, mask = random_batch(1)
    results = [
        policy_loss(logprobs, old, adv, m, ref_logprobs=ref, beta=0.1)
        for m in (mask, mask.bool(), mask.long(), mask.float())
    ]
    for loss, stats in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert stats == results[0][1]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_empty_mask_gives_zero_loss_and_stats(loss_type, level):
    logprobs, old, ref, adv, mask = random_batch(2)
    logprobs.requires_grad_(True)
    zeros = torch.zeros_like(mask)
    loss, grad, stats = loss_and_grad(
        logprobs,
        old,
        adv,
        zeros,
        ref_logprobs=ref,
        beta=0.1,
        loss_type=loss_type,
        level=level,
        max_completion_length=6,
    )
    assert loss.item() == 0.0
    assert torch.all(grad == 0)
    assert stats == dict.fromkeys(LOSS_KEYS, 0.0)


def test_only_logprobs_receive_gradient():
    logprobs, old, ref, adv, mask = random_batch(3)
    leaves = [t.clone().requires_grad_(True) for t in (logprobs, old, ref, adv)]
    loss, _ = policy_loss(leaves[0], leaves[1], leaves[3], mask, ref_logprobs=leaves[2], beta=0.1)
    loss.backward()
    assert leaves[0].grad is not None
    assert all(t.grad is None for t in leaves[1:])  # old, ref and advantages are constants


# ---------------------------------------------------------------------------------------------
# Sequence vs token level.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_equals_token_when_all_ratios_are_one(loss_type):
    # r = 1: token loss -A per token, grad -A/(n_i * B) (grpo). Sequence: s = exp(mean 0) = 1,
    # d s / d logp_t = s / n_i, so every token gets the same gradient as at token level.
    logprobs, _, ref, adv, mask = random_batch(4)
    out = {}
    for level in LEVELS:
        lp = logprobs.clone().requires_grad_(True)
        out[level] = loss_and_grad(
            lp,
            lp.detach(),
            adv,
            mask,
            ref_logprobs=ref,
            beta=0.05,
            loss_type=loss_type,
            level=level,
            max_completion_length=6,
        )
    torch.testing.assert_close(out["sequence"][0], out["token"][0], atol=1e-12, rtol=0)
    torch.testing.assert_close(out["sequence"][1], out["token"][1], atol=1e-12, rtol=0)
    assert torch.any(out["token"][1] != 0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_differs_from_token_when_ratios_differ(loss_type):
    logprobs, old, adv, mask = make_inputs(**CASE_B)
    seq = loss_and_grad(
        logprobs, old, adv, mask, loss_type=loss_type, level="sequence", max_completion_length=4
    )
    tok = loss_and_grad(logprobs, old, adv, mask, loss_type=loss_type, level="token", max_completion_length=4)
    assert abs(seq[0].item() - tok[0].item()) > 1e-3
    assert (seq[1] - tok[1]).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------
# Micro-batch invariance: with the global normalizer, summed micro-batch gradients equal the
# full-batch gradient, whatever the split.
# ---------------------------------------------------------------------------------------------
def global_normalizer(loss_type, mask, max_len):
    if loss_type == "grpo":
        return float(mask.shape[0])  # global number of sequences
    if loss_type == "dr_grpo":
        return float(mask.shape[0] * max_len)  # global B * max_completion_length
    return float(mask.sum())  # bnpo / dapo: global number of valid tokens


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("micro", [1, 2])
def test_micro_batch_invariance(loss_type, level, micro):
    max_len = 7
    logprobs, old, ref, adv, mask = random_batch(5, lengths=(6, 3, 0, 4), scale=0.4)
    kw = dict(loss_type=loss_type, level=level, beta=0.04, max_completion_length=max_len)

    full = logprobs.clone().requires_grad_(True)
    full_loss, full_grad, _ = loss_and_grad(full, old, adv, mask, ref_logprobs=ref, **kw)

    norm = global_normalizer(loss_type, mask, max_len)
    parts = logprobs.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for i in range(0, mask.shape[0], micro):
        sl = slice(i, i + micro)
        loss, _ = policy_loss(
            parts[sl], old[sl], adv[sl], mask[sl], ref_logprobs=ref[sl], normalizer=norm, **kw
        )
        loss.backward()  # gradients accumulate in parts.grad, as in gradient accumulation
        total = total + loss.detach()

    assert torch.any(full_grad != 0)
    torch.testing.assert_close(parts.grad, full_grad, atol=1e-10, rtol=0)
    torch.testing.assert_close(total, full_loss, atol=1e-10, rtol=0)


def test_micro_batches_without_normalizer_are_not_invariant():
    # Control for the test above: bnpo averaged per micro-batch weights tokens of short rows more.
    logprobs, old, _, adv, mask = random_batch(5, lengths=(6, 3, 0, 4), scale=0.4)
    full = logprobs.clone().requires_grad_(True)
    _, full_grad, _ = loss_and_grad(full, old, adv, mask, loss_type="bnpo")
    parts = logprobs.clone().requires_grad_(True)
    for i in range(mask.shape[0]):
        loss, _ = policy_loss(
            parts[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], loss_type="bnpo"
        )
        loss.backward()
    assert (parts.grad - full_grad).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------------------------
def test_unknown_loss_type_and_level():
    logprobs, old, adv, mask = make_inputs(**CASE_A)
    with pytest.raises(ValueError, match="ppo") as info:
        policy_loss(logprobs, old, adv, mask, loss_type="ppo")
    assert all(name in str(info.value) for name in LOSS_TYPES)
    with pytest.raises(ValueError, match="word") as info:
        policy_loss(logprobs, old, adv, mask, level="word")
    assert all(name in str(info.value) for name in LEVELS)


def test_value_errors():
    logprobs, old, adv, mask = make_inputs(**CASE_A)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logprobs, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, adv, mask, beta=0.1)
    for bad in (0.0, -3.0, float("nan")):
        with pytest.raises(ValueError, match="normalizer"):
            policy_loss(logprobs, old, adv, mask, normalizer=bad)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, old, adv.unsqueeze(1), mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logprobs, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(logprobs, old[:1], adv, mask)


# ---------------------------------------------------------------------------------------------
# KL bias correction (DeepSeek-V3.2, TRL use_bias_correction_kl): kl * r with r = exp(logp - old).
#   d/dlogp [k3(ref - logp) * r] = r (1 - e^x) + r k3(x) = r (1 - e^x + e^x - x - 1) = -r x   (x = ref - logp)
# On-policy (r = 1 in value): grpo, beta 0.1, 2 valid tokens: grad = 0.05 * -x = [-0.025, 0.025, 0];
#   the loss value is unchanged (0.1 * 0.1276259652063808), the gradient is not (uncorrected: 0.05 (1 - e^x)).
# Off-policy, r = [2, 1] on the valid tokens: kl stat = (2 * 0.14872127070012819 + 0.10653065971263342) / 2
#   = 0.2019866005564449 ; grad = 0.05 * -r x = [-0.05, 0.025, 0].
# ---------------------------------------------------------------------------------------------
def test_kl_bias_correction_on_policy_changes_gradient_only():
    logprobs, old, adv, mask, ref = kl_inputs(0.0)
    loss, grad, stats = loss_and_grad(
        logprobs, old, adv, mask, ref_logprobs=ref, beta=0.1, kl_bias_correction=True
    )
    assert loss.item() == pytest.approx(0.01276259652063808, abs=1e-12)
    assert stats["kl"] == pytest.approx(0.1276259652063808, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-0.025, 0.025, 0.0]], dtype=F64), atol=1e-12, rtol=0)


def test_kl_bias_correction_off_policy_value_stat_and_gradient():
    logprobs, _, adv, mask, ref = kl_inputs(0.0)
    old = logprobs.detach() - torch.tensor([[math.log(2.0), 0.0, 7.0]], dtype=F64)  # r = 2, 1, (masked)
    loss, grad, stats = loss_and_grad(
        logprobs, old, adv, mask, ref_logprobs=ref, beta=0.1, kl_bias_correction=True
    )
    assert stats["kl"] == pytest.approx(0.2019866005564449, abs=1e-12)
    assert loss.item() == pytest.approx(0.1 * 0.2019866005564449, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-0.05, 0.025, 0.0]], dtype=F64), atol=1e-12, rtol=0)


def test_kl_bias_correction_at_sequence_level_uses_the_sequence_ratio():
    # s = exp(mean(log 2, 0)) = sqrt 2 multiplies both tokens' k3; d s / d logp_t = s / 2.
    logprobs, _, adv, mask, ref = kl_inputs(0.0)
    old = logprobs.detach() - torch.tensor([[math.log(2.0), 0.0, 7.0]], dtype=F64)
    k3 = torch.tensor([0.14872127070012819, 0.10653065971263342], dtype=F64)
    x = torch.tensor([0.5, -0.5], dtype=F64)
    s = math.sqrt(2.0)
    _, grad, stats = loss_and_grad(
        logprobs, old, adv, mask, ref_logprobs=ref, beta=0.1, level="sequence", kl_bias_correction=True
    )
    assert stats["kl"] == pytest.approx(s * k3.mean().item(), abs=1e-12)
    expected = 0.05 * (s * (1 - torch.exp(x)) + k3.sum() * s / 2)
    torch.testing.assert_close(grad[0, :2], expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------
# delta (INTELLECT-2 two-sided clip): ratio 3 with A = -2, eps 0.2: PPO keeps -min(-6, -2.4) = 6;
# delta 1.5 caps the ratio: -min(-3, -2.4) = 3, gradient 0 (capped). Row 0, A = +1, ratio 3:
# min(1.5, 1.2) = 1.2 either way (high-clipped, counted). grpo mean over 2 rows of 1 token each.
# ---------------------------------------------------------------------------------------------
def test_delta_caps_the_unclipped_ratio():
    logprobs, old, adv, mask = make_inputs(
        log_ratio=[[math.log(3.0)], [math.log(3.0)]], advantages=[1.0, -2.0], mask=[[1], [1]]
    )
    loss, grad, stats = loss_and_grad(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 6.0) / 2, abs=1e-12)
    loss, grad, stats = loss_and_grad(logprobs, old, adv, mask, options=LossOptions(delta=1.5))
    assert loss.item() == pytest.approx((-1.2 + 3.0) / 2, abs=1e-12)
    assert torch.all(grad == 0)
    assert stats["clip_ratio/high_mean"] == pytest.approx(0.5)
