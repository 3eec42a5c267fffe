"""Expected cost of a fix: the time per completion relative to the job as it is, a rough factor used only
to order the fixes `gpufleet plan` proposes (fastest first). Pure arithmetic, no torch.

    step_cost(job, changes, ranks_before=4, ranks_after=4)   # 1.5 = 50% more time per completion

Factors (multiplied; the sources are measurements people report, not ours):
    gradient checkpointing on           x1.3   one more forward in forward + backward (~3 passes -> ~4)
    a smaller micro-batch               x(1 + 0.05 per halving)   smaller matmuls, more launches
    DDP (or one rank) -> FSDP           x1.15  per-layer all-gathers and reduce-scatters (1.5x DDP's bytes)
    placement.offload (CPUOffloadPolicy) x1.5  AdamW on the CPU, every shard copied host <-> device each
                                               step (DeepSpeed / verl users report 1.3-2x)
    train.precision fp32 -> bf16/fp16   x0.5   tensor-core matmuls
    LoRA (model.use_peft)               x0.75  no weight gradients for the frozen base (backward ~2/3),
                                               no full-gradient all-reduce, a tiny optimizer step
    policy ranks n -> m                 x n/m  completions per step follow the ranks

A rollout split (plan/split.py: rollout on devices of its own, `rollout.async_steps` 1) is priced by
`split_cost` instead of the rank factor: sampling batch s + 1 while batch s trains, a step takes the longer
of sampling (on a rollout rank: the rows of every policy rank it serves, at once) and training + scoring
(on a policy rank) instead of their sum. Both come from the job's shape (`shape_units`: decoding is bound
by reading the weights, so a decode step costs the same for up to DECODE_ROWS rows), not from a
measurement; the weight push after each optimizer step is not counted. With the rows unchanged on both
sides it hides min(g, 1 - g) of a colocated step, g = `generation_share` (the sampling share): the most
that overlap can give.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from gpufleet.plan.change import Change, value_of

CHECKPOINTING = 1.3
MICRO_HALVING = 0.05
FSDP = 1.15
OFFLOAD = 1.5
BF16 = 0.5
LORA = 0.75
DECODE_ROWS = 150
"""Rows one decode step serves in the time it reads the weights (a GPU's bf16 FLOP/s over its memory
bandwidth per 2 bytes of weight: A100 ~156, RTX 4090 ~165, H100 ~295): below it, decoding is bound by
memory traffic and a token costs as much as DECODE_ROWS rows of a training forward."""


def step_cost(job, changes: Iterable[Change], ranks_before: int, ranks_after: int) -> float:
    """Time per completion of `job` with `changes` (and `ranks_after` policy ranks), relative to `job`."""
    cs = tuple(changes)
    cost = ranks_before / max(ranks_after, 1)
    m, t = job.model, job.train
    if (
        value_of(cs, "model.gradient_checkpointing", m.gradient_checkpointing)
        and not m.gradient_checkpointing
    ):
        cost *= CHECKPOINTING
    micro = t.micro_batch or t.per_device_batch
    new_micro = value_of(cs, "train.micro_batch", micro)
    if new_micro < micro:
        cost *= 1 + MICRO_HALVING * math.log2(micro / new_micro)
    was_fsdp = job.placement.strategy == "fsdp" and ranks_before > 1
    if (
        value_of(cs, "placement.strategy", job.placement.strategy) == "fsdp"
        and ranks_after > 1
        and not was_fsdp
    ):
        cost *= FSDP
    if value_of(cs, "placement.offload", job.placement.offload) != "none" and job.placement.offload == "none":
        cost *= OFFLOAD
    if t.precision == "fp32" and value_of(cs, "train.precision", "fp32") != "fp32":
        cost *= BF16
    if value_of(cs, "model.use_peft", m.use_peft) and not m.use_peft:
        cost *= LORA
    return cost


def shape_units(job, rows: int, score_rows: int | None = None) -> tuple[float, float]:
    """(sampling, training + scoring) of a step of `rows` completions per rank, in units of one token's
    forward (2 x parameters FLOPs at training speed); `score_rows`: rows a scorer scores (default `rows`).
        sampling   T x max(DECODE_ROWS, rows) + rows x P     (decode, memory-bound; prefill)
        training   3 x rows x (P + T) x num_iterations (x1.3 checkpointing, x0.75 LoRA)
        scoring    score_rows x (P + T) per scoring model (reference, reward model; each taken as the policy's size)
    P / T = prompt / completion tokens. An estimate: real times depend on the engine, the GPU and how
    long the completions are."""
    m = job.model
    P, T = job.rollout.max_prompt_length, job.completion_tokens()
    sample = T * max(DECODE_ROWS, rows) + rows * P
    train = 3 * rows * (P + T) * job.algorithm.num_iterations
    train *= (CHECKPOINTING if m.gradient_checkpointing else 1) * (LORA if m.use_peft else 1)
    scored = (rows if score_rows is None else score_rows) * (P + T) * sum(job.roles_used().values())
    return sample, train + scored


class Shape(NamedTuple):
    """Ranks per node of a layout (rollout 0: each policy rank samples its own rows; scorers 0: scoring
    colocated) and the completions each policy rank samples per generation."""

    policy: int
    rollout: int
    scorers: int
    rows: int


def _parts(job, shape: Shape) -> tuple[float, float]:
    """(sampling, training + scoring) of one step of `shape`, each on the busiest rank that does it."""
    p, m, s, rows = shape
    sample, _ = shape_units(job, -(-p // m) * rows if m else rows)  # a rollout rank: its policy ranks' rows
    _, rest = shape_units(job, rows, -(-rows * p // s) if s else rows)  # a scorer: its policy ranks' rows
    return sample, rest


def generation_share(job, shape: Shape) -> float:
    """g: the estimated share of a step spent sampling, the policy ranks sampling their own rows."""
    sample, rest = _parts(job, shape._replace(rollout=0))
    return sample / (sample + rest)


def split_cost(job, changes: Iterable[Change], before: Shape, after: Shape) -> float:
    """Time per completion of `job` laid out as `after` (a rollout split, one step ahead) with `changes`,
    relative to `job` as `before`: a step takes sampling + training + scoring colocated, the longer of the
    two parts split (module docstring); memory savers among `changes` (checkpointing, micro-batch, FSDP)
    as `step_cost`."""

    def per_completion(shape: Shape) -> float:
        sample, rest = _parts(job, shape)
        return (max(sample, rest) if shape.rollout else sample + rest) / (shape.rows * shape.policy)

    return per_completion(after) / per_completion(before) * step_cost(job, changes, 1, 1)
