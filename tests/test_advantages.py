"""Tests of gpufleet.rl.advantages against hand-computed values (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from gpufleet.rl.advantages import advantages_of, combine_rewards, group_advantages, nanstd

F64 = torch.float64
NAN = float("nan")


def t(values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------------------------------------
# combine_rewards
# ---------------------------------------------------------------------------------------------
def test_combine_rewards_ignores_nan():
    # row 0: 1*1 + (NaN ignored)        = 1.0
    # row 1: all NaN                     = NaN (unscorable, as TRL 1.16)
    # row 2: 2*1 + 3*0.5                 = 3.5
    # row 3: -1*1 + 4*0.5                = 1.0
    per_function = t([[1.0, NAN], [NAN, NAN], [2.0, 3.0], [-1.0, 4.0]])
    out = combine_rewards(per_function, t([1.0, 0.5]))
    torch.testing.assert_close(out, t([1.0, NAN, 3.5, 1.0]), atol=0, rtol=0, equal_nan=True)


def test_combine_rewards_nan_with_zero_weight_and_dtype():
    # NaN * 0 is still NaN, and still ignored: 0*NaN + 1*2 = 2 ; weights given as float32 are cast.
    out = combine_rewards(t([[NAN, 2.0]]), torch.tensor([0.0, 1.0]))
    assert out.dtype == F64
    torch.testing.assert_close(out, t([2.0]), atol=0, rtol=0)


def test_combine_rewards_shape_errors():
    with pytest.raises(ValueError, match="weights"):
        combine_rewards(t([[1.0, 2.0]]), t([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="per_function"):
        combine_rewards(t([1.0, 2.0]), t([1.0]))


# ---------------------------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------------------------
def test_group_scale_hand_values():
    # group 0 = [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    #   -> [-1, 0, 1] / (1 + 1e-4) = [-0.9999000099990001, 0, 0.9999000099990001]
    # group 1 = [5, 5, 5]: std 0 -> [0, 0, 0]
    adv, stats = group_advantages(t([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), num_generations=3)
    expected = t([-0.9999000099990001, 0.0, 0.9999000099990001, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    assert stats["reward"] == pytest.approx(21 / 6)  # 3.5
    # batch std: deviations from 3.5 squared 6.25 + 2.25 + 0.25 + 3 * 2.25 = 15.5, / 5 -> sqrt(3.1)
    assert stats["reward_std"] == pytest.approx(1.7606816861659009)
    assert stats["frac_reward_zero_std"] == pytest.approx(0.5)
    assert all(type(v) is float for v in stats.values())


def test_each_group_uses_its_own_std():
    # group 0 = [0, 3, 6]: mean 3, unbiased var (9 + 0 + 9) / 2 = 9, std 3
    #   -> [-3, 0, 3] / 3.0001 = [-0.9999666677777407, 0, 0.9999666677777407]
    # group 1 = [1, 1, 4]: mean 2, unbiased var (1 + 1 + 4) / 2 = 3, std sqrt(3) = 1.7320508075688772
    #   -> [-1, -1, 2] / 1.7321508075688772 = [-0.5773169377806823, -0.5773169377806823, 1.1546338755613645]
    adv, stats = group_advantages(t([0.0, 3.0, 6.0, 1.0, 1.0, 4.0]), num_generations=3)
    expected = t(
        [
            -0.9999666677777407,
            0.0,
            0.9999666677777407,
            -0.5773169377806823,
            -0.5773169377806823,
            1.1546338755613645,
        ]
    )
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    # batch std: mean 2.5, squared deviations 6.25 + 0.25 + 12.25 + 3 * 2.25 = 25.5, / 5 -> sqrt(5.1)
    assert stats["reward_std"] == pytest.approx(2.258317958127243)
    assert stats["reward"] == pytest.approx(15 / 6)
    assert stats["frac_reward_zero_std"] == 0.0


def test_group_std_is_unbiased():
    # [0, 2]: mean 1, unbiased std sqrt(((-1)^2 + 1^2) / (2 - 1)) = sqrt(2) (biased would be 1)
    #   -> +-1 / (1.4142135623730951 + 1e-4) = +-0.7070567847218314
    adv, stats = group_advantages(t([0.0, 2.0]), num_generations=2)
    torch.testing.assert_close(adv, t([-0.7070567847218314, 0.7070567847218314]), atol=1e-12, rtol=0)
    assert stats["reward_std"] == pytest.approx(math.sqrt(2))


@pytest.mark.parametrize(
    ("scale", "expected"),
    [
        # groups (0, 2) and (4, 6): means 1, 5 -> centred [-1, 1, -1, 1]
        # group: each group's unbiased std sqrt(2) -> +-1 / (sqrt(2) + 1e-4) = +-0.7070567847218314
        ("group", [-0.7070567847218314, 0.7070567847218314] * 2),
        # batch: mean 3, squared deviations 9 + 1 + 1 + 9 = 20, unbiased std sqrt(20/3) = 2.581988897471611
        #   -> +-1 / (2.581988897471611 + 1e-4) = +-0.3872833352016667
        ("batch", [-0.3872833352016667, 0.3872833352016667] * 2),
        # none (Dr.GRPO): centred rewards only
        ("none", [-1.0, 1.0, -1.0, 1.0]),
    ],
)
def test_scales_hand_values(scale, expected):
    adv, stats = group_advantages(t([0.0, 2.0, 4.0, 6.0]), num_generations=2, scale=scale)
    torch.testing.assert_close(adv, t(expected), atol=1e-12, rtol=0)
    assert stats["reward"] == pytest.approx(3.0)
    assert stats["reward_std"] == pytest.approx(math.sqrt(20 / 3))  # the batch's std, whatever the scale
    assert stats["frac_reward_zero_std"] == 0.0


def test_groups_are_contiguous_rows():
    # rows [0, 10 | 1, 11] with G = 2: groups (0, 10) and (1, 11), means 5 and 6 -> [-5, 5, -5, 5].
    # (Strided grouping (0, 1), (10, 11) would give [-0.5, -0.5, 0.5, 0.5].)
    adv, _ = group_advantages(t([0.0, 10.0, 1.0, 11.0]), num_generations=2, scale="none")
    torch.testing.assert_close(adv, t([-5.0, 5.0, -5.0, 5.0]), atol=0, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_std_groups_give_zero_advantage(scale):
    # [0.1, 0.1, 0.1] (mean may round) and [1, 1, 1]: every group has std 0, no NaN anywhere.
    adv, stats = group_advantages(t([0.1, 0.1, 0.1, 1.0, 1.0, 1.0]), num_generations=3, scale=scale)
    assert torch.all(torch.isfinite(adv))
    assert adv.abs().max().item() < 1e-9
    # the std the advantage is divided by: the groups' are 0, the batch's is not (TRL's figure)
    assert stats["frac_reward_zero_std"] == (0.0 if scale == "batch" else 1.0)
    # batch std: six deviations of +-0.45 from 0.55 -> sqrt(6 * 0.2025 / 5)
    assert stats["reward_std"] == pytest.approx(0.49295030175464945)


def test_single_generation_groups():
    # G = 1: reward minus itself is 0; the std of one sample is defined as 0 (no NaN).
    adv, stats = group_advantages(t([3.0, -1.0]), num_generations=1)
    torch.testing.assert_close(adv, t([0.0, 0.0]), atol=0, rtol=0)
    assert stats == {"reward": 1.0, "reward_std": pytest.approx(math.sqrt(8)), "frac_reward_zero_std": 1.0}


def test_combined_rewards_feed_advantages():
    # rewards from combine_rewards: [1 + 0, NaN (all NaN), 2 + 1, 4] -> groups (1, NaN), (3, 4)
    # scale none: group 0's mean is 1 (NaN left out): [0, 0 (unscorable)], group 1: [-0.5, 0.5]
    rewards = combine_rewards(t([[1.0, NAN], [NAN, NAN], [2.0, 1.0], [4.0, NAN]]), t([1.0, 1.0]))
    adv, _ = group_advantages(rewards, num_generations=2, scale="none")
    torch.testing.assert_close(adv, t([0.0, 0.0, -0.5, 0.5]), atol=0, rtol=0)


def test_integer_rewards_are_accepted():
    adv, _ = group_advantages(torch.tensor([0, 2]), num_generations=2, scale="none")
    assert adv.is_floating_point()
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0]), atol=0, rtol=0)


def test_errors():
    with pytest.raises(ValueError, match=r"\(7\).*\(3\)"):
        group_advantages(torch.zeros(7, dtype=F64), num_generations=3)
    with pytest.raises(ValueError, match="median") as info:
        group_advantages(torch.zeros(4, dtype=F64), num_generations=2, scale="median")
    assert all(name in str(info.value) for name in ("group", "batch", "none"))
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(4, dtype=F64), num_generations=0)
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(4, dtype=F64), num_generations=2, eps=0.0)
    group_advantages(torch.zeros(4, dtype=F64), num_generations=2, scale="none", eps=0.0)  # eps unused


# ---------------------------------------------------------------------------------------------
# unscorable completions, nanstd, normalize_then_sum (TRL 1.16)
# ---------------------------------------------------------------------------------------------
def test_nanstd_is_bessel_corrected_and_ignores_nan():
    x = t([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN]])
    # row 0: std of (1, 2, 3) = 1; row 1: one value -> NaN (undefined), as TRL's nanstd
    torch.testing.assert_close(nanstd(x, dim=1), t([1.0, NAN]), equal_nan=True)
    assert nanstd(t([0.0, 2.0])).item() == pytest.approx(math.sqrt(2))


def test_unscorable_completion_is_left_out_and_gets_zero_advantage():
    # group 0 = [1, NaN, 3, 5]: mean of (1, 3, 5) = 3, unbiased std 2 -> [-2, 0, 0, 2] / 2.0001
    # group 1 = [0, 0, 0, 4]: mean 1, std 2 -> [-1, -1, -1, 3] / 2.0001
    # (reward 0 instead of NaN would give group 0 mean 2.25 and the unscorable row -2.25 / 2.06...)
    rewards = t([1.0, NAN, 3.0, 5.0, 0.0, 0.0, 0.0, 4.0])
    adv, stats = group_advantages(rewards, num_generations=4)
    expected = t([-2.0, 0.0, 0.0, 2.0, -1.0, -1.0, -1.0, 3.0]) / 2.0001
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    # logged reward figures leave it out: mean of 7 values 13 / 7; std of those 7 (Bessel)
    scored = t([1.0, 3.0, 5.0, 0.0, 0.0, 0.0, 4.0])
    assert stats["reward"] == pytest.approx(13 / 7)
    assert stats["reward_std"] == pytest.approx(scored.std().item())
    assert stats["frac_reward_zero_std"] == 0.0


def test_group_with_one_scorable_completion_gets_zero_advantages():
    # [NaN, 2]: std undefined (NaN) -> every advantage 0 and the group does not count as zero-std (TRL)
    adv, stats = group_advantages(t([NAN, 2.0, 0.0, 1.0]), num_generations=2)
    assert adv[:2].tolist() == [0.0, 0.0]
    assert stats["frac_reward_zero_std"] == 0.0


def test_normalize_then_sum_hand_values():
    # G = 2, two functions, weights (1, 2):
    # f0 groups (0, 2), (1, 1): normalised [-1, 1] / (sqrt 2 + 1e-4), [0, 0]
    # f1 groups (1, NaN), (0, 4): [0, NaN], [-1, 1] * 2 / (2 sqrt 2 + 1e-4)
    per_function = t([[0.0, 1.0], [2.0, NAN], [1.0, 0.0], [1.0, 4.0]])
    w = t([1.0, 2.0])
    a = 1 / (math.sqrt(2) + 1e-4)
    b = 2 / (2 * math.sqrt(2) + 1e-4)
    summed = t([-a + 0.0, a, 0.0 - 2 * b, 0.0 + 2 * b])
    centred = summed - summed.mean()
    expected = centred / (summed.std() + 1e-4)
    adv, rewards, stats = advantages_of(per_function, w, 2, "group", "normalize_then_sum")
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(rewards, t([2.0, 2.0, 1.0, 9.0]), atol=0, rtol=0)
    assert stats["reward"] == pytest.approx(3.5)
    assert stats["frac_reward_zero_std"] == 0.0


def test_sum_then_normalize_is_combine_then_group():
    per_function = t([[0.0, 1.0], [2.0, NAN], [NAN, NAN], [1.0, 4.0]])
    w = t([1.0, 0.5])
    adv, rewards, stats = advantages_of(per_function, w, 2, "batch", "sum_then_normalize")
    ref_adv, ref_stats = group_advantages(combine_rewards(per_function, w), 2, scale="batch")
    torch.testing.assert_close(adv, ref_adv, atol=0, rtol=0)
    assert stats == ref_stats
    assert math.isnan(rewards[2].item()) and adv[2].item() == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        advantages_of(per_function, w, 2, "group", "sum")
