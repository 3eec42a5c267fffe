"""Gradient equality with TRL 1.16, option by option, on one fixed batch (runs in `.bench-venv`).

    python bench/trl_grad_equal.py            # sets up .bench-venv once (trl==1.16.0), then re-executes there

The same builtin tiny Qwen2 weights, 2 prompts x G=4 forced completions (different lengths, one cut at
max_completion_length, junk after EOS), a perturbed reference and (off-policy cases) perturbed old
log-probs, fp32. TRL's side: `GRPOTrainer._compute_loss` (what `training_step` runs after generation) on
the batch in one pass, then backward. gpufleet's side: `optimizer_step` (rl/update.py) on the same batch with
micro-batch 8 and 2. Printed per case: the max |grad difference| over every parameter (either micro-batch
size), |loss difference| and the largest difference of the logged kl / entropy / clip figures. A second
table runs TRL's `_generate_and_score_completions` (its `_generate` replaced by the forced completions)
with two reward functions returning None in places, and compares the advantages and reward metrics with
gpufleet's `advantages_of`, for both reward aggregations and the three reward scales. The third and fourth
parts are in trl_tools_equal.py: a tool-calling case (TRL's own tool loop vs gpufleet's chat episodes: ids,
loss mask, the tool-result splice, at the end of max_completion_length too, then the gradient) and the
reward arguments of a single-turn batch on chat-format data.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchvenv import SRC, in_bench_venv, reexec_in_bench_venv  # noqa: E402

G, P, L = 4, 2, 6  # generations, prompts, max_completion_length


def fixed_batch(tok, seed: int = 0):
    """Prompt ids (equal lengths: no left padding), completion ids and their loss mask (EOS included)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = ["a:", "b:"]
    prompt_ids = torch.tensor(
        [tok(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(G)]
    )
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ordinary = [i for i in range(len(tok)) if i not in (eos, pad)]
    lengths = [3, 6, 2, 5, 6, 4, 1, 3]  # 6 = L without EOS: cut at max_completion_length (rows 1 and 4)
    ids = torch.tensor(ordinary)[torch.randint(len(ordinary), (P * G, L), generator=g)]
    mask = torch.zeros(P * G, L)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
        if n < L:
            ids[r, n - 1] = eos  # EOS ends it; the tokens after it are junk (masked out)
    return (
        prompts,
        prompt_ids,
        ids,
        mask,
        torch.tensor([n == L and ids[r, -1] != eos for r, n in enumerate(lengths)]),
    )


CASES_OPTIONS = {
    "plain": {},
    "delta=1.3": {"delta": 1.3},
    "off_policy_mask=0.02": {"off_policy_mask_threshold": 0.02},
    "mask_truncated": {"mask_truncated_completions": True},
    "top_entropy=0.3": {"top_entropy_quantile": 0.3},
    "entropy_coef=0.05": {"entropy_coef": 0.05},
    "entropy_coef=0.05+top_entropy=0.5": {"entropy_coef": 0.05, "top_entropy_quantile": 0.5},
}


def cases():
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        for level in ("token", "sequence"):
            for off_policy in (False, True):
                for bias in (True, False):
                    yield loss_type, level, off_policy, bias, "plain", {}
    for name, opts in CASES_OPTIONS.items():
        if name != "plain":
            for bias in (True, False):
                yield "grpo", "token", True, bias, name, opts


def trl_side(trainer, model, inputs, loss_type, level, bias, opts):
    """TRL's loss, grads and logged figures on `inputs` in one forward pass."""
    a = trainer.args
    trainer.loss_type, trainer.importance_sampling_level = loss_type, level
    a.use_bias_correction_kl, a.delta = bias, opts.get("delta")
    trainer.off_policy_mask_threshold = opts.get("off_policy_mask_threshold")
    trainer.top_entropy_quantile = opts.get("top_entropy_quantile", 1.0)
    trainer.entropy_coef = opts.get("entropy_coef", 0.0)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    trainer.epsilon_low, trainer.epsilon_high = 0.2, eps_high
    trainer._metrics["train"].clear()
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    figures = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return loss.item(), grads, figures


def gpufleet_side(parts, batch, micro, loss_type, level, bias, opts, length=L):
    import torch

    from gpufleet.rl.entropy import EntropyControl
    from gpufleet.rl.losses import Loss, LossOptions
    from gpufleet.rl.precision import autocast_for
    from gpufleet.rl.update import optimizer_step

    eps_high = 5.0 if loss_type == "cispo" else 0.28
    options = LossOptions(
        delta=opts.get("delta"), off_policy_mask_threshold=opts.get("off_policy_mask_threshold")
    )
    parts.loss = Loss(loss_type, level, 0.2, eps_high, 0.04, length, bias, options)
    parts.job.algorithm.top_entropy_quantile = opts.get("top_entropy_quantile", 1.0)
    parts.entropy = EntropyControl(coef=opts.get("entropy_coef", 0.0))
    parts.job.train.micro_batch = micro
    opt = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
    m = optimizer_step(parts, batch, opt, autocast_for(parts.job, parts.device))
    grads = {n: q.grad.detach().clone() for n, q in parts.policy.named_parameters() if q.grad is not None}
    return m["loss"], grads, m


def compare_losses(parts, trainer, tok) -> None:
    import torch

    from gpufleet.rl.batch import GenerationBatch

    _, prompt_ids, completion_ids, mask, truncated = fixed_batch(tok)
    g = torch.Generator().manual_seed(1)
    n = prompt_ids.shape[0]
    adv = torch.randn(n, generator=g)
    ref = -3.0 + 0.3 * torch.randn(n, L, generator=g)  # replaced by the real logps + noise below
    with torch.no_grad():
        from gpufleet.engine.logprobs import sequence_logprobs

        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attn = torch.cat([torch.ones_like(prompt_ids), mask.long()], 1)
        logp, _ = sequence_logprobs(parts.policy, input_ids, attn, prompt_ids.shape[1])
    ref = logp + 0.2 * torch.randn(n, L, generator=g)
    old = logp + 0.3 * torch.randn(n, L, generator=g)
    print(f"{'case':<46} {'max|dgrad| mb8':>14} {'mb2':>9} {'|dloss|':>9} {'max|dfig|':>9}  figures")
    worst = 0.0
    for loss_type, level, off_policy, bias, name, opts in cases():
        loss_mask = (
            mask * (~truncated).float().unsqueeze(1) if opts.get("mask_truncated_completions") else mask
        )
        inputs = {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones_like(prompt_ids),
            "completion_ids": completion_ids,
            "completion_mask": loss_mask.long(),
            "advantages": adv,
            "num_items_in_batch": loss_mask.sum(),
            "ref_per_token_logps": ref,
        }
        if off_policy:
            inputs["old_per_token_logps"] = old
        t_loss, t_grads, t_fig = trl_side(trainer, trainer.model, inputs, loss_type, level, bias, opts)
        batch = GenerationBatch(
            input_ids, attn, loss_mask, adv, old if off_policy else None, ref, prompt_ids.shape[1]
        )
        diffs, figs = [], 0.0
        for micro in (8, 2):
            g_loss, g_grads, g_m = gpufleet_side(parts, batch, micro, loss_type, level, bias, opts)
            diffs.append(max((t_grads[k] - g_grads[k]).abs().max().item() for k in t_grads))
            shared = [k for k in t_fig if k in g_m]
            figs = max([figs] + [abs(t_fig[k] - g_m[k]) for k in shared])
        label = f"{loss_type}/{level}/{'off' if off_policy else 'on'}/bias={int(bias)}/{name}"
        worst = max(worst, *diffs, figs)
        print(
            f"{label:<46} {diffs[0]:>14.2e} {diffs[1]:>9.2e} {abs(t_loss - g_loss):>9.2e} {figs:>9.2e}  {','.join(shared)}"
        )
    print(f"worst difference over every case: {worst:.2e}")


def compare_rewards(trainer, tok) -> None:
    import torch

    from gpufleet.rl.advantages import advantages_of

    prompts, prompt_ids, completion_ids, mask, _ = fixed_batch(tok)
    rows = [
        [int(t) for t, m in zip(r, mr, strict=True) if m] for r, mr in zip(completion_ids, mask, strict=True)
    ]
    f1 = [1.0, None, 0.5, 2.0, None, 1.0, 3.0, 0.0]
    f2 = [0.5, None, None, 1.0, 2.0, None, 1.0, 1.0]  # row 1: every function None -> unscorable

    def r1(prompts, completions, **kw):
        return f1

    def r2(prompts, completions, **kw):
        return f2

    trainer.reward_funcs = [r1, r2]
    trainer.reward_func_names = ["r1", "r2"]
    trainer.reward_processing_classes = [None, None]
    trainer.reward_weights = torch.tensor([1.0, 0.5])
    trainer.beta, trainer.ref_model = 0.0, None
    texts = tok.batch_decode(completion_ids)

    def fake_generate(prompt_list):
        return [p.tolist() for p in prompt_ids], rows, None, texts, None, {}, None, None

    trainer._generate = fake_generate
    per_function = torch.tensor(
        [[float("nan") if v is None else v for v in pair] for pair in zip(f1, f2, strict=True)]
    )
    print(f"\n{'rewards case':<36} {'max|dadv|':>10} {'|dreward|':>10} {'|dstd|':>10} {'|dzero|':>10}")
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        for scale in ("group", "batch", "none"):
            trainer.multi_objective_aggregation, trainer.scale_rewards = aggregation, scale
            trainer._metrics["train"].clear()
            out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])
            m = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
            adv, _, stats = advantages_of(per_function, torch.tensor([1.0, 0.5]), G, scale, aggregation)
            print(
                f"{aggregation + '/' + scale:<36} {(out['advantages'] - adv).abs().max().item():>10.2e} "
                f"{abs(m['reward'] - stats['reward']):>10.2e} {abs(m['reward_std'] - stats['reward_std']):>10.2e} "
                f"{abs(m['frac_reward_zero_std'] - stats['frac_reward_zero_std']):>10.2e}"
            )


def main() -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from gpufleet.config.load import load_job
    from gpufleet.rl.parts import build

    torch.manual_seed(0)
    sets = ["algorithm.num_generations=4", "algorithm.beta=0.04", "train.per_device_batch=8"]
    sets += ["train.max_grad_norm=0", f"rollout.max_completion_length={L}", "output.dir=/tmp/trl_grad_equal"]
    job = load_job(None, sets, env={}).job
    parts = build(job)
    parts.suppress_tokens = ()  # TRL scores every token; the comparison is of the loss math
    with torch.no_grad():  # away from the init: gradients of every size
        for q in parts.policy.parameters():
            q.add_(0.02 * torch.randn_like(q))
    tok = parts.tokenizer
    config = GRPOConfig(
        output_dir="/tmp/trl_grad_equal_trl",
        per_device_train_batch_size=8,
        num_generations=G,
        max_completion_length=L,
        beta=0.04,
        use_cpu=True,
        report_to="none",
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    model = copy.deepcopy(parts.policy).train()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(prompts)],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "a:"}] * 8),
        processing_class=tok,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    compare_losses(parts, trainer, tok)
    compare_rewards(trainer, tok)
    from trl_tools_equal import compare_chat_rewards, compare_tool_loop  # the chat / tool parts

    compare_tool_loop()
    compare_chat_rewards()


if __name__ == "__main__":
    if not in_bench_venv():
        os.environ["PYTHONPATH"] = str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")
        reexec_in_bench_venv(Path(__file__), sys.argv[1:])
    main()
