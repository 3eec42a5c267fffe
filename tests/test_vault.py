"""`builtin:vault` (env/vault.py): the answer is the key only the tool knows; the shaping reward credits
the right call's prefix; examples/agent-tools.yaml runs from the installed CLI in a user's folder (fast)
and starts learning the call (slow). The whole learning curve (~0 -> >= 0.8, 3 seeds) takes longer than a
test may: it is measured in docs/agents-with-tools.md."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from gpufleet.env.vault import KEYS, SAID, SHOWN, VaultEnv, call_shape, k, reads_result, right_vault
from helpers import run_user, sets

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent-tools.yaml"


def test_the_key_comes_from_the_tool_only_and_the_env_checks_it():
    assert len(set(KEYS)) == 10 and set(KEYS) <= set(string.ascii_lowercase)  # one letter fits 1 vault in 10
    seen = {VaultEnv().reset(seed=s)[0] for s in range(200)}
    assert seen == {f"{n}" * SHOWN + ":" for n in range(10)} and SHOWN == 8
    env = VaultEnv()
    obs, _ = env.reset(seed=3)
    assert VaultEnv().reset(seed=3)[0] == obs
    said = k(int(obs[0]))
    right = said[0]
    assert said == right * SAID and SAID == 8  # the tool says the key 8 times
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
    assert call_shape(["7:"], ["[k n=3]"]) == [5.5 / 7]  # the wrong vault: a digit counts half, then stops
    assert call_shape(["7:"], ["[k n=n=]"]) == [5 / 7]  # no digit where it goes: the match stops
    assert call_shape(["7:"], ["x[k n=7]"]) == [0.0]
    assert call_shape(["7:", "7:"], ["", "[k"]) == [0.0, 2 / 7]  # saying nothing earns nothing
    assert call_shape(["77777777:"], ["[k n=7]"]) == [1.0]  # the number as the env shows it
    assert call_shape(["Open the vault.\n77777777:"], ["[k n=7]"]) == [1.0]  # after env.instructions


def test_right_vault_credits_the_call_naming_the_vault_shown():
    turns = ["[k n=7]T:q", "[k n=7x", "[k n=3]", "[k n=", "x[k n=7]", ""]
    assert right_vault(["77777777:"] * 6, turns) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


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
    assert call_shape(prompts, parsed) == [3 / 7, 2 / 7, 5.5 / 7]  # what the parse would credit
    tail = tok.encode("T:q\nA:q", add_special_tokens=False) + [EOS_TOKEN_ID]  # the rest of the episode
    assert call_shape(prompts, parsed, completion_ids=[x + tail for x in ids]) == [2 / 7, 4 / 7, 5.5 / 7]
    # the right call cut at its 7 tokens (no EOS): the tool's answer follows in the ids, the score holds
    cut = tok.encode("[k n=7]", add_special_tokens=False)
    assert call_shape(prompts[:1], parsed[:1], completion_ids=[cut + tail]) == [1.0]
    assert right_vault(prompts[:2], parsed[:2], completion_ids=[cut + tail, ids[1] + tail]) == [1.0, 0.0]
    # another tokenizer's ids (beyond the built-in vocabulary) fall back to the parsed transcript
    assert call_shape(prompts[:1], parsed[:1], completion_ids=[[151643] + tail]) == [3 / 7]


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
    """The example's first 200 steps: the call's form is found character by character (call_shape from
    ~0 to >= 0.6: `[k n=` and a digit; measured 0.71-0.78 at step 200, seeds 0-2, 1 and 2 threads) and
    the episodes call the tool. (Scored on the parsed call instead of the sampled text, 3 runs stayed at
    3/7 on `[k=`.) Not further: this tiny model's runs can fall back to the initial model for a few steps
    later on (docs/agents-with-tools.md), which is what the whole measured curve shows, not a test."""
    p = run_user(
        "train", str(EXAMPLE), *sets("output.dir=run", "train.max_steps=200"), cwd=tmp_path, timeout=1800
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _rows(tmp_path / "run")

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    assert mean(rows[:5], "rewards/call_shape/mean") < 0.05
    assert mean(rows[-3:], "rewards/call_shape/mean") >= 0.6
    assert mean(rows[-3:], "tools/call_frequency") >= 0.9
