"""The README's quickstart, run top to bottom as a new user would (issue 17): every command in its code
block, in order, through the installed `gpufleet` command, in a copy of the examples; then what its text
claims: the model learns, the 2-process run matches, the exported model loads and writes the letters."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import console_script

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```", 2)[1]
    text = re.sub(r"\\\n\s*", "", block)  # join continued lines
    return [line.split("  #")[0].strip() for line in text.strip().splitlines() if line.strip()]


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("GPUFLEET_")}
    while "=" in words[0]:  # VAR=value prefixes
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == ".venv/bin/gpufleet", command
    return subprocess.run(
        [console_script(), *words[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def last(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


def test_the_quickstart_does_what_the_readme_says(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    commands = quickstart_commands()
    assert len(commands) >= 6 and any("export" in c for c in commands)
    for command in commands:
        p = run(command, tmp_path)
        assert p.returncode == 0, f"{command}\n{p.stdout}\n{p.stderr}"
        assert "Traceback" not in p.stdout + p.stderr
    one, two = tmp_path / "runs" / "quickstart", tmp_path / "runs" / "quickstart-2p"
    assert last(one / "metrics.jsonl")["reward"] >= 0.9  # "the mean reward goes from about 0.01 to 1.0"
    assert last(two / "metrics.jsonl")["reward"] >= 0.9
    assert (one / "logs" / "rank0.log").is_file() and (two / "logs" / "rank1.log").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "runs" / "quickstart-model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok("k:", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.startswith("kkkkkkkk"), text  # the README: writes the letter 8 times, then does not stop
