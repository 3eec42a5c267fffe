"""bench/flops.py (the FLOPs `vs_trl.py` divides by phase times) against hand-computed values."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from flops import decode_flops, forward_flops, gemm_shapes, head_params, layer_params, step_flops  # noqa: E402

# 1 layer, hidden 4, 2 query heads and 1 key/value head of 2, SwiGLU 8, vocab 10
CFG = dict(
    hidden_size=4,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=2,
    intermediate_size=8,
    vocab_size=10,
)


def test_parameters():
    assert layer_params(CFG) == 4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 8 == 144
    assert head_params(CFG) == 40


def test_forward_and_decode():
    # per row: 2 x 144 x 3 tokens + 2 x 40 x 2 logit positions + attention 4 x 1 layer x 4 x 3 x 3
    assert forward_flops(CFG, rows=2, length=3, logit_positions=2) == 2 * (864 + 160 + 144)
    # prefill of 2 tokens (1 logit position): 2 x (576 + 80 + 64); then steps 1 and 2 attend to 4, 5 keys
    assert decode_flops(CFG, rows=2, prompt=2, steps=3) == 1440 + 2 * (368 + 64) + 2 * (368 + 80)


def test_step():
    f = step_flops(CFG, batch=2, prompt=2, completion=3, beta=0.04)
    forward = 2 * (2 * 144 * 5 + 2 * 40 * 4 + 4 * 4 * 25)
    assert f == {"generate": 3200, "score": forward, "backward": 3 * forward, "total": 3200 + 4 * forward}
    assert step_flops(CFG, batch=2, prompt=2, completion=3, beta=0.0)["score"] == 0


def test_gemm_shapes():
    shapes = {name: (m, k, n) for name, m, k, n in gemm_shapes(CFG, batch=2, prompt=2, completion=3)}
    assert shapes["train gate/up"] == (10, 4, 8) and shapes["decode down"] == (2, 8, 4)
    assert shapes["train head"] == (8, 4, 10) and shapes["train dW down"] == (8, 10, 4)


def test_floor():
    from phases import floor_lines

    # 6 GFLOP decoding at 30 GFLOP/s (best decode row) + 24 GFLOP at the 120 GFLOP/s peak = 0.4 s;
    # all 30 at the peak: 0.25 s; TRL 1 s per step; a 0.5 ratio needs 60 GFLOP/s, half the peak
    peak = {
        "peak_cpu": 120e9,
        "shapes": [{"name": "decode q/o", "cpu_flops": 30e9}, {"name": "train q/o", "cpu_flops": 120e9}],
    }
    (line,) = floor_lines({"generate": 6e9, "score": 6e9, "backward": 18e9, "total": 30e9}, peak, 1.0, 0.5)
    assert "250 ms per step with every FLOP at the peak (0.25 of TRL's step); 400 ms (0.40)" in line
    assert "(30.0 GFLOP/s)" in line and "needs 60.0 GFLOP/s over the whole step: 50% of the peak" in line
    assert "needs" not in floor_lines({"generate": 6e9, "total": 30e9}, peak, 1.0, None)[0]
