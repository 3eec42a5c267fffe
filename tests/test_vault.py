"""`builtin:vault` (env/vault.py): the answer is the key only the tool knows; the shaping reward credits
the right call's prefix; examples/agent-tools.yaml runs from the installed CLI in a user's folder (fast)
and starts learning the call (slow). The whole learning curve (~0 -> >= 0.8, 3 seeds) takes longer than a
test may: it is measured in docs/agents-with-tools.md."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from gpufleet.env.vault import KEYS, VaultEnv, call_shape, k, reads_result
from helpers import run_user, sets

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent-tools.yaml"


def test_the_key_comes_from_the_tool_only_and_the_env_checks_it():
    assert len(set(KEYS)) == 10 and set(KEYS) <= set(string.ascii_lowercase)  # one letter fits 1 vault in 10
    seen = {VaultEnv().reset(seed=s)[0] for s in range(200)}
    assert seen == {f"{n}:" for n in range(10)}
    env = VaultEnv()
    obs, _ = env.reset(seed=3)
    assert VaultEnv().reset(seed=3)[0] == obs
    right = k(int(obs[:-1]))
    assert env.step(right + "xyz")[1:4] == (1.0, True, False)
    env.reset(seed=3)
    wrong = next(c for c in string.ascii_lowercase if c != right)
    _, reward, done, _, info = env.step(wrong)
    assert (reward, done, info["success"]) == (0.0, True, False)
    for bad in (10, -1):
        with pytest.raises(ValueError):
            k(bad)


def test_call_shape_credits_the_right_calls_prefix():
    assert call_shape(["7:"], ["[k n=7]T:q\nA:q"]) == [1.0]
    assert call_shape(["7:"], ["[k n=3]"]) == [6.5 / 7]  # the wrong vault: a digit counts half
    assert call_shape(["7:"], ["[k n=n=]"]) == [5 / 7]  # no digit where it goes: the match stops
    assert call_shape(["7:"], ["x[k n=7]"]) == [0.0]
    assert call_shape(["7:", "7:"], ["", "[k"]) == [0.0, 2 / 7]  # saying nothing earns nothing


def test_call_shape_scores_the_turn_as_sampled_not_as_parsed(tmp_path):
    """In chat episodes a reward function gets TRL's message lists, whose calls the response template
    parsed: `[k=x` is a call to `k` there, rendered `[k =x]`. call_shape reads the sampled turn from
    `completion_ids`, so `[k n` (4 characters of the call) scores above `[k=` (2), as the text does."""
    from transformers.utils import get_json_schema

    from gpufleet.models.builtin import EOS_TOKEN_ID, materialize
    from gpufleet.models.load import load_tokenizer
    from gpufleet.rl.chat import parse_response

    tok = load_tokenizer(str(materialize("tiny-qwen2", tmp_path)))
    turns = ["[k=xyz", "[k nq", "[k n=3]"]
    ids = [tok.encode(t, add_special_tokens=False) + [EOS_TOKEN_ID] for t in turns]
    parsed = [[parse_response(tok, x, [], [get_json_schema(k)])] for x in ids]
    prompts = [[{"role": "user", "content": "7:"}]] * 3
    assert call_shape(prompts, parsed) == [3 / 7, 2 / 7, 6.5 / 7]  # what the parse would credit
    tail = tok.encode("T:q\nA:q", add_special_tokens=False) + [EOS_TOKEN_ID]  # the rest of the episode
    assert call_shape(prompts, parsed, completion_ids=[x + tail for x in ids]) == [2 / 7, 4 / 7, 6.5 / 7]


def test_reads_result_credits_writing_what_the_tool_said():
    transcripts = ["[k n=6]T:p\nA:p", "[k n=6]T:p\nA:[k n=4]", "[k n=6]", "p", "[k n=6]T:p\nA:"]
    assert reads_result(["7:"] * 5, transcripts) == [1.0, 0.0, 0.0, 0.0, 0.0]


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_agent_tools_example_runs_from_the_cli(tmp_path):
    """examples/agent-tools.yaml, a few small steps, from the installed CLI in a user's folder."""
    p = run_user(
        "train",
        str(EXAMPLE),
        *sets("output.dir=run", "train.max_steps=2", "train.per_device_batch=16", "train.log_every=1"),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("rewards/call_shape/mean", "rewards/env/mean", "tools/call_frequency", "env/success_rate"):
        assert key in rows[-1], key
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_agent_tools_example_learns_the_call(tmp_path):
    """The example's first 250 steps: the call's form is found character by character (call_shape from
    ~0 to >= 0.7: `[k n=` and a digit; measured 0.93 at step 250) and the calls stop failing. (Scored on
    the parsed call instead of the sampled text, 3 runs stayed at 3/7 on `[k=`.)"""
    p = run_user(
        "train", str(EXAMPLE), *sets("output.dir=run", "train.max_steps=250"), cwd=tmp_path, timeout=1800
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _rows(tmp_path / "run")

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    assert mean(rows[:5], "rewards/call_shape/mean") < 0.05
    assert mean(rows[-3:], "rewards/call_shape/mean") >= 0.7
    assert mean(rows[-3:], "tools/call_frequency") >= 0.9
    assert mean(rows[-3:], "tools/failure_frequency") <= 0.3
