"""Dtypes of the models and the autocast context, shared by the policy ranks and the scorer ranks (the
decisions themselves: config/precision.py)."""

from __future__ import annotations

import contextlib

import torch

from gpufleet.config import precision
from gpufleet.config.schema import Job


def model_dtype(job: Job) -> str:
    """The dtype the policy is loaded in: `model.dtype`, or float32 master weights for `auto` (bf16/fp16
    compute then comes from `autocast_for` or from FSDP2 mixed precision)."""
    return precision.weights_dtype(job)


def decode_dtype(job: Job, device: torch.device) -> str | None:
    """The dtype the fast decoder computes in on a GPU: the compute dtype where it differs from the
    weights' (bf16/fp16 over float32 master weights: the rollout reads half the bytes, as the autocast
    forward computes in bf16 too; a rollout rank holds such a copy already); None elsewhere (the CPU
    decodes in the weights' dtype: its kernels are float32)."""
    compute = precision.compute_dtype(job)
    return compute if device.type == "cuda" and compute != precision.weights_dtype(job) else None


def reference_dtype(job: Job) -> str:
    """The frozen reference's dtype: the compute dtype (no master weights needed without gradients)."""
    return precision.reference_dtype(job)


def reward_model_dtype(job: Job) -> str:
    """The frozen reward model's dtype: the compute dtype (config/precision.py)."""
    return precision.reward_model_dtype(job)


def fsdp_param_dtype(job: Job, policy_ranks: int) -> torch.dtype | None:
    """The dtype FSDP2 gathers the policy's parameters in (None: no FSDP mixed precision)."""
    if not precision.fsdp_mixed(job, policy_ranks):
        return None
    return getattr(torch, precision.compute_dtype(job))


def autocast_for(job: Job, device: torch.device, policy_ranks: int = 1):
    """A factory of the autocast context for `train.precision` (a null context for fp32, and under FSDP2
    mixed precision, where the gathered parameters already are in the compute dtype)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.train.precision)
    if dtype is None or precision.fsdp_mixed(job, policy_ranks):
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)
