"""A Mixture-of-Experts policy's router load-balancing loss, over the whole optimizer step.

Hugging Face's `load_balancing_loss_func` (TRL 1.16 adds `router_aux_loss_coef` x it for every forward,
divided by the accumulation steps) is E * sum_i f_i * P_i over one forward's attended tokens and MoE
layers: f_i the share of the top-k picks that went to expert i, P_i the mean router probability of
expert i, E the expert count. A product of two means over one forward changes with how the step's rows
are split into micro-batches and ranks. gpufleet takes both means over the step's tokens on every rank,
so the loss does not depend on the layout, and equals TRL's where the step is one forward on one rank:

    aux = E * sum_i (C_i / R) * (S_i / R)

C_i the top-k picks of expert i (no gradient: picks), S_i the summed router probabilities (the
gradient), R the attended tokens x layers, each summed over every micro-batch of every policy rank. `C`
and `R` come first (`step_picks`: a no-grad forward of the step's micro-batches, skipped where the step
is one micro-batch on one rank: then the forward's own picks); each micro-batch then adds its share
E * sum_i (C_i / R) * S_i(micro-batch) / R (`micro_aux`), whose sum over micro-batches and ranks is `aux`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpufleet.dist import all_reduce_sum


@dataclass(frozen=True)
class Picks:
    """The step's top-k picks per expert (`counts`, summed over layers, micro-batches and ranks) and its
    attended tokens x layers (`rows`)."""

    counts: torch.Tensor
    rows: float


def routing_shape(config) -> tuple[int, int]:
    """(experts, experts a token) of a (text) model config, as HF's loss reads them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_experts), int(text.num_experts_per_tok)


def picks(router_logits: tuple, mask: torch.Tensor, experts: int, top_k: int) -> Picks:
    """One forward's top-k picks per expert over its attended tokens (`mask`, (B, T)) and every layer."""
    flat = mask.reshape(-1).float()
    counts = torch.zeros(experts, dtype=torch.float32, device=flat.device)
    with torch.no_grad():
        for layer in router_logits:
            chosen = torch.topk(layer.float().softmax(dim=-1), top_k, dim=-1).indices.to(flat.device)
            counts.scatter_add_(0, chosen.reshape(-1), flat.repeat_interleave(top_k))
    return Picks(counts, float(flat.sum()) * len(router_logits))


def micro_aux(router_logits: tuple, mask: torch.Tensor, step: Picks, experts: int) -> torch.Tensor:
    """This micro-batch's share of the step's aux loss: E * sum_i (C_i / R) * S_i / R (with its gradient)."""
    flat = mask.reshape(-1).float()
    sums = sum(
        (layer.float().softmax(dim=-1) * flat.to(layer.device)[:, None]).sum(dim=0) for layer in router_logits
    )
    share = step.counts.to(sums.device) / step.rows
    return experts * (share * sums).sum() / step.rows


@dataclass(frozen=True)
class StepRouter:
    """One optimizer step's router loss: its weight (algorithm.router_aux_loss_coef as TRL takes it), the
    model's routing shape, and the step's picks (None: the step is one forward, whose own picks count)."""

    coef: float
    experts: int
    top_k: int
    picks: Picks | None

    def loss(self, router_logits: tuple, mask: torch.Tensor, ranks: int) -> tuple[torch.Tensor, float]:
        """(what a micro-batch adds to the loss it backpropagates, its share of the step's aux loss). DDP
        and FSDP average the ranks' gradients: x ranks makes that the gradient of the step's loss."""
        step = self.picks or picks(router_logits, mask, self.experts, self.top_k)
        aux = micro_aux(router_logits, mask, step, self.experts)
        return self.coef * ranks * aux, float(aux.detach())


def step_router(p, micro_batches: list, autocast) -> StepRouter | None:
    """The step's router loss for a Mixture-of-Experts policy (None: off, `Parts.router_aux` 0)."""
    if not p.router_aux:
        return None
    experts, top_k = routing_shape(p.policy.config)
    step = step_picks(p.train_model, micro_batches, p.rt, experts, top_k, autocast)
    return StepRouter(p.router_aux, experts, top_k, step)


def step_picks(model, micro_batches: list, rt, experts: int, top_k: int, autocast) -> Picks | None:
    """The step's picks over every micro-batch of every policy rank (a no-grad forward of each); None where
    the step is one micro-batch on one rank (its forward's own picks are the step's)."""
    if len(micro_batches) == 1 and rt.policy_size == 1:
        return None
    counts, rows = torch.zeros(experts), 0.0
    with torch.no_grad(), autocast():
        for mb in micro_batches:
            out = model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=(mb.attention_mask.long().cumsum(dim=1) - 1).clamp_(min=0),
                use_cache=False,
                logits_to_keep=1,
                output_router_logits=True,
            )
            got = picks(out.router_logits, mb.attention_mask, experts, top_k)
            counts, rows = counts + got.counts.cpu(), rows + got.rows
    total = all_reduce_sum(rt, torch.cat([counts, torch.tensor([rows])]))
    return Picks(total[:-1], float(total[-1]))
