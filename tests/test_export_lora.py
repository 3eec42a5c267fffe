"""A LoRA run with an adapter on the tied output head, through the installed command from a user's folder:
training prints no peft warning, its adapter files hold the adapter alone (not the frozen vocab x hidden
matrix), and `export --merge` writes every file readable by all with the generation config a trained
model carries (suppress_tokens, min_new_tokens)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from safetensors import safe_open

from helpers import run_user

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lora_on_the_tied_head_trains_quietly_and_merges_readable_with_its_generation_config(tmp_path):
    run = tmp_path / "run"
    sets = ["train.max_steps=2", "train.per_device_batch=16", "train.log_every=1", f"output.dir={run}"]
    argv = ["train", str(ROOT / "examples" / "quickstart-lora.yaml"), "--gpus", "cpu"]
    p = run_user(*argv, *(x for s in sets for x in ("--set", s)), cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Warning" not in p.stdout + p.stderr, p.stderr  # peft's tied-weights and save_embedding_layers
    with safe_open(run / "final" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert any("lm_head.lora_A" in k for k in keys) and not any("base_layer" in k for k in keys), keys

    merge = run_user("export", "run", "--to", "merged", "--merge", cwd=tmp_path)
    assert merge.returncode == 0 and "Warning" not in merge.stderr, merge.stdout + merge.stderr
    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "merged").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}, modes  # 0644 here
    gen = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert gen["suppress_tokens"] == [0] and gen["min_new_tokens"] == 8, gen  # the pad; the example's minimum
