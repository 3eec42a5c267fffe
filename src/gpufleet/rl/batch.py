"""The generation batch: sequences, masks, advantages and (when needed) old / reference log-probs.

Layout of one generation batch across ranks. Its rows are the completions of P prompts, G each, in
(prompt, generation) order: row j is generation j % G of prompt j // G. Optimizer step s of the
generation batch uses the rows [s*B, (s+1)*B) where B = per_device_batch x policy ranks, and policy
rank r holds [s*B + r*b, s*B + (r+1)*b) of them (b = per_device_batch). So which completions enter
which optimizer step does not depend on the number of ranks, only on the global batch.

Each rank keeps its rows in step-major order; the trainer takes `per_device_batch` of them per
optimizer step (`rows`) and micro-batches of those (`split`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields

import torch

from gpufleet.datafile import prompt_chars
from gpufleet.engine import packing
from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.engine.rollout import Rollout
from gpufleet.parallel import decoder_layers


@dataclass
class GenerationBatch:
    input_ids: torch.Tensor  # (N, P+T)
    attention_mask: torch.Tensor  # (N, P+T)
    completion_mask: torch.Tensor  # (N, T) float
    advantages: torch.Tensor  # (N,)
    old_logprobs: torch.Tensor | None  # (N, T), from the generating policy when it is reused
    ref_logprobs: torch.Tensor | None  # (N, T)
    completion_start: int
    sampler_weights: torch.Tensor | None = None
    """(N, T) truncated importance weights pi_trainer / pi_sampler of a rollout rank's samples
    (rl/offpolicy.py), or None: sampled by the policy itself."""
    sampling_logprobs: torch.Tensor | None = None
    """(N, T) a rollout rank's sampling log-probs whose weights the optimizer step forms from the training
    forward's log-probs (a batch used once: rl/sampler.py `in_loss`), or None."""

    def rows(self, start: int, stop: int) -> GenerationBatch:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[start:stop] if isinstance(v, torch.Tensor) else v
        return GenerationBatch(**out)

    def split(self, size: int) -> list[GenerationBatch]:
        n = self.input_ids.shape[0]
        return [self.rows(i, min(i + size, n)) for i in range(0, n, size)]

    def completion_lengths(self) -> list[int]:
        """Per row, the completion positions a forward must see: up to the last attended one (EOS, or
        an env episode's last token), 0 for none."""
        attended = self.attention_mask[:, self.completion_start :] > 0
        steps = torch.arange(1, attended.shape[1] + 1, device=attended.device)
        return (attended * steps).amax(dim=1).tolist()

    def pick(self, index: list[int], width: int) -> GenerationBatch:
        """Rows `index`, in that order, their completions cut to the first `width` positions (what comes
        after a row's last attended token changes nothing before it in a causal model)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.numel():  # a scorer's batch has no mask or advantages
                v = v[index]
                if f.name in ("input_ids", "attention_mask"):
                    v = v[:, : self.completion_start + width]
                elif v.dim() == 2:
                    v = v[:, :width]
            out[f.name] = v
        return GenerationBatch(**out)

    def micro_batches(self, size: int, pass_cost: int | None) -> list[tuple[list[int], GenerationBatch]]:
        """The batch as micro-batches of at most `size` rows, each with its rows' indices: rows longest
        completion first and each micro-batch cut to its longest (`length_groups`); with `pass_cost`
        (`pass_tokens`), a micro-batch is cut further where one more pass costs less than the padding
        it saves."""
        lengths = self.completion_lengths()
        groups = length_groups(lengths, size, self.completion_start, pass_cost)
        return [(g, self.pick(g, max(1, lengths[g[0]]))) for g in groups]

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum().item())


PASS_FLOPS = 3e8
"""What one more forward + backward pass costs on a CPU per decoder layer, in FLOPs of the batch's
tokens: with the `small` benchmark model (bench/measure.py: 4 layers, 3.17M weights) a pass took about
20 ms beyond its 0.3 ms per token, 64 tokens' worth at 6 x 3.17M FLOPs a token."""


def pass_tokens(model: torch.nn.Module) -> int | None:
    """What one more forward + backward pass of `model` costs in tokens of a batch on a CPU (64 for the
    `small` benchmark model, 1,250 for the tiny built-in one, 2 for a 0.5B model); None on a GPU, where a
    pass is hundreds of kernel launches whatever its size, or where the decoder layers are not found."""
    inner = getattr(model, "module", model)  # DDP
    first = next(inner.parameters(), None)
    if first is None or first.device.type != "cpu":
        return None
    try:
        layers = len(decoder_layers(inner))
    except ValueError:
        return None
    return max(1, round(PASS_FLOPS * layers / (6 * sum(p.numel() for p in inner.parameters()))))


PACK_SHARE = 0.25
"""What packing a micro-batch's rows costs on a CPU (engine/packing.py: the layout, the packed positions,
the results scattered back to (B, T)) as a share of one more pass (``pass_tokens``): the tiny built-in
model's `speed` optimizer step took 17.0-17.2 vs 16.3-16.6 ms packed, saving 58 of 272 positions (best
of 10, alternating, two runs, with the attention's C kernel; before it, with a gather each way around every attention,
the whole `speed` step took about 4 ms longer packed)."""


def pack_over(model: torch.nn.Module) -> int | None:
    """The padded positions a packed forward of ``model`` must save to pay for itself (``PACK_SHARE`` of
    ``pass_tokens``: 16 for the `small` benchmark model, 312 for the tiny built-in one); None where no
    pass cost is known (not on a CPU: nothing is packed there)."""
    cost = pass_tokens(model)
    return None if cost is None else int(cost * PACK_SHARE)


def length_cut(model: torch.nn.Module, early: tuple[int | None, int]) -> int | None:
    """The ``pass_cost`` of ``GenerationBatch.micro_batches`` for ``model``: ``pass_tokens``, or None where
    its forward packs the rows (engine/packing.py): then a micro-batch with more padding than ``pack_over`` is
    packed, and one with less would not have been cut either (a pass costs more than packing); one whose
    rows do not pack (``packing.pack``) runs padded, uncut (slower, the same values).
    ``early``: (EOS id, min_new_tokens). Call it under the forward's autocast."""
    return None if packing.applies(model, *early) else pass_tokens(model)


def length_groups(lengths: list[int], size: int, fixed: int, pass_tokens: int | None) -> list[list[int]]:
    """Row indices of the micro-batches: rows by `lengths` longest first (stable), `size` at a time. With
    `pass_tokens`, a group is cut in two where that lowers its cost, rows x (`fixed` + its longest) summed
    over the parts plus `pass_tokens` per part, and each part again. Which rows share a micro-batch
    changes no gradient: the loss's normaliser is the step's (rl/update.py)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    if pass_tokens is None:
        return groups
    return [part for g in groups for part in _cut(g, lengths, fixed, pass_tokens)]


def _cut(group: list[int], lengths: list[int], fixed: int, pass_tokens: int) -> list[list[int]]:
    n, longest = len(group), fixed + lengths[group[0]]
    best, at = n * longest, 0
    for k in range(1, n):  # the first k rows padded to the longest, the rest to row k's length
        cost = k * longest + (n - k) * (fixed + lengths[group[k]]) + pass_tokens
        if cost < best:
            best, at = cost, k
    if not at:
        return [group]
    return _cut(group[:at], lengths, fixed, pass_tokens) + _cut(group[at:], lengths, fixed, pass_tokens)


def reuse_count(job) -> int:
    """Optimizer steps taken on one generation batch: steps_per_generation x num_iterations."""
    return job.train.steps_per_generation * job.algorithm.num_iterations


def rank_rows(
    policy_index: int, policy_size: int, per_device_batch: int, steps_per_generation: int
) -> list[int]:
    """Global row indices of the generation batch that policy rank `policy_index` holds, in step order."""
    step_rows = per_device_batch * policy_size
    first = policy_index * per_device_batch
    return [s * step_rows + first + i for s in range(steps_per_generation) for i in range(per_device_batch)]


def completion_seed(seed: int, position: int, generation: int) -> int:
    """Sampling seed of one completion, from (train.seed, prompt stream position, index in its group).

    Seeding per prompt, not per rank, makes the completions independent of how prompts are split
    across ranks or batches.
    """
    return (seed * 1_000_003 + position) * 1_009 + generation


@torch.no_grad()
def logprobs_of(
    model,
    batch: GenerationBatch,
    temperature: float,
    micro: int,
    autocast,
    suppress_tokens=(),
    early: tuple[int | None, int] = (None, 0),
) -> torch.Tensor:
    """No-grad log-probs of the batch's completions under `model` (old or reference log-probs), `micro`
    rows at a time, with `suppress_tokens` at probability 0 as in sampling, and `early` = (EOS id,
    min_new_tokens): EOS at probability 0 before min_new_tokens, as in sampling. The micro-batches are
    `GenerationBatch.micro_batches` (cut further on a CPU unless packed); past the longest row of its micro-batch a row's
    log-probs are 0 (the mask leaves them out, as every position past a row's end)."""
    ids = batch.input_ids
    out = torch.zeros(ids.shape[0], ids.shape[1] - batch.completion_start, device=ids.device)
    with autocast():
        cut = length_cut(model, early)
    over = pack_over(model)
    for index, mb in batch.micro_batches(micro, cut):
        with autocast():
            lp, _ = sequence_logprobs(
                model,
                mb.input_ids,
                mb.attention_mask,
                mb.completion_start,
                temperature=temperature,
                suppress_tokens=suppress_tokens,
                eos_token_id=early[0],
                min_new_tokens=early[1],
                pack_over=over,
                entropy=False,
            )
        out[index, : lp.shape[1]] = lp.float()
    return out


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
    segments: list | None = None
    """Env jobs: each row's transcript as (text, is the policy's) pieces, for samples.jsonl."""
    logged: dict[str, float] = field(default_factory=dict)
    """What reward functions logged with TRL's `log_metric` this step (mean over the policy ranks)."""
    extras: list[dict] = field(default_factory=list)
    """Per row, the columns reward functions logged with TRL's `log_extra` (samples.jsonl)."""


def encode_prompt(tokenizer, text: str, max_len: int, name: str) -> list[int]:
    """The last `max_len` token ids of `text`, tokenising only its last characters (datafile.py `prompt_chars`);
    a tokenizer that cannot encode it is a UserError naming the prompt (`name`)."""
    from gpufleet.errors import UserError

    keep = prompt_chars(max_len)
    try:
        ids = tokenizer.encode(text[-keep:], add_special_tokens=False)
    except Exception as e:  # the tokenizer's own error, whatever its type: name the prompt, not a traceback
        shown = repr(text[:80]) + ("..." if len(text) > 80 else "")
        raise UserError(
            f"the tokenizer cannot encode {name} ({shown}): {type(e).__name__}: {e}",
            field="model.path",
            fix="clean that prompt's text, or use a tokenizer that can encode it",
        ) from None
    return keep_last(ids, max_len, name, more=len(text) > keep)


_cut_said = False


def keep_last(ids: list[int], max_len: int, name: str, more: bool = False) -> list[int]:
    """A prompt's last `max_len` ids (rollout.max_prompt_length), as train feeds every prompt. The first
    cut in a process prints one warning line (stderr: the console, the rank's log) naming that prompt
    and the length that keeps it whole; `more`: `ids` are already its last part (`encode_prompt`)."""
    global _cut_said
    if (len(ids) > max_len or more) and not _cut_said:
        _cut_said = True
        n, whole = (
            (f"over {len(ids)}", "or more keeps it whole") if more else (str(len(ids)), "keeps it whole")
        )
        print(
            f"gpufleet: warning: {name} is {n} tokens, longer than rollout.max_prompt_length {max_len}: "
            f"its first tokens are cut, as those of any longer prompt (said once); --set "
            f"rollout.max_prompt_length={len(ids)} {whole}, if the model holds it (gpufleet check lists a data "
            "file's longest)",
            file=sys.stderr,
        )
    return ids[-max_len:]


def tokenize_prompts(
    tokenizer, prompts: list, max_len: int, names: list[str] | None = None, template_kwargs=None
) -> tuple[list[list[int]], list[str]]:
    """Token ids (left-truncated to max_len) and the prompt text; chat prompts get the chat template (with
    `template_kwargs`: rollout.chat_template_kwargs, as TRL passes them). `names`: how errors name each
    prompt (e.g. "row 7 of data.jsonl")."""
    names = names or [f"prompt {i}" for i in range(len(prompts))]
    kw = dict(template_kwargs or {})
    texts = [_render(tokenizer, p, name, kw) for p, name in zip(prompts, names, strict=True)]
    ids = [encode_prompt(tokenizer, t, max_len, name) for t, name in zip(texts, names, strict=True)]
    return ids, texts


def _render(tokenizer, prompt, name: str, template_kwargs: dict) -> str:
    if not isinstance(prompt, list):
        return prompt
    from gpufleet.errors import UserError

    try:
        return tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
    except Exception as e:  # the chat template (jinja) refused these messages
        raise UserError(
            f"the chat template cannot render {name}: {type(e).__name__}: {e}",
            field="data.prompt_field",
            fix="give that row messages the template accepts ({'role': 'user', 'content': '...'})",
        ) from None
