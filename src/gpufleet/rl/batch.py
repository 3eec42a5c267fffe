"""The generation batch: sequences, masks, advantages and (when needed) old / reference log-probs.

`make_generation_batch` turns prompts into one scored batch (rollout -> rewards -> advantages).
The trainer then takes `per_device_batch` rows of it per optimizer step (`rows`), and micro-batches
of those (`split`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from gpufleet.rl.rollout import Rollout, sequence_logprobs


@dataclass
class GenerationBatch:
    input_ids: torch.Tensor  # (N, P+T)
    attention_mask: torch.Tensor  # (N, P+T)
    completion_mask: torch.Tensor  # (N, T) float
    advantages: torch.Tensor  # (N,)
    old_logprobs: torch.Tensor | None  # (N, T), from the generating policy when it is reused
    ref_logprobs: torch.Tensor | None  # (N, T)
    completion_start: int

    def rows(self, start: int, stop: int) -> GenerationBatch:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[start:stop] if isinstance(v, torch.Tensor) else v
        return GenerationBatch(**out)

    def split(self, size: int) -> list[GenerationBatch]:
        n = self.input_ids.shape[0]
        return [self.rows(i, min(i + size, n)) for i in range(0, n, size)]

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum().item())


def completion_seeds(seed: int, positions: list[int], num_generations: int) -> list[int]:
    """One sampling seed per completion, from (train.seed, prompt stream position, index in group).

    Seeding per prompt, not per rank, makes the completions independent of how prompts are split
    across ranks or batches.
    """
    return [(seed * 1_000_003 + p) * 1_009 + g for p in positions for g in range(num_generations)]


@torch.no_grad()
def logprobs_of(model, batch: GenerationBatch, temperature: float, micro: int, autocast) -> torch.Tensor:
    out = []
    for mb in batch.split(micro):
        with autocast():
            lp, _ = sequence_logprobs(
                model, mb.input_ids, mb.attention_mask, mb.completion_start, temperature=temperature
            )
        out.append(lp.float())
    return torch.cat(out)


@dataclass
class Scored:
    """What one generation step produced, for the batch and for the metrics."""

    batch: GenerationBatch
    rollout: Rollout
    prompts: list[str]
    completions: list[str]
    rewards: torch.Tensor  # (N,)
    per_function: torch.Tensor  # (N, F)
    stats: dict[str, float]


def tokenize_prompts(tokenizer, prompts: list, max_len: int) -> tuple[list[list[int]], list[str]]:
    """Token ids (left-truncated to max_len) and the prompt text; chat prompts get the chat template."""
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        if isinstance(p, list)
        else p
        for p in prompts
    ]
    ids = [tokenizer.encode(t, add_special_tokens=False)[-max_len:] for t in texts]
    return ids, texts
