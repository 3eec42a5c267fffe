"""train.torch_compile: the installed `gpufleet train`, compiled vs eager on the same job.

The compiled run must really compile (TorchInductor writes its kernels into the cache folder it is given),
sample exactly what the eager run samples (generation stays eager), and train to the same numbers within
float rounding (its fused kernels round differently; not bit for bit).
"""

from __future__ import annotations

import json

import pytest

from helpers import run_user, sets

JOB = """
model: {path: builtin:tiny-qwen2}
data: {path: builtin:repeat}
rollout: {max_prompt_length: 16, max_completion_length: 12}
algorithm: {num_generations: 4, beta: 0.04}
train: {per_device_batch: 16, max_steps: 3, learning_rate: 0.003, samples_every: 0}
output: {save_every: 0}
"""


def _train(tmp_path, name: str, compiled: bool) -> list[dict]:
    cache = tmp_path / f"inductor-{name}"
    r = run_user(
        "train",
        "job.yaml",
        *sets(f"output.dir={name}", f"train.torch_compile={str(compiled).lower()}"),
        cwd=tmp_path,
        env_extra={"TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    kernels = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert bool(kernels) == compiled, kernels[:5]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_compiled_trains_as_eager(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    eager = _train(tmp_path, "eager", False)
    compiled = _train(tmp_path, "compiled", True)
    assert len(eager) == len(compiled) == 3
    for e, c in zip(eager, compiled, strict=True):
        # the same completions (lengths, rewards): generation ran eagerly on weights equal within rounding
        for key in ("reward", "completions/mean_length", "completions/max_length"):
            assert c[key] == e[key], (key, c[key], e[key])
        for key in ("grad_norm", "kl", "entropy", "loss"):
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), (key, c[key], e[key])
    assert compiled[1]["grad_norm"] != 0.0 and compiled[2]["kl"] > 0.0
