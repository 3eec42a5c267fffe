"""`builtin:vault` (env/vault.py): the answer is the key only the tool knows; the shaping reward credits
the right call's prefix; the example job learns it (slow)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from gpufleet.env.vault import VaultEnv, call_shape, key

ROOT = Path(__file__).resolve().parents[1]


def test_the_key_comes_from_the_number_only_and_the_env_checks_it():
    keys = {key(n) for n in range(10, 100)}
    assert keys <= set(string.ascii_lowercase) and len(keys) > 15  # not guessable from a few letters
    env = VaultEnv()
    obs, _ = env.reset(seed=3)
    assert obs == f"{int(obs[:-1])}:" and VaultEnv().reset(seed=3)[0] == obs
    right = key(int(obs[:-1]))
    assert env.step(right + "xyz")[1:4] == (1.0, True, False)
    env.reset(seed=3)
    wrong = next(c for c in string.ascii_lowercase if c != right)
    _, reward, done, _, info = env.step(wrong)
    assert (reward, done, info["success"]) == (0.0, True, False)
    with pytest.raises(ValueError):
        key(7)


def test_call_shape_credits_the_right_calls_prefix():
    assert call_shape(["41:"], ["[key n=41]T:q\nA:q"]) == [1.0]
    assert call_shape(["41:"], ["[k========"]) == [0.2]
    assert call_shape(["41:"], ["x[key n=41]"]) == [0.0]
    assert call_shape(["41:", "41:"], ["", "[ke"]) == [0.0, 0.3]  # saying nothing earns nothing


@pytest.mark.slow
def test_agent_tools_example_learns_to_call_the_tool(tmp_path):
    """examples/agent-tools.yaml from the installed CLI in a user's folder: episodes call the tool and the
    call's form starts being learned. Only that: the run is fragile (seed 0 reached "[key" by step 300
    with several OpenMP threads, "[k" then a detour through guessing the commonest key with one), and
    the key itself is never reached in 300 steps (see the example's header) -- not the 0.8 the issue
    asks for."""
    import subprocess

    from helpers import console_script, process_env

    run = tmp_path / "run"
    p = subprocess.run(
        [
            console_script(),
            "train",
            str(ROOT / "examples" / "agent-tools.yaml"),
            "--set",
            f"output.dir={run}",
        ],
        capture_output=True,
        text=True,
        env=process_env(),
        cwd=tmp_path,
        timeout=3000,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [rows[i : i + 25] for i in range(0, len(rows), 25)]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    assert mean(windows[0], "rewards/call_shape/mean") < 0.05
    assert max(mean(w, "rewards/call_shape/mean") for w in windows) >= 0.1  # "[k" of "[key n=41]"
    assert max(mean(w, "tools/call_frequency") for w in windows) >= 0.5
