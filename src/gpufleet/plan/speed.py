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

A rollout split (plan/split.py: rollout on devices of its own, `rollout.async_steps` 1) is further
multiplied by `async_overlap(g)` = 1 - min(g, 1 - g): sampling batch s + 1 while batch s trains, a step
takes the longer of the two instead of their sum. That is the best case: it assumes the rollout rank
samples the rows of the policy ranks it serves in the time one policy rank took for its own (decoding
reads the weights once per token for all rows), and no weight-sync cost. g, the generation share of a
colocated step, is estimated from the job's shape by `generation_share` (no measurement).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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


def generation_share(job) -> float:
    """g: the estimated share of a colocated step spent sampling (the rest: training and scoring), from
    the job's shape alone, in units of one token's forward (2 x parameters FLOPs):
        sampling   T x max(DECODE_ROWS, rows) + rows x P     (decode, memory-bound; prefill)
        training   3 x rows x (P + T) x num_iterations (x1.3 checkpointing, x0.75 LoRA)
        scoring    rows x (P + T) per scoring model (reference, reward model)
    rows = completions sampled at once per rank, P / T = prompt / completion tokens. An estimate: real
    shares depend on the engine, the GPU and how long completions are."""
    t, m = job.train, job.model
    rows = t.per_device_batch * t.steps_per_generation
    P, T = job.rollout.max_prompt_length, job.completion_tokens()
    sample = T * max(DECODE_ROWS, rows) + rows * P
    train = 3 * rows * (P + T) * job.algorithm.num_iterations
    train *= (CHECKPOINTING if m.gradient_checkpointing else 1) * (LORA if m.use_peft else 1)
    score = rows * (P + T) * sum(job.roles_used().values())
    return sample / (sample + train + score)


def async_overlap(g: float) -> float:
    """Step time with sampling one step ahead on other devices, relative to sampling then training in
    turn: the longer of the two parts, 1 - min(g, 1 - g) (the best case; see the module docstring)."""
    return 1 - min(g, 1 - g)
