"""Dtypes of the models and the autocast context, shared by the policy ranks and the scorer ranks."""

from __future__ import annotations

import contextlib

import torch

from gpufleet.config.schema import Job


def model_dtype(job: Job) -> str:
    """The dtype models are loaded in: `model.dtype`, or float32 master weights for `auto` (bf16/fp16
    compute then comes from `autocast_for`)."""
    if job.model.dtype != "auto":
        return job.model.dtype
    return "float32"


def autocast_for(job: Job, device: torch.device):
    """A factory of the autocast context for `train.precision` (a null context for fp32)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.train.precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)
