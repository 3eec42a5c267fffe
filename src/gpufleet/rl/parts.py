"""What the RL loop works with, built once: the models, the tokenizer, the prompts, the rewards, the loss."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime
from gpufleet.rl.data import PromptSource
from gpufleet.rl.losses import Loss
from gpufleet.rl.precision import model_dtype
from gpufleet.rl.rewards import Rewards


@dataclass
class Parts:
    """Everything the loop needs, built once by `build`."""

    job: Job
    rt: Runtime
    policy: torch.nn.Module  # the plain model (generation, saving)
    train_model: torch.nn.Module  # what the loss goes through: the policy, its DDP wrapper, or FSDP
    reference: torch.nn.Module | None  # colocated reference model (None: not used, or on a scorer)
    tokenizer: object
    source: PromptSource
    rewards: Rewards
    loss: Loss

    @property
    def device(self) -> torch.device:
        return self.rt.device


def build(job: Job, rt: Runtime | None = None, weights: Path | None = None) -> Parts:
    """Load everything; `weights`: a checkpoint folder to take the policy weights from (resume)."""
    from transformers.utils import logging as hf_logging

    from gpufleet.models import load_causal_lm, load_tokenizer

    rt = rt or Runtime()
    hf_logging.disable_progress_bar()
    torch.manual_seed(job.train.seed)
    tokenizer = load_tokenizer(job.model.path)
    policy = load_causal_lm(str(weights or job.model.path), dtype=model_dtype(job), device=str(rt.device))
    if job.model.gradient_checkpointing:
        # transformers 5.x: activation_checkpointing_enable (gradient_checkpointing_enable is deprecated)
        policy.activation_checkpointing_enable({"use_reentrant": False})
    train_model = policy
    if rt.distributed and rt.policy_size > 1:
        from gpufleet.parallel import wrap_policy

        train_model = wrap_policy(policy, job.placement.strategy, rt)
    reference = None
    if job.roles_used()["reference"] and not rt.dedicated("reference"):
        reference = load_causal_lm(job.model.path, dtype=model_dtype(job), device=str(rt.device)).eval()
        reference.requires_grad_(False)
    source = PromptSource(job.data, job.train.seed)
    rewards = Rewards(job.reward, source.reward_names(), rt.device, model_here=not rt.dedicated("reward"))
    return Parts(job, rt, policy, train_model, reference, tokenizer, source, rewards, Loss.from_job(job))
