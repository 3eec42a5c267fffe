"""The host RAM a process takes to load a model (plan/host.py `converted_bytes`) against measurement:
the trainer's own loader (`models.load_causal_lm`) on a 42M-parameter bf16 checkpoint, in a fresh
process, its unique memory (USS) before and after. In the checkpoint's dtype the file is mapped (not
counted); in fp32 every parameter is converted into the process's memory (4 bytes each, within 5%)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpufleet.plan.host import converted_bytes

MEASURE = """
import gc, json, sys, psutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
from gpufleet.models import load_causal_lm
from gpufleet.models.builtin import materialize

cfg = AutoConfig.from_pretrained(materialize("tiny-qwen2"))
cfg.update(dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, vocab_size=32000))
cfg.update(dict(num_attention_heads=8, num_key_value_heads=4, head_dim=64, layer_types=["full_attention"] * 8))
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
params = sum(t.numel() for t in model.parameters())
model.save_pretrained(sys.argv[1])
del model
out = {"params": params}
p = psutil.Process()
for dtype in ("bfloat16", "float32"):
    load_causal_lm("builtin:tiny-qwen2", dtype=dtype)  # lazy imports and setup out of the measurement
    gc.collect()
    before = p.memory_full_info().uss
    model = load_causal_lm(sys.argv[1], dtype=dtype)
    out[dtype] = p.memory_full_info().uss - before
    del model
print(json.dumps(out))
"""


@pytest.mark.slow
def test_loading_holds_what_the_plan_counts(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr
    m = json.loads(run.stdout.strip().splitlines()[-1])
    n = m["params"]
    assert converted_bytes(n, "bfloat16", "bfloat16") == 0
    assert m["bfloat16"] < 0.25 * 2 * n, m  # mapped: only what loading touched
    planned = converted_bytes(n, "float32", "bfloat16")
    assert abs(m["float32"] / planned - 1) <= 0.05, (m, planned)
