"""env/success_rate from an environment that says `success: True` on a hit and nothing otherwise (the
natural way to write one): the rate is the hits over all episodes, not over the episodes that said."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from helpers import run_user

COIN = textwrap.dedent(
    """\
    class Coin:
        def __init__(self, log, says=True):
            self.log, self.says = log, says

        def reset(self, *, seed):
            self.hit = seed % 3 == 0
            return "go:", {}

        def step(self, action):
            with open(self.log, "a") as f:
                f.write("1\\n" if self.hit else "0\\n")
            info = {"success": True} if self.hit and self.says else {}
            return "", float(self.hit), True, False, info
    """
)


def train(folder, says: bool) -> tuple[list[float], list[int]]:
    """Per step: the metric, and the env's own outcomes (one line per episode, in row order)."""
    (folder / "coin.py").write_text(COIN)
    log = folder / "outcomes.txt"
    kwargs = json.dumps({"log": str(log), "says": says})
    (folder / "job.yaml").write_text(
        f"env: {{name: 'coin.py:Coin', kwargs: {kwargs}, servers: 0, max_turns: 1, max_action_tokens: 2}}\n"
        "rollout: {max_prompt_length: 8}\n"
        "train: {per_device_batch: 32, max_steps: 4, log_every: 1}\noutput: {dir: out}\n"
    )
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=folder, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["env/success_rate"] for r in rows if "env/success_rate" in r]
    return rates, [int(x) for x in log.read_text().split()]


@pytest.mark.slow  # ~15-35 s: a real run through the installed CLI
def test_success_rate_counts_an_episode_that_says_nothing_as_no_success(tmp_path):
    rates, outcomes = train(tmp_path, says=True)
    truth = [sum(outcomes[k : k + 32]) / 32 for k in range(0, len(outcomes), 32)]
    assert len(rates) == len(truth) == 4, (rates, truth)
    assert any(0 < t < 1 for t in truth), truth  # batches with hits and misses: the case that misled
    assert all(math.isclose(r, t) for r, t in zip(rates, truth, strict=True)), (rates, truth)


def test_success_rate_is_unknown_until_the_env_has_said_success_then_counts_every_episode(tmp_path):
    """In process (play, episode_stats): NaN while no info of the run has had a `success` key (an env that
    never says has no success rate, not 0), then hits / all episodes, 0.0 included."""
    from gpufleet.config.schema import Job
    from gpufleet.env.source import factory
    from gpufleet.env.table import LocalPool
    from gpufleet.rl.episodes import episode_seed, episode_stats, play
    from gpufleet.rl.parts import build

    (tmp_path / "coin.py").write_text(COIN)
    hits = [pos for pos in range(40) if episode_seed(0, pos) % 3 == 0][:2]
    misses = [pos for pos in range(40) if episode_seed(0, pos) % 3][:6]

    def rate(p, positions: list[int], gen: int) -> float:
        rows = list(range(len(positions)))
        return episode_stats(p.rt, play(p, rows, positions, rows, gen_index=gen))["env/success_rate"]

    name = f"{tmp_path / 'coin.py'}:Coin"
    env = {"name": name, "servers": 0, "max_turns": 1, "max_action_tokens": 2, "kwargs": {"log": "x"}}
    p = build(
        Job.model_validate(
            {"env": env, "rollout": {"max_prompt_length": 8}, "output": {"dir": str(tmp_path)}}
        )
    )
    for says in (True, False):
        p.env = LocalPool(
            factory(name, {"log": str(tmp_path / "log.txt"), "says": says}), name
        )  # a fresh run's
        assert math.isnan(rate(p, misses, 0))  # nothing said yet: unknown, not 0
        got = [rate(p, hits + misses, 1), rate(p, misses, 2)]
        assert got == [0.25, 0.0] if says else all(math.isnan(x) for x in got), (says, got)
