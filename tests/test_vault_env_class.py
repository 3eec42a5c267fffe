"""The vault as a TRL environment class (env/vault.py `Vault`): a no-argument tool that only the episode's
instance can answer, and the rewards that score it from TRL's message lists and `environments`."""

from __future__ import annotations

import random

import pytest

from gpufleet.env.trl import TrlEnv, tool_schemas
from gpufleet.env.vault import KEYS, SAID, Vault, answers_a_key, calls_k, key_found


def _call(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {}}}


def test_the_key_is_the_instances_and_only_its_tool_says_it():
    assert [s["function"]["name"] for s in tool_schemas(Vault)] == ["k"]
    keys = set()
    for seed in range(40):
        env = TrlEnv(Vault, {})
        obs, _ = env.reset(seed=seed)
        assert obs == "key:"  # the prompt says nothing about the key
        again = TrlEnv(Vault, {})
        again.reset(seed=seed)
        assert again.env.key == env.env.key  # a group's episodes share it; a replay finds it again
        keys.add(env.env.key)
        assert env.env.key in KEYS and env.env.k() == env.env.key * SAID  # said 8 times: T:qqqqqqqq
    assert len(keys) >= 8
    random.seed(0)


def test_rewards_read_trls_message_lists_and_the_instances():
    env = Vault()
    env.key = KEYS[3]
    call = {"role": "assistant", "content": "", "tool_calls": [_call("k")]}
    result = {"role": "tool", "name": "k", "content": env.key}
    right = [call, result, {"role": "assistant", "content": env.key + "xy"}]
    wrong = [call, result, {"role": "assistant", "content": KEYS[4]}]
    no_call = [{"role": "assistant", "content": env.key}]  # a lucky guess without the tool still counts
    prompts = [[{"role": "user", "content": "key:"}]] * 3
    assert key_found(prompts, [right, wrong, no_call], environments=[env] * 3) == [1.0, 0.0, 1.0]
    assert calls_k(prompts, [right, [{"role": "assistant", "content": "[kx"}], []]) == [1.0, 2 / 3, 0.0]
    assert answers_a_key(prompts, [right, wrong, no_call]) == [1.0, 1.0, 0.0]


def test_the_example_runs_from_the_installed_cli(tmp_path):
    import json
    from pathlib import Path

    from helpers import run_user, sets

    example = Path(__file__).resolve().parents[1] / "examples" / "agent-vault-trl.yaml"
    more = ("output.dir=run", "train.max_steps=2", "train.per_device_batch=32", "train.log_every=1")
    p = run_user("train", str(example), *sets(*more), cwd=tmp_path, env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("rewards/key_found/mean", "rewards/calls_k/mean", "tools/call_frequency"):
        assert key in rows[-1], key


@pytest.mark.slow
def test_the_example_learns_to_copy_the_tools_answer(tmp_path):
    """The example's first 300 steps (seed 0): the right key goes from ~0 to well above the 1 in 10 that
    one letter written every time earns -- only reading the tool's answer does that (the full curve to
    >= 0.8, 3 seeds, is measured in docs/agents-with-tools.md)."""
    import json
    from pathlib import Path

    from helpers import run_user, sets

    example = Path(__file__).resolve().parents[1] / "examples" / "agent-vault-trl.yaml"
    p = run_user(
        "train",
        str(example),
        *sets("output.dir=run", "train.max_steps=300"),
        cwd=tmp_path,
        env_extra={"OMP_NUM_THREADS": "1"},
        timeout=1800,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    found = [r["rewards/key_found/mean"] for r in rows]
    assert sum(found[:25]) / 25 < 0.05
    assert sum(found[-25:]) / 25 >= 0.2, found[-25:]


def test_a_tool_that_calls_sys_exit_is_a_failed_call_not_the_end_of_the_run():
    """sys.exit in a tool (a function tool, or a TRL environment's method) is that call's error result, as
    any exception is; the run goes on and the failure is counted."""
    import sys

    from gpufleet.rl.tools import Tool, run_call

    def quit(x: int) -> str:
        sys.exit(3)

    result = run_call(
        {"quit": Tool("quit", quit, {})}, {"function": {"name": "quit", "arguments": {"x": 1}}}, 5
    )
    assert result.failed and result.message["content"] == "{'error': 'tool quit called sys.exit(3)'}"

    class Quits:
        def reset(self, **kwargs):
            return None

        def quit(self) -> str:
            """Quit."""
            sys.exit(3)

    env = TrlEnv(Quits, {})
    env.reset(seed=0)
    assert env._call(_call("quit")) == ("quit", "{'error': 'tool quit called sys.exit(3)'}", True)


def test_a_get_reward_that_is_no_number_is_said_with_trls_contract():
    """get_reward() returning text or None: the class and what it returned, and the fix is TRL's contract
    (not the Gymnasium step tuple, which a class without step() never had)."""
    from gpufleet.env.base import EnvError, checked_step
    from gpufleet.env.connect import env_failed

    class Calc:
        def reset(self, **kwargs):
            return "7:"

        def add(self, a: int) -> str:
            """Add.

            Args:
                a: The number.
            """
            return str(a)

        def get_reward(self):
            return "high"

    env = TrlEnv(Calc, {})
    env.reset(seed=0)
    with pytest.raises(EnvError) as raised:
        checked_step(env, "7", "my.py:Calc")
    assert "Calc.get_reward() returned 'high'; TRL's contract: a finite number" in str(raised.value)
    fix = env_failed(str(raised.value)).fix
    assert "TRL's environment_factory contract" in fix and "get_reward() a number" in fix
    assert "terminated" in env_failed("my.py:Echo: step returned 3").fix  # a Gymnasium-style env's

    def boom(self):
        raise ZeroDivisionError("no score yet")

    Calc.get_reward = boom  # an exception in a TRL class: its fix is TRL's contract too
    with pytest.raises(EnvError) as raised:
        checked_step(env, "7", "my.py:Calc")
    assert "my.py:Calc (a TRL environment class): step raised ZeroDivisionError" in str(raised.value)
    assert "TRL's environment_factory contract" in env_failed(str(raised.value)).fix
