"""AdamW and the learning-rate schedule (linear warm-up, then constant / linear / cosine decay)."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, warmup: int, total: int, kind: str) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based), as transformers' schedules
    (TRL's) give it: the warm-up rises from 0 at step 0 to 1 at step `warmup` (the first step of a warm-up
    moves no weight, only AdamW's moments)."""
    if warmup > 0 and step < warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {kind!r}")


def build_optimizer(params, train) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW, fused (one kernel for all parameters: ~8x faster on CPU here) unless the parameters are
    FSDP2 DTensors, which the fused kernel does not take."""
    params = [q for q in params if q.requires_grad]
    fused = all(type(q) is torch.nn.Parameter and q.device.type in ("cpu", "cuda") for q in params)
    opt = torch.optim.AdamW(
        params,
        lr=train.learning_rate,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_epsilon,
        weight_decay=train.weight_decay,
        fused=fused,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup=train.warmup_steps, total=train.max_steps, kind=train.lr_scheduler)
    )
    return opt, sched
