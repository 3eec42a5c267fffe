"""The GRPO family's newer members against hand-computed values (float64): CISPO, SAPO, LUSPO, VESPO, the
off-policy sequence mask, token weights; each formula as TRL 1.16's `GRPOTrainer._compute_loss` writes it."""

from __future__ import annotations

import math

import pytest
import torch

from gpufleet.rl.losses import LOSS_TYPES, Loss, LossOptions, policy_loss

F64 = torch.float64


def inputs(log_ratio, advantages, logprobs):
    """logprobs (leaf), old = logprobs - log_ratio, advantages, an all-ones mask."""
    lp = torch.tensor(logprobs, dtype=F64, requires_grad=True)
    old = (lp.detach() - torch.tensor(log_ratio, dtype=F64)).detach()
    return lp, old, torch.tensor(advantages, dtype=F64), torch.ones_like(old)


def run(lp, *args, **kwargs):
    lp.grad = None
    loss, stats = policy_loss(lp, *args, **kwargs)
    loss.backward()
    return loss.item(), lp.grad.clone(), stats


# CISPO: ratios r = [2, 0.5], A = 1, logp = [-1, -2], epsilon_high 1.5: weights sg(min(r, 1.5)) = [1.5, 0.5]
#   per token -w A logp = [1.5, 1.0]; global token mean 2.5 / 2 = 1.25; grad -w A / 2 = [-0.75, -0.25]
#   cispo_clip_ratio: r > 1.5 with A > 0 -> token 0 -> 1/2
def test_cispo_hand_values():
    lp, old, adv, mask = inputs([[math.log(2.0), math.log(0.5)]], [1.0], [[-1.0, -2.0]])
    loss, grad, stats = run(lp, old, adv, mask, loss_type="cispo", epsilon_high=1.5)
    assert loss == pytest.approx(1.25, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-0.75, -0.25]], dtype=F64), atol=1e-12, rtol=0)
    assert stats["cispo_clip_ratio"] == pytest.approx(0.5)
    assert "clip_ratio/low_mean" not in stats


# SAPO: gate g(r) = sigmoid(tau (r - 1)) 4 / tau, per token -g A; d/dlogp = -4 s (1 - s) r A (s the sigmoid)
#   A = 1 (tau_pos 1.0), r = [2, 0.5]; A = -1 (tau_neg 1.05), r = [1.5, 1]; grpo mean of sequence means
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_sapo_hand_values(adv):
    ratios = [2.0, 0.5] if adv > 0 else [1.5, 1.0]
    tau = 1.0 if adv > 0 else 1.05
    lp, old, a, mask = inputs([[math.log(r) for r in ratios]], [adv], [[-1.0, -2.0]])
    loss, grad, stats = run(lp, old, a, mask, loss_type="sapo")
    s = [1 / (1 + math.exp(-tau * (r - 1))) for r in ratios]
    assert loss == pytest.approx(-sum(si * 4 / tau * adv for si in s) / 2, abs=1e-12)
    expected = [-4 * si * (1 - si) * r * adv / 2 for si, r in zip(s, ratios, strict=True)]
    torch.testing.assert_close(grad, torch.tensor([expected], dtype=F64), atol=1e-12, rtol=0)
    assert stats.keys() == {"kl"}  # TRL logs no clip ratios for sapo


def test_sapo_is_grpo_on_policy_in_gradient():
    # at r = 1: s = 1/2, slope 4 s (1 - s) = 1: the same gradient as PPO's r A (inside the clip)
    lp, old, adv, mask = inputs([[0.0, 0.0], [0.0, 0.0]], [1.0, -2.0], [[-1.0, -2.0], [-0.5, -3.0]])
    _, g_sapo, _ = run(lp, old, adv, mask, loss_type="sapo")
    _, g_grpo, _ = run(lp, old, adv, mask, loss_type="grpo")
    torch.testing.assert_close(g_sapo, g_grpo, atol=1e-12, rtol=0)


# LUSPO, token level on case A of test_losses: per-token losses row 0 [-1.1, -1.2], row 1 [1.8, 1.6, 2.6]
#   sums -2.3 and 6.0, mean over the 2 sequences 1.85 (grpo would average the token means: 0.425)
def test_luspo_sums_tokens_per_sequence():
    ratios = [[1.1, 1.5, 0.5], [0.9, 0.7, 1.3]]
    lp, old, adv, _ = inputs([[math.log(r) for r in row] for row in ratios], [1.0, -2.0], [[-1.0] * 3] * 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    loss, _, _ = run(lp, old, adv, mask, loss_type="luspo")
    assert loss == pytest.approx(1.85, abs=1e-12)
    assert policy_loss(lp, old, adv, mask, loss_type="luspo", normalizer=4.0)[0].item() == pytest.approx(
        3.7 / 4
    )


# VESPO: one sequence, log-ratios [log 2, 0] -> w = 2; A = 1 >= 0: k 2, lambda 3:
#   phi = exp(3 + 2 log 2 - 3 * 2) = 4 e^-3 = 0.19914827347145578 (detached)
#   per token -phi A logp, logp = [-1, -2]: token mean 3 phi / 2; grad -phi A / 2 each
#   A = -1: k 3, lambda 2: phi = exp(2 + 3 log 2 - 4) = 8 e^-2 = 1.0826822658929016
@pytest.mark.parametrize(("adv", "phi"), [(1.0, 4 * math.exp(-3)), (-1.0, 8 * math.exp(-2))])
def test_vespo_hand_values(adv, phi):
    lp, old, a, mask = inputs([[math.log(2.0), 0.0]], [adv], [[-1.0, -2.0]])
    loss, grad, stats = run(lp, old, a, mask, loss_type="vespo")
    assert loss == pytest.approx(3 * phi * adv / 2, abs=1e-12)
    torch.testing.assert_close(grad, torch.full((1, 2), -phi * adv / 2, dtype=F64), atol=1e-12, rtol=0)
    assert stats["vespo/phi_seq_mean"] == pytest.approx(phi)


def test_vespo_on_policy_weight_is_one():
    # w = 1: phi = e^(lambda - lambda) = 1, so on-policy vespo is REINFORCE with a token mean
    lp, old, adv, mask = inputs([[0.0, 0.0]], [1.0], [[-1.0, -2.0]])
    _, _, stats = run(lp, old, adv, mask, loss_type="vespo")
    assert stats["vespo/phi_seq_mean"] == pytest.approx(1.0)


# Off-policy sequence mask, threshold 0.5: row 0 A = -1, mean(log pi_old - log pi) = 0.6 > 0.5 -> dropped;
#   row 1 A = -1, 0.1 -> kept; row 2 A = +1, 0.6 -> kept (positive advantages are never dropped)
def test_off_policy_mask_drops_only_far_negative_sequences():
    log_ratio = [[-0.6, -0.6], [-0.1, -0.1], [-0.6, -0.6]]
    lp, old, adv, mask = inputs(log_ratio, [-1.0, -1.0, 1.0], [[-1.0, -1.0]] * 3)
    _, grad, _ = run(lp, old, adv, mask, options=LossOptions(off_policy_mask_threshold=0.5))
    _, full, _ = run(lp, old, adv, mask)
    assert torch.all(grad[0] == 0)
    torch.testing.assert_close(grad[1:], full[1:], atol=0, rtol=0)


def test_token_weights_gate_the_policy_term_not_the_kl():
    lp, old, adv, mask = inputs([[0.0, 0.0]], [1.0], [[-1.0, -2.0]])
    ref = lp.detach() + torch.tensor([[0.5, -0.5]], dtype=F64)
    w = torch.tensor([[1.0, 0.0]], dtype=F64)
    _, grad, _ = run(lp, old, adv, mask, ref_logprobs=ref, beta=0.1, token_weights=w)
    # token 0: policy -A/2 plus KL 0.05 (1 - e^0.5); token 1: KL only, 0.05 (1 - e^-0.5)
    expected = [[-0.5 + 0.05 * (1 - math.exp(0.5)), 0.05 * (1 - math.exp(-0.5))]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_the_whole_for_every_loss_type(loss_type):
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(4, 5, generator=g, dtype=F64) - 2).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(4, 5, generator=g, dtype=F64)
    ref = lp.detach() + 0.3 * torch.randn(4, 5, generator=g, dtype=F64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=F64)
    level = "sequence" if loss_type == "luspo" else "token"
    loss = Loss(
        loss_type, level, 0.2, 0.28, 0.04, 5, True, LossOptions(delta=1.5, off_policy_mask_threshold=0.1)
    )
    tokens = int(mask.sum())

    class B:  # the batch noun Loss takes
        def __init__(self, rows):
            self.old_logprobs, self.ref_logprobs = old[rows], ref[rows]
            self.advantages, self.completion_mask = adv[rows], mask[rows]

    norm = loss.normalizer(4, tokens, tokens, 1)
    whole = torch.autograd.grad(loss(lp, B(slice(0, 4)), norm)[0], lp)[0]
    parts = sum(torch.autograd.grad(loss(lp[r], B(r), norm)[0], lp)[0] for r in (slice(0, 1), slice(1, 4)))
    torch.testing.assert_close(parts, whole, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------
# check: the combinations TRL warns about, each with a fix
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sets", "field", "fix"),
    [
        (
            ["algorithm.loss_type=luspo", "algorithm.importance_level=token"],
            "algorithm.loss_type",
            "sequence",
        ),
        (
            ["algorithm.loss_type=vespo", "algorithm.importance_level=sequence"],
            "algorithm.loss_type",
            "=token",
        ),
        (["algorithm.name=gspo", "algorithm.loss_type=dapo"], "algorithm.loss_type", "loss_type=grpo"),
        (["algorithm.name=gspo", "algorithm.loss_type=cispo"], "algorithm.loss_type", "loss_type=grpo"),
        (["algorithm.delta=1.1"], "algorithm.delta", "algorithm.delta="),
        (["algorithm.loss_type=cispo", "algorithm.epsilon_high=0.28"], "algorithm.epsilon_high", "5.0"),
        (
            ["algorithm.off_policy_mask_threshold=0.5"],
            "algorithm.off_policy_mask_threshold",
            "num_iterations=2",
        ),
    ],
)
def test_check_warns_with_a_fix(sets, field, fix):
    from gpufleet.config.load import load_job
    from gpufleet.hardware import parse_gpu_spec
    from gpufleet.rules import run_checks

    problems, _ = run_checks(load_job(None, sets, {}), parse_gpu_spec("cpu"), {})
    named = [p for p in problems if p.field == field]
    assert named and all(p.severity == "warning" for p in named), [p.render() for p in problems]
    assert any(fix in p.fix for p in named), [p.render() for p in named]


@pytest.mark.parametrize("name", ["cispo", "sapo", "luspo", "vespo"])
def test_presets_of_the_new_loss_types_check_clean(name):
    from gpufleet.config.load import load_job
    from gpufleet.hardware import parse_gpu_spec
    from gpufleet.rules import run_checks

    r = load_job(None, [f"algorithm.name={name}"], {})
    assert r.job.algorithm.loss_type == name
    problems, _ = run_checks(r, parse_gpu_spec("cpu"), {})
    assert not [p for p in problems if p.field.startswith("algorithm.")], [p.render() for p in problems]


# ---------------------------------------------------------------------------------------------
# the generation step: unscorable completions and truncated completions on a real tiny model
# ---------------------------------------------------------------------------------------------
def none_for_first(prompts, completions, **kw):
    """Reward function of the test below: None for the first completion of each call, else its length."""
    return [None if i == 0 else float(len(c)) for i, c in enumerate(completions)]


def test_generation_step_unscorable_and_truncated(tmp_path, capsys, monkeypatch):
    from gpufleet.config.load import load_job
    from gpufleet.rl import trainer

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    sets = [
        "rollout.max_prompt_length=8",
        "rollout.max_completion_length=4",
        "algorithm.num_generations=4",
        "train.per_device_batch=8",
        "reward.functions=test_family:none_for_first",
        "algorithm.mask_truncated_completions=true",
        f"output.dir={tmp_path}/run",
    ]
    job = load_job(None, sets, env={}).job
    parts = trainer.build(job)
    s = trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    assert "every reward function returned None for 1 completion(s)" in capsys.readouterr().err
    assert math.isnan(s.rewards[0].item()) and s.batch.advantages[0].item() == 0.0
    scored = s.rewards[1:4]
    assert s.batch.advantages[1:4].tolist() == pytest.approx(
        ((scored - scored.mean()) / (scored.std() + 1e-4)).tolist()
    )
    assert s.stats["reward"] == pytest.approx(s.rewards[1:].mean().item())  # the NaN row left out
    cut = s.rollout.is_truncated
    assert cut.any(), "max_completion_length 4 should cut some random completions"
    assert torch.all(s.batch.completion_mask[cut] == 0)
    assert torch.equal(s.batch.completion_mask[~cut], s.rollout.completion_mask[~cut].float())


# ---------------------------------------------------------------------------------------------
# reference sync (TR-DPO): reference <- alpha policy + (1 - alpha) reference
# ---------------------------------------------------------------------------------------------
def test_mix_into_hand_values():
    from gpufleet.rl.refsync import due, mix_into

    ref, pol = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([[1.0, -2.0]]))
        pol.weight.copy_(torch.tensor([[3.0, 2.0]]))
    mix_into(ref, dict(pol.named_parameters()), 0.25)  # 0.25 * [3, 2] + 0.75 * [1, -2] = [1.5, -1.0]
    assert ref.weight.tolist() == [[1.5, -1.0]]
    from gpufleet.config.load import load_job

    job = load_job(None, ["algorithm.sync_ref_model=true", "algorithm.ref_model_sync_steps=4"], {}).job
    assert [s for s in range(1, 13) if due(job, s)] == [4, 8, 12]


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (["algorithm.sync_ref_model=true"], "algorithm.sync_ref_model"),  # beta 0
        (
            ["algorithm.sync_ref_model=true", "algorithm.beta=0.04", "model.use_peft=true"],
            "algorithm.sync_ref_model",
        ),
    ],
)
def test_check_refuses_reference_sync_without_a_movable_reference(sets, field):
    from gpufleet.config.load import load_job
    from gpufleet.hardware import parse_gpu_spec
    from gpufleet.rules import run_checks

    problems, _ = run_checks(load_job(None, sets, {}), parse_gpu_spec("cpu"), {})
    assert any(p.severity == "error" and p.field == field for p in problems), [p.render() for p in problems]
