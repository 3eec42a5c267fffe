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
