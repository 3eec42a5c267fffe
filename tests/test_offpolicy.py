"""The sampler's truncated importance weights (rl/offpolicy.py), against values computed by hand, and the
loss they enter (TRL's vLLM IS correction: the policy term only, before the KL)."""

from __future__ import annotations

import math

import pytest
import torch

from gpufleet.rl.losses import policy_loss
from gpufleet.rl.offpolicy import combine, sampler_stats, sampler_weights

# two completions of 3 tokens; the second has 2 valid tokens
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, -9.0]])
SAMPLING = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.1, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# old - sampling at valid tokens: [0.5, -1.0, 0.0], [0.0, -0.2]


def test_token_truncate_clamps_each_token():
    w, seen = sampler_weights(OLD, SAMPLING, MASK, "token_truncate", 0.5, 1.5)
    want = [[1.5, 0.5, 1.0], [1.0, math.exp(-0.2), 1.0]]  # e^0.5 = 1.65 -> 1.5, e^-1 = 0.37 -> 0.5
    torch.testing.assert_close(w, torch.tensor(want))
    assert sorted(seen.tolist()) == pytest.approx(sorted([1.5, 0.5, 1.0, 1.0, math.exp(-0.2)]))


def test_token_mask_zeroes_tokens_outside_and_keeps_the_raw_ratio_inside():
    w, _ = sampler_weights(OLD, SAMPLING, MASK, "token_mask", 0.5, 1.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [1.0, math.exp(-0.2), 1.0]]))


def test_sequence_modes_use_the_sum_of_the_log_ratios():
    first, second = math.exp(0.5 - 1.0), math.exp(-0.2)  # 0.607, 0.819
    w, seen = sampler_weights(OLD, SAMPLING, MASK, "sequence_truncate", None, 0.7)
    torch.testing.assert_close(w, torch.tensor([[first] * 3, [0.7] * 3]))
    assert seen.tolist() == pytest.approx([first, 0.7])
    w, _ = sampler_weights(OLD, SAMPLING, MASK, "sequence_mask", 0.65, 3.0)
    torch.testing.assert_close(w, torch.tensor([[0.0] * 3, [second] * 3]))
    with pytest.raises(ValueError, match="unknown importance sampling mode"):
        sampler_weights(OLD, SAMPLING, MASK, "sequence", None, 3.0)


def test_metrics_are_over_every_rank_s_values_not_a_mean_of_means():
    a = sampler_stats(OLD[:1], SAMPLING[:1], MASK[:1], torch.tensor([1.0, 2.0, 3.0]))
    b = sampler_stats(OLD[1:], SAMPLING[1:], MASK[1:], torch.tensor([0.0]))
    m = combine([a, b])
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.0 + 0.2) / 5)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(6 / 4)
    assert (m["sampling/importance_sampling_ratio/min"], m["sampling/importance_sampling_ratio/max"]) == (
        0.0,
        3.0,
    )
    empty = sampler_stats(OLD[:0], SAMPLING[:0], MASK[:0], torch.zeros(0))
    assert set(combine([empty]).values()) == {0.0}


def test_the_weights_multiply_the_policy_term_only():
    logp = OLD.clone().requires_grad_(True)
    ref = OLD - 0.3
    adv = torch.tensor([1.0, -1.0])
    kw = dict(ref_logprobs=ref, beta=0.1, loss_type="dapo", normalizer=5.0)
    w = torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, OLD, adv, MASK, sampler_weights=w, **kw)
    plain, stats = policy_loss(logp, OLD, adv, MASK, **kw)
    # on-policy the policy term is -A per token: row 1 doubled (3 tokens), row 2 dropped (2 tokens)
    kl = stats["kl"] * 5  # the masked sum of the KL (k3 of 0.3)
    assert plain.item() == pytest.approx((-3 + 2 + 0.1 * kl) / 5)
    assert loss.item() == pytest.approx((-6 + 0.1 * kl) / 5)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_weights_formed_in_the_loss_per_micro_batch_are_the_whole_batch_s(mode):
    """A rollout rank's batch used once: no log-prob pass of its own (`weigh` defers), the weights formed
    from each micro-batch's training forward (rl/sampler.py `in_loss`) are the whole batch's, and the
    micro-batches' metrics combine to the whole batch's."""
    from types import SimpleNamespace

    from gpufleet.rl import sampler
    from gpufleet.rl.batch import GenerationBatch

    algo = SimpleNamespace(
        importance_sampling_correction=True,
        importance_sampling_mode=mode,
        importance_sampling_clip_min=0.5,
        importance_sampling_clip_max=1.5,
    )
    rt = SimpleNamespace(distributed=False, policy_size=1)
    unusable = torch.nn.Sequential()  # a forward of it would fail: no pass may run
    p = SimpleNamespace(job=SimpleNamespace(algorithm=algo), rt=rt, train_model=unusable)
    p.remote = SimpleNamespace(version=3)
    ids = torch.ones(2, 4, dtype=torch.long)
    batch = GenerationBatch(ids, ids, MASK.float(), torch.zeros(2), None, None, 1)
    answer = SimpleNamespace(logprobs=SAMPLING, version=2)
    assert sampler.weigh(p, batch, answer, None) == {"rollout/staleness": 1.0}
    assert batch.sampler_weights is None and torch.equal(batch.sampling_logprobs, SAMPLING)
    whole, ratios = sampler_weights(OLD, SAMPLING, MASK, mode, 0.5, 1.5)
    shares = []
    for i, mb in enumerate(batch.split(1)):
        logp = OLD[i : i + 1].clone().requires_grad_(True)  # the training forward's log-probs
        shares.append(sampler.in_loss(p, logp, mb))
        torch.testing.assert_close(mb.sampler_weights, whole[i : i + 1])
        assert not mb.sampler_weights.requires_grad
    assert sampler.metrics(rt, shares) == pytest.approx(combine([sampler_stats(OLD, SAMPLING, MASK, ratios)]))
