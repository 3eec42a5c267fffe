"""`gpufleet check` makes the user's environment once and resets it (seed 0) in a child process under a
deadline (env/probe.py): what train would stop on 10-30 s in is said by check, and a constructor that
hangs cannot hang check. The installed CLI from the user's folder, with the user's env file."""

from __future__ import annotations

import textwrap
import time

import pytest

from helpers import run_user

ENVS = textwrap.dedent(
    """\
    import time


    class Boom:
        def __init__(self, level=3):
            raise ValueError(f"no such level: {level}")


    class OldGym:
        def reset(self, *, seed=None):
            return "go:"

        def step(self, action):
            return "go:", 0.0, False, False, {}


    class Hangs:
        def __init__(self):
            time.sleep(600)


    class Fine:
        def reset(self, *, seed):
            return "go:", {}

        def step(self, action):
            return "", 1.0, True, False, {"success": True}
    """
)
LINE = {
    name: ENVS.splitlines().index(text) + 1
    for name, text in [
        ("Boom", '        raise ValueError(f"no such level: {level}")'),
        ("Hangs", "        time.sleep(600)"),
    ]
}


def check(folder, name: str, *sets: str):
    (folder / "my_env.py").write_text(ENVS)
    (folder / "job.yaml").write_text(
        f"env: {{name: 'my_env.py:{name}', servers: 0, max_turns: 2, max_action_tokens: 2}}\n"
        "rollout: {max_prompt_length: 8}\n"
    )
    return run_user("check", "job.yaml", "--gpus", "cpu", *sets, cwd=folder, timeout=120)


def problems(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("error:", "warning:", "    why:"))]


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "Boom",
            f"making the environment raised ValueError: no such level: 3 at {{folder}}/my_env.py:{LINE['Boom']}",
        ),
        ("OldGym", "reset(seed=...) returned 'go:'; it must return (observation, info)"),
    ],
)
def test_check_says_what_train_would_stop_on(tmp_path, name, expected):
    p = check(tmp_path, name)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert expected.format(folder=tmp_path) in p.stdout, p.stdout
    assert "error: env.name" in p.stdout and "when check made one and reset it (seed 0)" in p.stdout, p.stdout


def test_check_passes_a_working_env(tmp_path):
    p = check(tmp_path, "Fine")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not problems(p.stdout), p.stdout


def test_a_hanging_constructor_cannot_hang_check(tmp_path):
    """Under env.reset_timeout train would stop on: an error naming where it is stuck; with the default
    limit (600 s): a warning after check's own 10 s (a simulator may boot slowly on purpose)."""
    start = time.monotonic()
    p = check(tmp_path, "Hangs", "--set", "env.reset_timeout=2")
    assert time.monotonic() - start < 15
    assert p.returncode == 2 and "error: env.reset_timeout" in p.stdout, p.stdout + p.stderr
    assert "Hangs.__init__ (episode check, seed 0) did not return within env.reset_timeout 2 s" in p.stdout
    assert f"stuck at {tmp_path}/my_env.py:{LINE['Hangs']}" in p.stdout, p.stdout


def test_the_env_servers_warning_gives_a_count_that_clears_it(tmp_path):
    """2 cores: with 3 trainer processes one server fits beside them (the fix, and with it no warning);
    with 4 none does: run the environments in the trainer processes. A GPU what-if (4x24GB) says nothing
    of this machine's cores: no warning."""
    import os
    import shutil
    from pathlib import Path

    if os.cpu_count() != 2:
        pytest.skip("the counts below are those of a 2-core machine")
    shutil.copy(Path(__file__).resolve().parents[1] / "examples" / "agent-keys.yaml", tmp_path / "job.yaml")

    def check(*sets: str) -> str:
        argv = ["check", "job.yaml", *[x for s in sets for x in ("--set", s)]]
        return run_user(*argv, cwd=tmp_path).stdout

    three = check("launch.nproc_per_node=3")
    assert "3 environment servers + 3 trainer processes on 2 CPU cores" in three, three
    assert "fix: --set env.servers=1\n" in three
    assert "wait on each other" not in check("launch.nproc_per_node=3", "env.servers=1")
    four = check("launch.nproc_per_node=4")
    assert "fix: --set env.servers=0 (the environments in the trainer processes)" in four, four
    p = run_user("check", "job.yaml", "--gpus", "4x24GB", "--set", "launch.nproc_per_node=4", cwd=tmp_path)
    assert "wait on each other" not in p.stdout, p.stdout


def test_a_steps_reward_is_a_number_not_text():
    """Gymnasium's reward is a number (SupportsFloat: what float() takes, numpy scalars, one-element arrays,
    Decimal); text such as "1.0" is refused like None or NaN, naming what step returned."""
    import numpy as np

    from gpufleet.env.base import EnvError, checked_step

    class Env:
        reward: object = 1.0

        def step(self, action):
            return "o", self.reward, True, False, {}

    env = Env()
    from decimal import Decimal

    for good, want in (
        (1, 1.0),
        (np.float32(0.25), 0.25),
        (np.array([0.5]), 0.5),
        (Decimal("0.5"), 0.5),
        (True, 1.0),
    ):
        env.reward = good
        assert checked_step(env, "a", "my.py:Env")[1] == want
    for bad in ("1.0", None, float("nan")):
        env.reward = bad
        with pytest.raises(EnvError, match="it must be a finite number"):
            checked_step(env, "a", "my.py:Env")
