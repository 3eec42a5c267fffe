"""One RL step: a generation step (sample, reward, score) and an optimizer step (loss, backward, clip, step).

`generation_step` samples this rank's rows of a generation batch (layout: rl/batch.py), rewards them,
gathers every rank's rewards so each group's advantages see all G completions, and adds the old /
reference log-probs when they are needed. `optimizer_step` (rl/update.py) trains on what it returns.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from gpufleet.dist import Runtime, all_gather_rows
from gpufleet.engine.rollout import Rollout
from gpufleet.parallel import release
from gpufleet.rl import rolloutplay, rollouts, sampler, scorer
from gpufleet.rl.advantages import advantages_of, unscorable
from gpufleet.rl.batch import (
    GenerationBatch,
    Scored,
    completion_seed,
    logprobs_of,
    rank_rows,
    reuse_count,
    tokenize_prompts,
)
from gpufleet.rl.episodes import Episodes, episode_stats
from gpufleet.rl.parts import Parts, sample
from gpufleet.rl.rewardlog import RewardLog
from gpufleet.rl.rewards import chat_said, completion_token_ids
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
