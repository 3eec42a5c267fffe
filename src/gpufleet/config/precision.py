"""The dtypes a job trains and scores in, decided in one place for the trainer (rl/precision.py) and
the planner (plan/build.py). No torch here.

    policy weights     model.dtype, or float32 master weights for `auto`; a LoRA base (frozen, no master
                       weights needed) in the compute dtype, its adapter in float32 (peft's default)
    compute            train.precision: bf16 / fp16, or the weights' dtype for fp32
    how                FSDP over several policy ranks with auto weights and bf16/fp16: FSDP2 mixed
                       precision (parameters gathered in the compute dtype, resharded after use,
                       gradients reduced in float32, fp32 sharded master weights), no autocast;
                       otherwise autocast around the forward
    reference          no gradients, no optimizer: loaded in the compute dtype (model.dtype if set)
    reward model       no gradients, no optimizer: loaded in the compute dtype (whatever its checkpoint's)
"""

from __future__ import annotations

_COMPUTE = {"bf16": "bfloat16", "fp16": "float16"}


def weights_dtype(job) -> str:
    """The policy's weights (and master weights): model.dtype; for `auto` float32, or the compute dtype
    for a LoRA base (frozen)."""
    if job.model.dtype != "auto":
        return job.model.dtype
    return _COMPUTE.get(job.train.precision, "float32") if job.model.use_peft else "float32"


def compute_dtype(job) -> str:
    """What matmuls run in: train.precision's dtype, or the weights' (fp32, or bf16 weights)."""
    return _COMPUTE.get(job.train.precision, weights_dtype(job))


def fsdp_mixed(job, policy_ranks: int) -> bool:
    """FSDP2 mixed precision instead of autocast (see the module docstring)."""
    return (
        job.placement.strategy == "fsdp"
        and policy_ranks > 1
        and weights_dtype(job) == "float32"
        and job.train.precision in _COMPUTE
    )


def reference_dtype(job) -> str:
    """The frozen reference model's dtype: model.dtype if set, else the compute dtype."""
    return job.model.dtype if job.model.dtype != "auto" else compute_dtype(job)


def rollout_dtype(job) -> str:
    """A dedicated rollout rank's copy of the policy: frozen like the reference, so in its dtype (the
    compute dtype; an fp32 job samples with fp32 weights, as a colocated rollout does)."""
    return reference_dtype(job)


def reward_model_dtype(job) -> str:
    """The frozen reward model's dtype: the compute dtype, whatever dtype its checkpoint was saved in (a
    bf16 run never holds an fp32 copy of it; an fp32 run scores in fp32)."""
    return compute_dtype(job)
