"""The decode loop of ``rollout.generate`` in torch operations, and the step it calls.

``loop`` runs the steps (sample, mask finished rows, stop when every row -- of every rank, with
``all_done`` -- is done); ``stepper`` gives it each step's logits, through the fast decoder
(``fastdecode.FastDecoder``: it drops finished rows as they pile up; on a GPU a CUDA-graph replay runs
every row) or the Hugging Face forward with a ``DynamicCache``. ``nativeloop.decode`` is the same loop with
its bookkeeping in C, where it applies. No state of its own: ``rollout._decode`` builds both per call.
"""

from __future__ import annotations

import torch

from gpufleet.engine.fastdecode import FastDecoder


def loop(forward, sample, prompt, prompt_mask, mask, eos_token_id, pad_token_id, all_done, every=1):
    """The decode loop in torch operations: (completion ids, completion mask), each (B, steps).
    ``forward(t, step_input, positions, done)``: step t's logits; ``sample(logits, t)``: its tokens;
    ``mask`` (B, prompt + max new tokens): the prompt's mask, then each step's live rows (filled here).
    ``every``: ask whether every row is done (a host sync) after every ``every``-th step only; steps
    run past the last row's EOS are cut off at the end (their rows are all done: pads, mask 0), so the
    result is the same as checking every step."""
    batch, width = prompt_mask.shape
    max_new_tokens = mask.shape[1] - width
    device = prompt_mask.device
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    next_pos = prompt_mask.sum(dim=1, keepdim=True)  # position id of the next token of each row
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp_(min=0)
    step_input, steps = prompt, 0
    for t in range(max_new_tokens):
        token = sample(forward(t, step_input, positions, done), t)
        token = token.masked_fill_(done, pad_token_id)
        out[:, t] = token
        mask[:, width + t] = (~done).long()
        done |= token == eos_token_id
        steps = t + 1
        if steps % every and steps < max_new_tokens:
            finished = False
        else:
            finished = bool(done.all())
        if all_done is not None:
            finished = all_done(finished)
        if finished:
            break
        step_input, positions = token.unsqueeze(1), next_pos
        next_pos = next_pos + 1
    if every > 1:  # the steps after every row was done: none of their columns is live
        steps = int(mask[:, width : width + steps].any(dim=0).nonzero().max()) + 1
    return out[:, :steps].clone(), mask[:, width : width + steps].clone()


def stepper(
    model,
    decoder: FastDecoder | None,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    mask: torch.Tensor,
    max_new_tokens: int,
    drop_fraction: float,
):
    """`forward(t, step_input, positions, done)`: the last logits of decode step t, through ``decoder``
    (``rollout._fast_decoder``'s) where it is exact, else through the HF forward with a cache (`mask`: the
    caller's live mask).

    The fast path stops computing rows that are ``done`` once ``drop_fraction`` of the rows it still
    runs have finished (their logits are then 0: the caller discards them)."""
    from transformers import DynamicCache

    width = prompt.shape[1]
    if decoder is not None:  # the same rule as below: tokens after EOS go unmasked, their logits unused
        rows = torch.arange(prompt.shape[0], device=prompt.device)  # the rows the decoder still runs

        def fast(
            t: int, step_input: torch.Tensor, positions: torch.Tensor, done: torch.Tensor
        ) -> torch.Tensor:
            nonlocal rows
            if t == 0:
                return decoder.prefill(prompt, prompt_mask, positions, max_new_tokens)
            if decoder.graph is not None:  # a CUDA graph runs every row (and counting them would sync)
                return decoder.step(step_input.squeeze(1), positions)
            live = ~done[rows]
            if int(live.sum()) <= (1 - drop_fraction) * len(rows):
                keep = live.nonzero().squeeze(1)
                decoder.keep(keep)
                rows = rows[keep]
            if len(rows) == prompt.shape[0]:
                return decoder.step(step_input.squeeze(1), positions)
            out = torch.zeros((prompt.shape[0], decoder.vocab), dtype=torch.float32, device=prompt.device)
            if len(rows):  # none: every row is done, and the caller runs on (all_done of other ranks)
                out[rows] = decoder.step(step_input.squeeze(1)[rows], positions.reshape(-1)[rows])
            return out

        return fast
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    # Without left padding the HF mask can be None: the mask would then only hide the tokens after a
    # row's EOS from that row's own later steps, whose logits are discarded (rows never attend to
    # each other), so every kept logit is the same; HF skips building and checking the mask.
    unpadded = bool(prompt_mask.all())

    def hf(t: int, step_input: torch.Tensor, positions: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        return model(
            input_ids=step_input,
            attention_mask=None if unpadded else mask[:, : width + t],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]

    return hf
