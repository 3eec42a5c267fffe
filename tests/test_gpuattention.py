"""The GPU decoder's Triton attention (engine/gpuattention.py) and compiled layer pieces
(engine/decodecompile.py), checked on the CPU: the kernels through Triton's interpreter
(``TRITON_INTERPRET=1``, in a child Python: Triton reads it when the kernels are defined) against
SDPA over the keys each row holds, and inside the fast decoder against its usual steps; the compiled
pieces (Inductor's CPU backend) against the plain ones. On a GPU, tests/test_graphdecode.py's CUDA
tests run the decoder with both (they are on there by default)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gpufleet.engine import decodecompile
from gpufleet.engine.gpuattention import plan_splits

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")


def run_interpreted(code: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", GPUFLEET_CPU_KERNELS="0")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_splits_cover_the_cache_in_whole_blocks():
    for rows, kv, capacity, sms in [(16, 2, 768, 132), (256, 2, 768, 132), (1, 1, 10, 4), (3, 4, 1000, 8)]:
        count, per_split = plan_splits(rows, kv, capacity, sms)
        assert per_split % 64 == 0 and count * per_split >= capacity > (count - 1) * per_split
    assert plan_splits(16, 2, 768, 132)[0] > 1 and plan_splits(256, 2, 768, 132)[0] == 1


def test_the_kernels_attend_to_each_rows_keys_as_sdpa_does():
    """GQA groups of 7 and 6 (Qwen2.5-0.5B / 1.5B), none; padded rows (start > 0); one split or many,
    empty splits past the slot; a slot short of the cache's end."""
    out = run_interpreted(
        """
        import torch, torch.nn.functional as F
        from gpufleet.engine import gpuattention as ga
        assert ga.usable(torch.device("cpu"))
        torch.manual_seed(0)
        worst = 0.0
        for rows, heads, kv, dim, capacity in [(3, 14, 2, 64, 150), (2, 12, 2, 128, 70), (4, 4, 4, 64, 40)]:
            q = torch.randn(rows, heads, dim)
            k, v = torch.randn(rows, kv, capacity, dim), torch.randn(rows, kv, capacity, dim)
            start, slot = torch.randint(0, 5, (rows,)), torch.tensor([capacity - 7])
            for splits in [None, (3, 64), (1, capacity + 64)]:
                got = ga.attend(q, k, v, start, slot, 0.125, splits)
                for b in range(rows):
                    keys = slice(int(start[b]), int(slot) + 1)
                    kk = k[b, :, keys].repeat_interleave(heads // kv, 0)
                    vv = v[b, :, keys].repeat_interleave(heads // kv, 0)
                    ref = F.scaled_dot_product_attention(q[b][:, None], kk, vv, scale=0.125)[:, 0]
                    worst = max(worst, float((got[b] - ref.reshape(-1)).abs().max()))
        print(worst)
        """
    )
    assert float(out) < 1e-5


def test_the_kernel_writes_the_steps_keys_and_values_and_attends_to_them():
    """``new``: the step's keys and values (strided views, as the decoder's q/k/v split leaves them; q too) land
    in the slot of every row and head, the output is the attention with them written first (one split or
    several, the slot at a split's first key), and the rest of the cache is untouched."""
    out = run_interpreted(
        """
        import torch
        from gpufleet.engine import gpuattention as ga
        torch.manual_seed(1)
        worst, exact = 0.0, True
        rows, heads, kv, dim, capacity = 3, 14, 2, 64, 150
        q = torch.randn(dim, heads + 2 * kv, rows).permute(2, 1, 0)[:, :heads]  # the few-row matmul's layout
        fresh = torch.randn(dim, rows, 2 * kv).permute(1, 2, 0)  # stride over D is not 1
        k_new, v_new = fresh[:, :kv], fresh[:, kv:]
        start = torch.tensor([0, 3, 1])
        for at, splits in [(140, None), (64, (3, 64)), (64, (1, capacity + 64))]:
            k, v = torch.randn(rows, kv, capacity, dim), torch.randn(rows, kv, capacity, dim)
            slot = torch.tensor([at])
            k_ref, v_ref = k.clone(), v.clone()
            k_ref[:, :, at], v_ref[:, :, at] = k_new, v_new
            ref = ga.attend(q.contiguous(), k_ref, v_ref, start, slot, 0.125, splits)
            got = ga.attend(q, k, v, start, slot, 0.125, splits, new=(k_new, v_new))
            worst = max(worst, float((got - ref).abs().max()))
            exact &= torch.equal(k, k_ref) and torch.equal(v, v_ref)
        print(worst, exact)
        """
    )
    worst, exact = out.split()
    assert float(worst) < 1e-6 and exact == "True"


@pytest.mark.slow  # end to end (~10 s); make test-slow runs it
def test_the_decoder_with_the_kernels_gives_its_usual_logits_and_rollouts():
    """Prefill + decode steps of the fast decoder (padded prompts, GRPO groups prefilled once) through
    the kernels, against the same decoder with them off (SDPA over the written slots), and a rollout."""
    out = run_interpreted(
        """
        import os, torch
        from gpufleet.engine import gpuattention, rollout
        from gpufleet.engine.fastdecode import FastDecoder
        from gpufleet.engine.rollout import left_pad
        from gpufleet.models import load_causal_lm
        from gpufleet.models.builtin import materialize
        model = load_causal_lm(str(materialize("tiny-qwen2"))).eval()
        prompts = [[5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10]]
        ids, mask = left_pad(prompts, 0, "cpu")
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        tokens = torch.randint(2, 80, (4, 9), generator=torch.Generator().manual_seed(5))

        def logits(on):
            os.environ[gpuattention.ATTENTION_ENV] = "1" if on else "0"
            decoder = FastDecoder(model, layout="fused")
            with torch.inference_mode():
                out = [decoder.prefill(ids, mask, positions, 9)]
                assert (decoder.start is not None) == on
                out += [decoder.step(tokens[:, t], mask.sum(1) + t) for t in range(9)]
            return torch.stack(out)

        def tokens_of(on):
            os.environ[gpuattention.ATTENTION_ENV] = "1" if on else "0"
            kw = dict(max_new_tokens=12, eos_token_id=1, pad_token_id=0, temperature=1.0)
            return rollout.generate(model, prompts, seeds=[1, 2, 3, 4], **kw).completion_ids

        print(float((logits(True) - logits(False)).abs().max()), torch.equal(tokens_of(True), tokens_of(False)))
        """
    )
    worst, same = out.split()
    assert float(worst) < 1e-5 and same == "True"


@pytest.mark.slow
def test_the_compiled_layer_pieces_give_the_plain_steps_tokens(monkeypatch):
    """Inductor's CPU backend compiles the two pieces once for every layer (4 graphs: 2 pieces, then one
    dynamic recompile for a second batch size), and the rollouts are the plain ones."""
    from torch._dynamo.utils import counters

    from gpufleet.engine import rollout
    from gpufleet.models import load_causal_lm
    from gpufleet.models.builtin import materialize

    monkeypatch.setenv("GPUFLEET_CPU_KERNELS", "0")
    model = load_causal_lm(str(materialize("tiny-qwen2"))).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10]]

    def tokens(rows: int) -> torch.Tensor:
        kw = dict(max_new_tokens=10, eos_token_id=1, pad_token_id=0, temperature=1.0)
        return rollout.generate(model, prompts[:rows], seeds=list(range(rows)), **kw).completion_ids

    plain = [tokens(4), tokens(3)]
    monkeypatch.setattr(decodecompile, "usable", lambda device: True)
    counters.clear()
    compiled = [tokens(4), tokens(3)]
    assert all(torch.equal(a, b) for a, b in zip(plain, compiled, strict=True))
    assert counters["stats"]["unique_graphs"] <= 4 and not decodecompile._failed
