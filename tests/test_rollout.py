"""The sampler: greedy == HF generate, per-row seeding, EOS masks, filters, and sequence log-probs."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.engine.rollout import Rollout, generate, left_pad
from gpufleet.engine.sampling import next_tokens as _sample
from gpufleet.models import load_causal_lm
from gpufleet.models.builtin import EOS_TOKEN_ID, PAD_TOKEN_ID, materialize


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return {
        name: load_causal_lm(str(materialize(name, root=root))).eval()
        for name in ("tiny-qwen2", "tiny-llama")
    }


@pytest.fixture(scope="module")
def model(models):
    return models["tiny-qwen2"]


def random_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 12) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(2, 86) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]


def sample(model, prompts, seeds, **kw) -> Rollout:
    kw = {"max_new_tokens": 12, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID} | kw
    return generate(model, prompts, seeds=seeds, **kw)


class EosBoost(torch.nn.Module):
    """Wraps a model (like DDP does: the HF model is ``.module``) and adds ``boost`` to the EOS logit."""

    def __init__(self, module: torch.nn.Module, boost: float):
        super().__init__()
        self.module, self.boost = module, boost

    def forward(self, **kwargs):
        out = self.module(**kwargs)
        out.logits[..., EOS_TOKEN_ID] += self.boost
        return out


NEVER = (PAD_TOKEN_ID,)  # the built-in models: <pad> is not <eos>, so it is never sampled nor scored


def pad_favoured(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an untied ``model`` whose pad logit is 1.05x that of its most frequent greedy token, so
    pad wins wherever that token would (a random model where pad is a live token, made obvious)."""
    probe = sample(model, random_prompts(8, seed=10), list(range(8)), temperature=0.0)
    top = int(torch.mode(probe.completion_ids.flatten()).values)
    favoured = copy.deepcopy(model)
    with torch.no_grad():
        favoured.lm_head.weight[PAD_TOKEN_ID] = 1.05 * favoured.lm_head.weight[top]
    return favoured


@pytest.mark.parametrize(("name", "never"), [("tiny-qwen2", ()), ("tiny-llama", ()), ("tiny-llama", NEVER)])
def test_greedy_equals_hf_generate(models, name, never):
    """Our greedy tokens are HF's; with pad suppressed (on a model where pad would win), HF's with
    ``suppress_tokens``."""
    model = pad_favoured(models[name]) if never else models[name]
    prompts = random_prompts(6, seed=1)
    ours = sample(model, prompts, list(range(6)), temperature=0.0, max_new_tokens=16, suppress_tokens=never)
    ids, mask = left_pad(prompts, PAD_TOKEN_ID)
    assert torch.equal(ours.prompt_ids, ids) and torch.equal(ours.prompt_mask, mask)
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=16,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        suppress_tokens=list(never) or None,
    )[:, ids.shape[1] :]
    assert torch.equal(ours.completion_ids, ref[:, : ours.completion_ids.shape[1]])
    if never:
        free = sample(model, prompts, list(range(6)), temperature=0.0, max_new_tokens=16)
        assert (free.completion_ids[free.completion_mask.bool()] == PAD_TOKEN_ID).any()  # pad is live here
        assert not (ours.completion_ids[ours.completion_mask.bool()] == PAD_TOKEN_ID).any()


def test_same_seed_same_completion_other_seed_differs(model):
    prompts = random_prompts(4)
    a = sample(model, prompts, [1, 2, 3, 4])
    b = sample(model, prompts, [1, 2, 3, 4])
    c = sample(model, prompts, [5, 6, 7, 8])
    assert a.completions() == b.completions()
    assert a.completions() != c.completions()


def test_row_depends_only_on_its_prompt_and_seed(model):
    prompts = random_prompts(8, seed=2)
    seeds = [100 + i for i in range(8)]
    whole = sample(model, prompts, seeds).completions()
    reversed_ = sample(model, prompts[::-1], seeds[::-1]).completions()[::-1]
    first = sample(model, prompts[:3], seeds[:3]).completions()
    rest = sample(model, prompts[3:], seeds[3:]).completions()
    alone = [sample(model, [p], [s]).completions()[0] for p, s in zip(prompts[:2], seeds[:2], strict=True)]
    # The same prompt twice in a batch with different seeds: rows are independent streams.
    twin = sample(model, [prompts[0], prompts[0]], [seeds[0], 999]).completions()
    assert reversed_ == whole
    assert first + rest == whole
    assert alone == whole[:2]
    assert twin[0] == whole[0] and twin[1] != whole[0]


def test_eos_masking_and_truncation(model):
    boosted = EosBoost(model, boost=3.0)  # ~20% EOS per token: a mix of finished and truncated rows
    out = sample(boosted, random_prompts(16, seed=3), list(range(16)), max_new_tokens=10)
    ids, mask = out.completion_ids, out.completion_mask
    assert ids.shape == mask.shape == (16, 10)
    finished = 0
    for row_ids, row_mask, length, truncated in zip(
        ids.tolist(), mask.tolist(), out.completion_lengths.tolist(), out.is_truncated.tolist(), strict=True
    ):
        if EOS_TOKEN_ID in row_ids:
            first = row_ids.index(EOS_TOKEN_ID)
            assert row_mask == [1] * (first + 1) + [0] * (9 - first)
            assert all(t == PAD_TOKEN_ID for t in row_ids[first + 1 :])
            assert length == first + 1 and not truncated
            finished += 1
        else:
            assert row_mask == [1] * 10 and length == 10 and truncated
    assert 0 < finished < 16
    assert [len(c) for c in out.completions()] == out.completion_lengths.tolist()


def test_stops_early_when_every_row_is_done(model):
    out = sample(EosBoost(model, boost=50.0), random_prompts(5), list(range(5)), max_new_tokens=20)
    assert out.completion_ids.tolist() == [[EOS_TOKEN_ID]] * 5
    assert out.completion_lengths.tolist() == [1] * 5 and not out.is_truncated.any()


def test_rollout_full_sequence_helpers(model):
    prompts = random_prompts(3, seed=4)
    out = sample(model, prompts, [0, 1, 2], max_new_tokens=5)
    p = out.completion_start
    assert out.input_ids.shape == out.attention_mask.shape == (3, p + out.completion_ids.shape[1])
    assert torch.equal(out.input_ids[:, :p], out.prompt_ids)
    assert torch.equal(out.attention_mask[:, p:], out.completion_mask)
    for row, prompt in zip(out.input_ids.tolist(), prompts, strict=True):
        assert row[p - len(prompt) : p] == prompt


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    prompts, seeds = random_prompts(6, seed=5), list(range(6))
    greedy = sample(model, prompts, seeds, temperature=0.0).completions()
    assert sample(model, prompts, seeds, top_k=1).completions() == greedy
    assert sample(model, prompts, seeds, top_p=1e-6, temperature=2.0).completions() == greedy


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (0, 0.2), (5, 0.5)])
def test_filters_restrict_the_support(model, top_k, top_p):
    temperature = 0.8
    out = sample(
        model, random_prompts(8, seed=6), list(range(8)), temperature=temperature, top_k=top_k, top_p=top_p
    )
    logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask).logits
    logits = logits[:, out.completion_start - 1 : -1].float() / temperature
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = (order == out.completion_ids.unsqueeze(-1)).float().argmax(dim=-1)  # rank of each sampled token
    mass_before = (sorted_probs.cumsum(-1) - sorted_probs).gather(-1, rank.unsqueeze(-1)).squeeze(-1)
    valid = out.completion_mask.bool()
    if top_k:
        assert (rank[valid] < top_k).all()
    assert (mass_before[valid] < top_p + 1e-6).all()
    unfiltered = sample(model, random_prompts(8, seed=6), list(range(8)), temperature=temperature)
    assert unfiltered.completions() != out.completions()


def test_inverse_cdf_sampling_matches_the_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 10) * 2
    logits[0, 3] = float("-inf")  # probability 0: must never be drawn
    n = 40_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(1)).double()
    tokens = _sample(logits.expand(n, -1), uniforms, temperature=1.0, top_p=1.0, top_k=0)
    freq = torch.bincount(tokens, minlength=10).double() / n
    expected = torch.softmax(logits[0].double(), dim=-1)
    assert freq[3] == 0
    assert torch.allclose(freq, expected, atol=4 * (0.25 / n) ** 0.5)  # 4 sigma, binomial worst case
    edge = _sample(logits.expand(2, -1), torch.tensor([0.0, 1 - 2**-24]).double(), 1.0, 1.0, 0)
    assert edge.tolist() == [int(expected.nonzero()[0]), int(expected.nonzero()[-1])]


def test_generate_validates_and_restores_training_mode(model):
    with pytest.raises(ValueError, match="one seed per row"):
        sample(model, [[5, 6]], [1, 2])
    with pytest.raises(ValueError, match="at least one token"):
        sample(model, [[5, 6], []], [1, 2])
    model.train()
    try:
        sample(model, [[5, 6]], [1], max_new_tokens=2)
        assert model.training
    finally:
        model.eval()


def naive_logprobs(model, ids, mask, start, temperature):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, start - 1 : -1] / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, start:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def assert_equal_to_naive(model, out: Rollout, logp, entropy, naive) -> None:
    """``logp``/``entropy`` (with grad) equal ``naive`` ones at the valid tokens, and so do their gradients."""
    valid = out.completion_mask.bool()
    model.zero_grad()
    (logp * valid).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_logp, ref_entropy = naive
    (ref_logp * valid).sum().backward()
    assert torch.allclose(logp[valid], ref_logp[valid], atol=1e-5)
    assert torch.allclose(entropy[valid], ref_entropy[valid], atol=1e-5)
    for got, ref in zip(grads, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(got, ref, atol=1e-5)
    model.zero_grad()


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, None), (0.7, 3)])
def test_sequence_logprobs_equal_naive_softmax_and_carry_gradients(model, temperature, chunk):
    out = sample(EosBoost(model, 2.0), random_prompts(5, seed=7), list(range(5)), max_new_tokens=8)
    ids, mask, start = out.input_ids, out.attention_mask, out.completion_start
    valid = out.completion_mask.bool()

    logp, entropy = sequence_logprobs(model, ids, mask, start, temperature=temperature, chunk=chunk)
    assert logp.shape == entropy.shape == out.completion_ids.shape
    assert_equal_to_naive(model, out, logp, entropy, naive_logprobs(model, ids, mask, start, temperature))

    with torch.no_grad():
        nograd_logp, _ = sequence_logprobs(model, ids, mask, start, temperature=temperature)
    assert not nograd_logp.requires_grad
    assert torch.allclose(nograd_logp[valid], logp[valid].detach(), atol=1e-6)


def test_sampled_tokens_have_the_generating_distribution_logprobs(model):
    """Greedy tokens are the argmax of the same conditional that sequence_logprobs scores."""
    out = sample(model, random_prompts(4, seed=8), list(range(4)), temperature=0.0, max_new_tokens=6)
    with torch.no_grad():
        logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask).logits
        logp, _ = sequence_logprobs(model, out.input_ids, out.attention_mask, out.completion_start)
    best = torch.log_softmax(logits[:, out.completion_start - 1 : -1], -1).max(-1).values
    valid = out.completion_mask.bool()
    assert torch.allclose(logp[valid], best[valid], atol=1e-5)


def naive_suppressed_logprobs(model, ids, mask, start, temperature):
    """Log-probs and entropies over the vocabulary without pad: its column dropped before the softmax."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, start - 1 : -1] / temperature
    keep = [i for i in range(logits.shape[-1]) if i != PAD_TOKEN_ID]
    logp_all = torch.log_softmax(logits[..., keep], dim=-1)
    targets = ids[:, start:].clamp(min=1) - 1  # pad (id 0) only follows EOS: masked, any index will do
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_suppressed_sampling_and_scoring_are_one_distribution(models, temperature):
    model = pad_favoured(models["tiny-llama"])
    prompts, seeds = random_prompts(8, seed=11), list(range(8))
    boosted = EosBoost(model, 2.0)  # some rows end early: padding after their EOS
    out = sample(boosted, prompts, seeds, temperature=temperature, suppress_tokens=NEVER)
    valid = out.completion_mask.bool()
    assert not (out.completion_ids[valid] == PAD_TOKEN_ID).any() and not valid.all()
    ids, mask, start = out.input_ids, out.attention_mask, out.completion_start
    logp, entropy = sequence_logprobs(model, ids, mask, start, temperature=temperature, suppress_tokens=NEVER)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert (logp[~valid] == 0).all()  # the padding after EOS holds pad: log-prob 0, masked by callers
    assert_equal_to_naive(
        model, out, logp, entropy, naive_suppressed_logprobs(model, ids, mask, start, temperature)
    )


def naive_early_logprobs(model, ids, mask, start, temperature, min_new_tokens):
    """Log-probs and entropies with pad dropped everywhere and EOS dropped too before ``min_new_tokens``."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, start - 1 : -1] / temperature
    logps, entropies = [], []
    for t in range(logits.shape[1]):
        drop = {PAD_TOKEN_ID} | ({EOS_TOKEN_ID} if t < min_new_tokens else set())
        keep = [i for i in range(logits.shape[-1]) if i not in drop]
        logp_all = torch.full_like(logits[:, t], float("-inf"))
        logp_all[:, keep] = torch.log_softmax(logits[:, t, keep], dim=-1)
        logps.append(logp_all.gather(-1, ids[:, start + t, None]).squeeze(-1))
        p_keep = logp_all[:, keep].exp()
        entropies.append(-(p_keep * logp_all[:, keep]).sum(-1))
    return torch.stack(logps, 1), torch.stack(entropies, 1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_min_new_tokens_sampling_and_scoring_are_one_distribution(models, temperature, monkeypatch):
    """EOS before ``min_new_tokens`` is never sampled (on a model that would stop at once), and the
    log-probs, entropies and gradients are those of the distribution without it there."""
    monkeypatch.setenv("GPUFLEET_PACKED", "0")  # with min_new_tokens the rows are not packed: nor here
    model = models["tiny-llama"]
    prompts, seeds = random_prompts(8, seed=12), list(range(8))
    boosted = EosBoost(model, 4.0)
    free = sample(boosted, prompts, seeds, temperature=temperature, suppress_tokens=NEVER)
    assert (free.completion_lengths < 4).any()  # without the rule, rows stop early
    out = sample(boosted, prompts, seeds, temperature=temperature, suppress_tokens=NEVER, min_new_tokens=4)
    assert (out.completion_lengths >= 5).all() and not out.is_truncated.all()  # some stop, none before 4
    ids, mask, start = out.input_ids, out.attention_mask, out.completion_start
    kw = {"temperature": temperature, "suppress_tokens": NEVER, "eos_token_id": EOS_TOKEN_ID}
    logp, entropy = sequence_logprobs(model, ids, mask, start, min_new_tokens=4, chunk=3, **kw)
    naive = naive_early_logprobs(model, ids, mask, start, temperature, 4)
    assert_equal_to_naive(model, out, logp, entropy, naive)
    plain, _ = sequence_logprobs(model, ids, mask, start, **kw)
    assert (logp[:, :4] > plain[:, :4]).all() and torch.equal(logp[:, 4:], plain[:, 4:])


def test_min_new_tokens_greedy_equals_hf_generate(models):
    model = EosBoost(models["tiny-qwen2"], 6.0)  # greedy would stop at once
    prompts = random_prompts(6, seed=3)
    ours = sample(model, prompts, list(range(6)), temperature=0.0, max_new_tokens=10, min_new_tokens=3)
    assert (ours.completion_lengths == 4).all()  # the first EOS allowed is taken
    ids, mask = left_pad(prompts, PAD_TOKEN_ID)
    hf = models["tiny-qwen2"]
    orig = hf.forward

    def boosted(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.logits[..., EOS_TOKEN_ID] += 6.0
        return out

    hf.forward = boosted
    try:
        ref = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=10,
            min_new_tokens=3,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=PAD_TOKEN_ID,
        )[:, ids.shape[1] :]
    finally:
        del hf.forward
    assert torch.equal(ours.completion_ids, ref[:, : ours.completion_ids.shape[1]])


def test_sampling_settings_generate_what_generate_does(model):
    """The engine's one call (prompts, seeds, settings -> tokens) is `generate` with those keywords."""
    from gpufleet.engine.rollout import Sampling

    prompts, seeds = random_prompts(6, seed=3), [11, 12, 13, 14, 15, 16]
    settings = Sampling(EOS_TOKEN_ID, PAD_TOKEN_ID, 0.9, 0.95, 20, NEVER, 2)
    got = settings.generate(model, prompts, seeds, 10)
    want = sample(
        model,
        prompts,
        seeds,
        max_new_tokens=10,
        temperature=0.9,
        top_p=0.95,
        top_k=20,
        suppress_tokens=NEVER,
        min_new_tokens=2,
    )
    for name in Rollout.__dataclass_fields__:
        x, y = getattr(got, name), getattr(want, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert not torch.equal(
        got.completion_ids, sample(model, prompts, seeds, max_new_tokens=10).completion_ids
    )
