"""One RL step: a generation step (sample, reward, score) and an optimizer step (loss, backward, clip, step).

`generation_step` samples this rank's rows of a generation batch (layout: rl/batch.py), rewards them,
gathers every rank's rewards so each group's advantages see all G completions, and adds the old /
reference log-probs when they are needed. `optimizer_step` accumulates gradients over micro-batches,
each micro-batch's loss scaled by the *whole step's* normaliser (rl/losses.py `Loss.normalizer`), so the
gradient depends neither on `train.micro_batch` nor on the number of ranks.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass

import torch

from gpufleet.dist import Runtime, all_gather_rows, all_reduce_sum
from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.engine.rollout import Rollout
from gpufleet.errors import UserError
from gpufleet.parallel import release
from gpufleet.rl import rolloutplay, rollouts, sampler, scorer
from gpufleet.rl.advantages import advantages_of, unscorable
from gpufleet.rl.batch import (
    GenerationBatch,
    Scored,
    completion_seed,
    length_cut,
    logprobs_of,
    pack_over,
    rank_rows,
    reuse_count,
    tokenize_prompts,
)
from gpufleet.rl.entropy import entropy_threshold, high_entropy_mask
from gpufleet.rl.episodes import Episodes, episode_stats
from gpufleet.rl.parts import Parts, sample
from gpufleet.rl.rewardlog import RewardLog
from gpufleet.rl.rewards import chat_said, completion_token_ids
from gpufleet.rl.routeraux import StepRouter, step_router
from gpufleet.rl.tooldata import tools_on_data


def generation_step(p: Parts, gen_index: int, autocast) -> Scored:
    """Sample (or play, with an env), reward and score this rank's rows of generation batch `gen_index`
    (see rl/batch.py)."""
    job, rt, t = p.job, p.rt, p.job.train
    G = job.algorithm.num_generations
    rows, row_pos, seeds = _layout(p, gen_index)
    got = _sampled(p, rows, row_pos, seeds, gen_index)
    rollout, prompts, completions = got.rollout, got.prompts, got.completions
    episodes, answer = got.episodes, got.answer
    batch = GenerationBatch(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        completion_mask=got.loss_mask,
        advantages=torch.zeros(len(rows)),
        old_logprobs=None,
        ref_logprobs=None,
        completion_start=rollout.completion_start,
    )
    with rt.clock.phase("score"):
        remote = _ask_scorers(
            rt, batch, prompts, completions, p.suppress_tokens, p.early, p.pending_ref_mixes
        )
        p.pending_ref_mixes.clear()
        log = RewardLog(gen_index * reuse_count(job), t.max_steps)  # TRL's trainer_state, log_metric, ...
        env_rewards = episodes.env_rewards if episodes else None
        said = got.said
        per_function = p.rewards(
            prompts,
            completions,
            got.columns,
            remote.get("rm_scores"),
            env_rewards,
            completion_token_ids(rollout),
            log,
            conversation=said,  # chat episodes, chat data: TRL's message lists
        )
    warn_unscorable(per_function, prompts, completions)
    per_function_all = _gather_rows_in_order(p, per_function)
    advantages, rewards_all, stats = advantages_of(
        per_function_all, p.rewards.weights, G, job.algorithm.scale_rewards, job.reward.aggregation
    )
    batch.advantages = advantages[torch.tensor(rows)].to(p.device)
    with rt.clock.phase("score"):
        _add_logprobs(p, batch, remote, autocast)
        if answer is not None:
            stats |= sampler.weigh(p, batch, answer, autocast)
    if episodes is not None:
        stats |= episode_stats(rt, episodes)
    # a dedicated scorer's work on this round, seen from this rank (its idle time is the rest of the step)
    stats |= {f"timing/scorer/rank{r}": s for r, s in remote.get("scorer_busy", {}).items()}
    return Scored(
        batch,
        rollout,
        prompts,
        completions,
        rewards_all,
        per_function_all,
        stats,
        segments=episodes.segments if episodes else None,
        logged=log.step_metrics(rt),
        extras=log.row_extras(len(completions)),
    )


@dataclass
class _Sampled:
    """This rank's rows of a generation batch, sampled (or played): the rollout, its loss mask, the prompts
    and completions as the reward functions get them, the data rows' other columns, and where they came
    from (the episodes of an env / tools job; a dedicated rollout rank's answer)."""

    rollout: Rollout
    loss_mask: torch.Tensor
    prompts: list
    completions: list
    columns: dict
    episodes: Episodes | None = None
    answer: object | None = None
    said: dict | None = None  # TRL's message-list prompts / completions (chat episodes, chat data)


def _sampled(p: Parts, rows, row_pos, seeds, gen_index: int) -> _Sampled:
    """Episodes played (env or tools on a data set: here or on a dedicated rollout rank, rl/rolloutplay.py),
    or single-turn completions sampled (here, or by a rollout rank, maybe ahead: rl/rollouts.py)."""
    job = p.job
    if job.env.name or tools_on_data(job):
        ep, answer = rolloutplay.episodes(p, rows, row_pos, seeds, gen_index, _layout)
        loss_mask = _unless_cut(job, ep.loss_mask, ep.rollout)  # tools on data: TRL's is_truncated
        return _Sampled(
            ep.rollout, loss_mask, ep.prompts, ep.transcripts, ep.columns, ep, answer, ep.conversation
        )
    prompt_ids, prompts, columns, raw = _prompts(p, row_pos)
    answer = None
    if p.remote is not None:
        answer = rollouts.fetch(p.remote, p.policy, gen_index, lambda g: _request(p, g))
        rollout = answer.rollout.to(p.device)
    else:
        rollout = sample(p, prompt_ids, seeds, job.rollout.max_completion_length)
    loss_mask = _unless_cut(job, rollout.completion_mask.float(), rollout)
    completions = p.tokenizer.batch_decode(
        rollout.completion_ids * rollout.completion_mask.long(), skip_special_tokens=True
    )
    said = chat_said(p, row_pos, rollout, prompts, completions, raw)  # chat data: TRL's message lists
    return _Sampled(rollout, loss_mask, prompts, completions, columns, None, answer, said)


def _unless_cut(job, loss_mask: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """algorithm.mask_truncated_completions (DAPO, TRL's): a cut completion carries no loss."""
    if not job.algorithm.mask_truncated_completions:
        return loss_mask
    return loss_mask * (~rollout.is_truncated).float().unsqueeze(1).to(loss_mask.device)


def _layout(p: Parts, gen_index: int) -> tuple[list[int], list[int], list[int]]:
    """This rank's rows of generation batch `gen_index` (rl/batch.py), their prompts' positions in the
    prompt stream and their completions' seeds."""
    job, rt, t = p.job, p.rt, p.job.train
    G = job.algorithm.num_generations
    first_prompt = gen_index * (job.generation_batch(rt.policy_size) // G)
    rows = rank_rows(rt.policy_index, rt.policy_size, t.per_device_batch, t.steps_per_generation)
    row_pos = [first_prompt + j // G for j in rows]
    seeds = [completion_seed(t.seed, pos, j % G) for pos, j in zip(row_pos, rows, strict=True)]
    return rows, row_pos, seeds


def _request(p: Parts, gen_index: int) -> dict | None:
    """What the rollout rank needs to sample this rank's rows of generation batch `gen_index` (None past
    the run's last one)."""
    if gen_index * reuse_count(p.job) >= p.job.train.max_steps:
        return None
    _, row_pos, seeds = _layout(p, gen_index)
    prompt_ids = _prompts(p, row_pos)[0]
    ro = p.job.rollout
    correct = p.job.algorithm.importance_sampling_correction and sampler.differs(p.job)
    return {
        "prompt_ids": prompt_ids,
        "seeds": seeds,
        "max_new_tokens": ro.max_completion_length,
        "sampling": p.sampling,
        "logprobs": correct,
    }


def warn_unscorable(per_function: torch.Tensor, prompts: list[str], completions: list[str]) -> None:
    """One warning line (stderr, from the rank that holds the rows) when every reward function returned None
    for some completions: they get no reward and advantage 0 (TRL 1.16 warns likewise)."""
    rows = unscorable(per_function).nonzero().flatten().tolist()
    if rows:
        i = rows[0]
        print(
            f"gpufleet: warning: every reward function returned None for {len(rows)} completion(s), e.g. "
            f"prompt {prompts[i]!r}, completion {completions[i]!r}: they get advantage 0 and are left out "
            "of the reward metrics; make at least one reward function score every completion.",
            file=sys.stderr,
        )


def _prompts(p: Parts, row_pos: list[int]) -> tuple[list[list[int]], list[str], dict[str, list], list]:
    """Token ids and text of each row's prompt, the data set's other columns per row (for rewards), and
    each row's prompt as the data holds it (text, or chat messages)."""
    positions = sorted(set(row_pos))
    examples = {pos: p.source.examples(pos, 1)[0] for pos in positions}
    field = p.source.field
    ids, texts = tokenize_prompts(
        p.tokenizer,
        [examples[pos][field] for pos in positions],
        p.job.rollout.max_prompt_length,
        [p.source.describe(pos) for pos in positions],
        p.job.rollout.chat_template_kwargs,
    )
    ids_by_pos = dict(zip(positions, ids, strict=True))
    text_by_pos = dict(zip(positions, texts, strict=True))
    columns = {k: [examples[pos][k] for pos in row_pos] for k in examples[positions[0]] if k != field}
    raw = [examples[pos][field] for pos in row_pos]
    return [ids_by_pos[pos] for pos in row_pos], [text_by_pos[pos] for pos in row_pos], columns, raw


def _ask_scorers(
    rt: Runtime,
    batch: GenerationBatch,
    prompts: list[str],
    completions: list[str],
    suppress_tokens=(),
    early=(None, 0),
    ref_mixes=(),
) -> dict:
    """Reference log-probs / reward-model scores from the dedicated scorer ranks ({} when there are none);
    the reference scores with the policy's `suppress_tokens` (and `early` EOS) removed, as the policy does.
    `ref_mixes`: reference syncs (and a resumed reference state) the scorer applies first."""
    if not rt.scorers:
        return {}
    payload = {
        "input_ids": batch.input_ids.cpu(),
        "completion_start": batch.completion_start,
        "attention_mask": batch.attention_mask.cpu(),
        "prompts": prompts,
        "completions": completions,
        "suppress_tokens": tuple(suppress_tokens),
        "early": tuple(early),
        "ref_mixes": list(ref_mixes),  # from every policy rank (each node's scorer needs them); applied once
    }
    return scorer.request(rt, payload)


def _gather_rows_in_order(p: Parts, local: torch.Tensor) -> torch.Tensor:
    """Every policy rank's rows of `local` in global row order (advantages need whole groups)."""
    rt, t = p.rt, p.job.train
    gathered = all_gather_rows(rt, local)
    order = [
        j
        for r in range(rt.policy_size)
        for j in rank_rows(r, rt.policy_size, t.per_device_batch, t.steps_per_generation)
    ]
    out = torch.empty(p.job.generation_batch(rt.policy_size), local.shape[1])
    out[torch.tensor(order)] = torch.cat(gathered)
    return out


def _add_logprobs(p: Parts, batch: GenerationBatch, remote: dict, autocast) -> None:
    """Old log-probs when the batch is reused (the generating policy's), reference log-probs for the KL."""
    t, ro = p.job.train, p.job.rollout
    micro = t.micro_batch or t.per_device_batch
    if reuse_count(p.job) > 1:  # the batch is reused: keep the generating policy's log-probs
        batch.old_logprobs = logprobs_of(
            p.train_model, batch, ro.temperature, micro, autocast, p.suppress_tokens, p.early
        )
    if p.reference is not None:
        batch.ref_logprobs = logprobs_of(
            p.reference, batch, ro.temperature, micro, autocast, p.suppress_tokens, p.early
        )
        release(p.reference)  # a sharded reference: its root unit gathered no longer
    elif p.job.algorithm.beta > 0 and p.job.model.use_peft:  # LoRA: the base model is the reference
        with p.policy.disable_adapter():
            batch.ref_logprobs = logprobs_of(
                p.train_model, batch, ro.temperature, micro, autocast, p.suppress_tokens, p.early
            )
    elif "ref_logprobs" in remote:
        batch.ref_logprobs = remote["ref_logprobs"].to(p.device)


@dataclass(frozen=True)
class EntropyGate:
    """What one optimizer step's micro-batches share about entropy (rl/entropy.py): the high-entropy
    threshold (None: every token is trained), the global count of trained tokens, the bonus coefficient."""

    threshold: float | None
    trained: int
    coef: float


def optimizer_step(p: Parts, batch: GenerationBatch, opt, autocast) -> dict[str, float]:
    """Accumulate over micro-batches with the step-wide normaliser; clip; step. Returns loss metrics."""
    rt, t = p.rt, p.job.train
    tokens = batch.num_tokens
    global_tokens = int(all_reduce_sum(rt, float(tokens)).item())
    normalizer = p.loss.normalizer(batch.input_ids.shape[0], tokens, global_tokens, rt.policy_size)
    totals = dict.fromkeys(("loss", "entropy"), 0.0)
    micro = t.micro_batch or t.per_device_batch
    with autocast():
        cut = length_cut(p.train_model, p.early)
    micro_batches = [mb for _, mb in batch.micro_batches(micro, cut)]
    with rt.clock.phase("backward"):  # forward + backward (DDP's gradient all-reduce overlaps it)
        gate = _entropy_gate(p, micro_batches, global_tokens, autocast)
        router = step_router(p, micro_batches, autocast)  # a MoE policy's load-balancing loss (or None)
        opt.zero_grad(set_to_none=True)
        for k, mb in enumerate(micro_batches):
            sync = k == len(micro_batches) - 1
            _accumulate(p, mb, sync, normalizer, global_tokens, totals, autocast, gate, router)
    with rt.clock.phase("optimizer"):
        grad_norm = _clip_gradients(p)
        opt.step()
    shares = totals.pop("_sampler", None)  # the IS weights' metrics, formed in the loss (rl/sampler.py)
    # Metrics: each micro-batch's share was taken of the global count, so a sum over ranks is the mean.
    for key in sorted(k for k in totals if k != "loss"):  # the same keys, in the same order, on every rank
        totals[key] = float(all_reduce_sum(rt, totals[key]))
    totals["loss"] = p.loss.global_loss(float(all_reduce_sum(rt, totals["loss"])), rt.policy_size)
    trained_entropy = totals.pop("_trained_entropy", None)
    if trained_entropy is not None:  # the bonus was on: TRL's loss includes it, policy_loss does not
        totals["policy_loss"] = totals["loss"]
        totals["loss"] -= gate.coef * trained_entropy
        p.entropy.update(trained_entropy)
        totals["entropy_coef"] = p.entropy.coef
    totals["grad_norm"] = float(grad_norm)
    if shares is not None:
        totals |= sampler.metrics(rt, shares)
    return totals


def _entropy_gate(
    p: Parts, micro_batches: list[GenerationBatch], global_tokens: int, autocast
) -> EntropyGate:
    """The step's high-entropy threshold over every rank's valid tokens (a no-grad forward of the step's
    micro-batches first, only when algorithm.top_entropy_quantile < 1) and the bonus coefficient."""
    q = p.job.algorithm.top_entropy_quantile
    coef = p.entropy.applied()
    if q >= 1.0:
        return EntropyGate(None, global_tokens, coef)
    local = []
    with torch.no_grad(), autocast():
        for mb in micro_batches:
            _, entropy = _forward(p, mb)
            local.append(entropy.float()[mb.completion_mask.bool()])
    values = _gather_values(p.rt, torch.cat(local))
    threshold = entropy_threshold(values, q)
    return EntropyGate(threshold, int((values >= threshold).sum()), coef)


def _gather_values(rt: Runtime, local: torch.Tensor) -> torch.Tensor:
    """Every policy rank's 1-D `local` values, concatenated (ranks may hold different counts)."""
    counts = [int(c) for c in torch.cat(all_gather_rows(rt, torch.tensor([local.numel()])))]
    padded = torch.cat([local, local.new_zeros(max(counts) - local.numel())])
    return torch.cat([x[:n] for x, n in zip(all_gather_rows(rt, padded), counts, strict=True)])


def _forward(p: Parts, mb: GenerationBatch, router: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of a micro-batch under the trained policy (`router`: a list that
    gets a Mixture-of-Experts policy's router logits)."""
    return sequence_logprobs(
        p.train_model,
        mb.input_ids,
        mb.attention_mask,
        mb.completion_start,
        temperature=p.job.rollout.temperature,
        suppress_tokens=p.suppress_tokens,
        eos_token_id=p.early[0],
        min_new_tokens=p.early[1],
        pack_over=pack_over(p.train_model),
        router=router,
    )


def _accumulate(
    p: Parts,
    mb: GenerationBatch,
    sync: bool,
    normalizer: float,
    global_tokens: int,
    totals: dict,
    autocast,
    gate: EntropyGate,
    router: StepRouter | None = None,
) -> None:
    """Forward and backward of one micro-batch; add its share of the step's metrics to `totals`."""
    ranks = p.rt.policy_size
    logits = [] if router is not None else None
    with no_sync(p.train_model, sync), autocast():
        logp, entropy = _forward(p, mb, logits)
        logp, entropy = logp.float(), entropy.float()
        if mb.sampling_logprobs is not None:  # a rollout rank's batch used once: its IS weights from logp
            totals.setdefault("_sampler", []).append(sampler.in_loss(p, logp, mb))
        trained = (
            None if gate.threshold is None else high_entropy_mask(entropy, mb.completion_mask, gate.threshold)
        )
        loss, stats = p.loss(logp, mb, normalizer, trained)
        if not torch.isfinite(loss):
            bad = (~torch.isfinite(logp) & mb.completion_mask.bool()).any(dim=1).nonzero()
            row = int(bad[0]) if len(bad) else 0
            raise UserError(
                f"the loss is {loss.item()} (non-finite) in a micro-batch; first bad row {row}.",
                field="train.learning_rate",
                fix="lower train.learning_rate, use train.precision=fp32, or set train.max_grad_norm=1.0",
            )
        total = loss * p.loss.rank_scale(ranks)
        if p.entropy.enabled:  # the bonus: mean entropy of the trained tokens of the whole step
            on = mb.completion_mask if trained is None else mb.completion_mask * trained
            bonus = (entropy * on).sum() / max(gate.trained, 1)
            total = (
                total - gate.coef * bonus * ranks
            )  # DDP averages over ranks: x ranks gives the global mean
            totals["_trained_entropy"] = totals.get("_trained_entropy", 0.0) + bonus.item()
        if router is not None:  # the step's load-balancing loss, a share a micro-batch (rl/routeraux.py)
            added, aux = router.loss(logits[0], mb.attention_mask, ranks)
            total = total + added
            totals["aux_loss"] = totals.get("aux_loss", 0.0) + aux
        total.backward()
    share = mb.num_tokens / max(global_tokens, 1)
    row_share = mb.input_ids.shape[0] / (p.job.train.per_device_batch * ranks)
    totals["loss"] += loss.item()
    for key, value in stats.items():  # token means weighted by tokens, sequence means by rows (as TRL)
        totals[key] = totals.get(key, 0.0) + value * (row_share if p.loss.by_rows(key) else share)
    with torch.no_grad():
        totals["entropy"] += float((entropy * mb.completion_mask).sum()) / max(global_tokens, 1)


def _clip_gradients(p: Parts) -> torch.Tensor:
    """Clip to `train.max_grad_norm` (0: no clipping); the total norm, refused when not finite."""
    max_norm = p.job.train.max_grad_norm if p.job.train.max_grad_norm > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(p.train_model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        raise UserError(
            f"the gradient norm is {grad_norm.item()} (non-finite).",
            field="train.learning_rate",
            fix="lower train.learning_rate or use train.precision=fp32",
        )
    return grad_norm


def no_sync(model, sync: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch."""
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
