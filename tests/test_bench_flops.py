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


def test_phase_table_on_a_gpu_uses_wall_time():
    """On a GPU (`gemm_peak.py --device cuda`) the whole-step figures divide by wall time per step, not by
    the launching thread's CPU time; on the CPU, by CPU time."""
    from phases import phase_table

    # one step after warm-up: 1.0 s wall, 0.25 s CPU; FLOPs of the step at CFG, batch 2, prompt 2,
    # longest completion 3, beta 0.04 (test_step): 3200 + 4 x forward
    forward = 2 * (2 * 144 * 5 + 2 * 40 * 4 + 4 * 4 * 25)
    total = 3200 + 4 * forward
    run = {
        "step_time": [9.0, 1.0],
        "cpu_step_time": [9.0, 0.25],
        "max_length": [3, 3],
        "timing": {"timing/generate": [0.0, 0.5], "timing/backward": [0.0, 0.5]},
    }
    shapes = [{"name": "decode q/o", "cpu_flops": 1e3}]
    gpu = {"peak_cpu": 1e4, "peak_wall": 1e4, "square_cpu": 1e4, "square": 8192, "threads": 8}
    gpu |= {"device": "cuda", "dtype": "bfloat16", "shapes": shapes}
    lines = phase_table(CFG, 2, 2, 0.04, [run], [run], 1, gpu)
    step = next(x for x in lines if x.startswith("| **gpufleet, whole step**"))
    assert "(wall time)" in step and f"| 1000 | {total / 1.0 / 1e9:.1f} |" in step
    assert "bfloat16, cuda" in lines[0] and "8192^3 square" in lines[0]
    cpu = gpu | {"device": "cpu", "dtype": "float32", "square": 1024}
    step = next(x for x in phase_table(CFG, 2, 2, 0.04, [run], [run], 1, cpu) if "gpufleet, whole" in x)
    assert "(CPU time)" in step and "| 250 |" in step


def test_phase_times_are_medians_as_the_steps_are():
    """A final checkpoint's save (one step of several) moves neither the step's median nor its phase's row
    (it once showed as 1,579 ms of checkpoint per 597 ms step, the mean of one 11 s save over 7 steps)."""
    from phases import phase_table

    run = {
        "step_time": [9.0, 1.0, 1.0, 12.0],
        "cpu_step_time": [9.0, 1.0, 1.0, 12.0],
        "max_length": [3, 3, 3, 3],
        "timing": {
            "timing/generate": [0.0, 0.5, 0.6, 0.5],
            "timing/backward": [0.0, 0.5, 0.4, 0.5],
            "timing/checkpoint": [0.0, 0.0, 0.0, 11.0],
        },
    }
    peak = {"peak_cpu": 1e4, "peak_wall": 1e4, "square_cpu": 1e4, "square": 1024, "threads": 1}
    peak |= {"device": "cpu", "dtype": "float32", "shapes": [{"name": "decode q/o", "cpu_flops": 1e3}]}
    lines = phase_table(CFG, 2, 2, 0.04, [run], [run], 1, peak)
    row = {x.split(" | ")[0].lstrip("| "): x.split(" | ")[2] for x in lines if x.startswith("| ")}
    assert row["checkpoint"] == "0" and row["generate"] == "500" and row["backward"] == "500"
    assert row["**gpufleet, whole step** (CPU time)"] == "1000"


def test_the_step_against_each_runs_own_peak():
    from phases import run_peak_lines

    # 1 GFLOP per step; gpufleet's runs: median steps 0.5 s and 0.25 s at peaks 4 and 8 GFLOP/s -> 50%, 50%;
    # TRL's: 1 s at 5 GFLOP/s -> 20%. The warm-up step (first) is left out.
    gf = [{"cpu_step_time": [9.0, 0.5], "peak": 4e9}, {"cpu_step_time": [9.0, 0.25], "peak": 8e9}]
    trl = [{"cpu_step_time": [9.0, 1.0], "peak": 5e9}]
    (line, _) = run_peak_lines(1e9, gf, trl, 1, "cpu_step_time")
    assert "(4.0-8.0 GFLOP/s, median 5.0): gpufleet **50%**, TRL 20%" in line
    assert (
        run_peak_lines(1e9, [{"cpu_step_time": [1.0]}], trl, 0, "cpu_step_time") == []
    )  # no peak: older files


def test_the_peak_is_the_best_measurement_and_the_attended_tokens_are_counted_too():
    from phases import phase_table

    run = {
        "step_time": [9.0, 1.0],
        "cpu_step_time": [9.0, 1.0],
        "max_length": [3, 3],
        "completion_length": [3.0, 1.0],  # the step after warm-up: rows of 1 token on average
        "timing": {"timing/generate": [0.0, 0.5], "timing/backward": [0.0, 0.5]},
        "peak": 2e4,  # measured after the run, above the measurement before the runs
    }
    before = {"peak_cpu": 1e4, "peak_wall": 1e4, "square_cpu": 1e4, "square": 1024, "threads": 1}
    before |= {"device": "cpu", "dtype": "float32", "shapes": [{"name": "decode q/o", "cpu_flops": 1e3}]}
    lines = phase_table(CFG, 2, 2, 0.04, [run], [run], 1, before)
    assert "the best of the measurement before the runs and those after each" in lines[0]
    whole = step_flops(CFG, 2, 2, 3, 0.04)["total"]
    attended = step_flops(CFG, 2, 2, 1, 0.04)["total"]
    step = next(x for x in lines if x.startswith("| **gpufleet, whole step**"))
    assert f"**{whole / 2e4:.0%}**" in step  # of the better peak
    (line,) = [x for x in lines if x.startswith("Counting only")]
    assert f"{attended / 1e9:.2f} GFLOP per step, gpufleet {attended / 2e4:.0%} of the peak" in line
