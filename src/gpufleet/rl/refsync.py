"""Reference-model sync (TR-DPO, arXiv 2404.09656), as TRL 1.16's `SyncRefModelCallback`: every
`algorithm.ref_model_sync_steps` optimizer steps, reference <- alpha x policy + (1 - alpha) x reference,
so the KL anchors to a slowly moving policy instead of the initial one."""

from __future__ import annotations

import torch


def due(job, step: int) -> bool:
    """Whether a sync follows optimizer step `step` (1-based: TRL's global_step)."""
    a = job.algorithm
    return a.sync_ref_model and step % a.ref_model_sync_steps == 0


@torch.no_grad()
def mix_into(reference: torch.nn.Module, policy: dict[str, torch.Tensor], alpha: float) -> None:
    """reference <- alpha x policy + (1 - alpha) x reference, parameter by parameter; `policy` maps the
    policy's parameter names to tensors (`dict(model.named_parameters())`, or a copy sent to a scorer rank)."""
    for name, target in reference.named_parameters():
        target.mul_(1.0 - alpha).add_(policy[name].detach().to(target.device, target.dtype), alpha=alpha)


def policy_copy(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's parameters on CPU, for a reference on a scorer rank."""
    return {name: q.detach().cpu().clone() for name, q in policy.named_parameters()}
