"""Env jobs on a dedicated rollout rank (`placement.rollout` with `env:`, rl/rolloutplay.py): the rollout
rank plays whole episodes against the env servers (or in-process envs) with the per-episode seeds and
sends the finished episodes back, so lock-step training equals the colocated run; `rollout.async_steps: 1`
plays the next batch while this one trains (one step stale, the sampling log-probs of every policy token
in TRL's importance-sampling correction), deterministic and resumed exactly after kill -9; a killed env
server is replayed and a stuck env stops the run with one line, on the rollout rank too. Real torchrun
processes (gloo), real env server processes on 127.0.0.1, the installed command from a user's folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpufleet.engine.rollout import Rollout, Sampling, left_pad
from gpufleet.launch.torchrun import free_port
from gpufleet.rl.rolloutwire import Answer, PolicyEnd, pack_answer, recv_request, send_answer
from helpers import console_script, gloo_done, gloo_rank, process_env, run_user, sets
from test_rollout_ranks import _metrics, _weights, assert_same_run

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("train.per_device_batch=16", "train.log_every=1", "output.save_every=0")
ASYNC = ("placement.rollout=1", "rollout.async_steps=1", "output.save_every=3")


def _user(tmp_path: Path, *examples: str) -> Path:
    for name in examples:
        (tmp_path / name).write_text((ROOT / "examples" / name).read_text())
    return tmp_path


def _train(cwd: Path, job: str, run: Path, *values: str, env_extra=None):
    p = run_user("train", job, *sets(f"output.dir={run}", *values), cwd=cwd, timeout=400, env_extra=env_extra)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def _samples(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]


def _played(logprobs: bool) -> Answer:
    """Two finished episodes as a rollout rank sends them (rl/rolloutplay.py `_rows`)."""
    prompt, prompt_mask = left_pad([[5, 6, 7], [8]], 0)
    ids = torch.tensor([[3, 4, 9, 9, 2], [3, 2, 0, 0, 0]])
    attention = (ids != 0).long()
    loss = torch.tensor([[1.0, 1, 0, 0, 1], [1, 1, 0, 0, 0]])
    rollout = Rollout(prompt, prompt_mask, ids, attention, loss.sum(1).long(), torch.tensor([False, True]))
    played = {
        "seconds": 1.5,
        "loss_mask": loss,
        "env_rewards": torch.tensor([0.5, -1.25]),
        "counts": {"turns": torch.tensor([2.0, 1.0]), "success": torch.tensor([1.0, 0.0])},
        "rest": {
            "prompts": ["go:", "stop:"],
            "transcripts": ["ab\ncd", "a"],
            "segments": [[("ab", True), ("\n", False), ("cd", True)], [("a", True)]],
            "conversation": (
                [[{"role": "user", "content": "go:"}]] * 2,
                [[], [{"role": "tool", "content": "7"}]],
            ),
        },
    }
    lp = -torch.rand(2, 5, generator=torch.Generator().manual_seed(0)) * loss if logprobs else None
    return Answer(rollout, lp, 3, played)


PLAYS = [True, False]


def _wire_worker(rank: int, port: int, out: str) -> None:
    gloo_rank(rank, port)
    group = dist.new_group([0, 1])
    ask = {"play": True, "prompt_ids": [[0, 4, 2], [1, 4, 2]], "seeds": [11, 12], "max_new_tokens": 4}
    ask |= {"sampling": Sampling(2, 0)}
    if rank == 0:  # the policy rank
        end = PolicyEnd(1, group)
        for lp in PLAYS:
            end.request({"ask": ask | {"logprobs": lp}, "version": 3, "push": None})
        end.request({"ask": None, "version": 4, "push": None})
        torch.save([end.answer() for _ in range(len(PLAYS) + 1)], out)
    else:  # the rollout rank
        said: dict = {}
        got = [recv_request(0, group, said) for _ in range(len(PLAYS) + 1)]
        for lp in PLAYS:
            send_answer(0, group, pack_answer(_played(lp)))
        send_answer(0, group, pack_answer(None))
        torch.save(got, out + ".requests")
    gloo_done()


def test_played_episodes_arrive_as_sent(tmp_path):
    """An env job's request (rows, group positions, batch) and its answer (tokens, masks, env rewards,
    counts, sampling log-probs or none, the texts and message lists) over a real 2-process gloo group."""
    out = str(tmp_path / "got.pt")
    mp.spawn(_wire_worker, args=(free_port(), out), nprocs=2)
    requests = torch.load(out + ".requests", weights_only=False)
    assert requests[0]["ask"]["play"] and requests[0]["ask"]["prompt_ids"] == [[0, 4, 2], [1, 4, 2]]
    assert requests[0]["ask"]["seeds"] == [11, 12] and requests[1]["ask"]["logprobs"] is False
    *answers, last = torch.load(out, weights_only=False)
    assert last is None
    for got, lp in zip(answers, PLAYS, strict=True):
        sent = _played(lp)
        assert got.version == 3
        for name in sent.rollout.__dataclass_fields__:
            a, b = getattr(got.rollout, name), getattr(sent.rollout, name)
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
        assert (got.logprobs is None) == (not lp)
        assert not lp or torch.equal(got.logprobs, sent.logprobs)
        assert got.played["rest"] == sent.played["rest"] and got.played["seconds"] == 1.5
        for key in ("loss_mask", "env_rewards"):
            assert got.played[key].dtype == torch.float32 and torch.equal(got.played[key], sent.played[key])
        assert got.played["counts"].keys() == sent.played["counts"].keys()
        assert all(torch.equal(got.played["counts"][k], v) for k, v in sent.played["counts"].items())


@pytest.mark.slow
def test_episodes_played_on_the_rollout_rank_train_to_the_colocated_weights(tmp_path):
    """agent-keys on env servers, 10 steps: the rollout rank plays every episode (the policy rank opens no
    episode) and the run equals the colocated one: weights within 1e-5, rewards, env metrics, transcripts."""
    user = _user(tmp_path, "agent-keys.yaml")
    colocated, remote = user / "runs" / "colocated", user / "runs" / "remote"
    values = (*KEYS, "train.max_steps=10", "train.samples_every=5")
    _train(user, "agent-keys.yaml", colocated, *values)
    p = _train(user, "agent-keys.yaml", remote, *values, "placement.rollout=1")
    assert "rollout on cpu process 1" in p.stdout
    assert "serving 1 policy rank(s), 0 batch(es) ahead" in (remote / "logs" / "rank1.log").read_text()
    assert_same_run(colocated, remote)
    a, b = _metrics(colocated), _metrics(remote)
    for key in ("env/turns_mean", "env/invalid_action_rate", "completions/mean_length"):
        assert [m[key] for m in a] == pytest.approx([m[key] for m in b], abs=1e-9), key
    assert all(m["timing/env"] == 0 and m["timing/weight_sync"] > 0 for m in b)  # the envs are not here
    assert all(0 < m["timing/rollout_env"] < m["step_time"] for m in b)  # they are on the rollout rank
    assert "timing/rollout_env" not in a[0]
    assert _samples(colocated) == _samples(remote)  # the same transcripts, trained marks, rewards


@pytest.mark.slow
def test_async_env_job_is_one_step_stale_corrected_and_resumes_exactly_after_kill_9(tmp_path):
    """async_steps 1 on an env job: batch g is played while g - 1 trains (staleness 1 from the second step),
    its policy tokens' sampling log-probs meet the trainer's in the IS ratio (observations left out); the
    policy rank killed by SIGKILL after the step-3 checkpoint resumes (the episodes in flight saved with it)
    to the weights and rewards of an undisturbed run, bit for bit."""
    user = _user(tmp_path, "agent-keys.yaml")
    one, two = user / "runs" / "one", user / "runs" / "two"
    values = (*KEYS, "train.max_steps=8", *ASYNC)
    _train(user, "agent-keys.yaml", one, *values)
    rows = _metrics(one)
    assert [m["rollout/staleness"] for m in rows] == [0.0] + [1.0] * 7
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-5  # the same weights: ratio 1
    assert all(m["sampling/sampling_logp_difference/mean"] > 0 for m in rows[1:])
    assert all(0 < m["sampling/importance_sampling_ratio/max"] <= 3.0 for m in rows)
    kill = {"GPUFLEET_TEST_CRASH": "0:5", "GPUFLEET_TEST_KILL": "1"}
    p = run_user(
        "train", "agent-keys.yaml", *sets(f"output.dir={two}", *values), cwd=user, env_extra=kill, timeout=400
    )
    assert p.returncode != 0
    saved = torch.load(two / "checkpoints" / "step-3" / "batch-rank0.pt", weights_only=True)
    (flight,) = saved["in_flight"].values()
    assert flight["played"]["rest"]["transcripts"] and flight["logprobs"] is not None
    p = _train(user, "agent-keys.yaml", two, *values)
    assert "resuming from" in p.stdout
    wa, wb = _weights(one), _weights(two)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["reward"] for m in _metrics(one)] == [m["reward"] for m in _metrics(two)]
    keys = [k for k in rows[0] if k.startswith(("sampling/", "rollout/", "env/"))]
    assert [[m[k] for k in keys] for m in _metrics(two)] == [[m[k] for k in keys] for m in rows]


@pytest.mark.slow
def test_async_env_job_does_not_depend_on_the_policy_rank_count(tmp_path):
    """One step ahead, 2 policy ranks whose episodes one rollout rank plays train as 1 policy rank with the
    same global batch: weights within 1e-5, rewards, env metrics and TRL's sampling metrics."""
    user = _user(tmp_path, "agent-keys.yaml")
    one, two = user / "runs" / "one", user / "runs" / "two"
    values = ("train.max_steps=6", "train.log_every=1", "train.learning_rate=1e-3", *ASYNC)
    _train(user, "agent-keys.yaml", one, *values, "train.per_device_batch=32")
    two_ranks = ("placement.policy=0,1", "placement.rollout=2", "train.per_device_batch=16")
    _train(user, "agent-keys.yaml", two, *values, *two_ranks)
    assert_same_run(one, two)
    keys = [k for k in _metrics(one)[0] if k.startswith(("sampling/", "rollout/staleness", "env/"))]
    assert len([k for k in keys if k.startswith("sampling/")]) == 5
    for a, b in zip(_metrics(one), _metrics(two), strict=True):
        assert [b[k] for k in keys] == pytest.approx([a[k] for k in keys], rel=1e-4, abs=1e-6, nan_ok=True)


@pytest.mark.slow
def test_a_killed_env_server_is_replayed_for_the_rollout_rank(tmp_path):
    """kill -9 the env server the rollout rank plays on, mid-run: it is restarted, the rollout rank's pool
    replays the episodes it held from their seeds, and the run ends as an undisturbed one, bit for bit."""
    user = _user(tmp_path, "agent-keys.yaml")
    ref, run = user / "runs" / "ref", user / "runs" / "run"
    values = ("train.per_device_batch=32", "train.max_steps=10", "train.log_every=1", "output.save_every=0")
    values += ("placement.rollout=1",)
    _train(user, "agent-keys.yaml", ref, *values)
    argv = [console_script(), "train", "agent-keys.yaml", *sets(f"output.dir={run}", *values)]
    with (user / "run.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=process_env(), cwd=user)
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and len(_metrics(run)) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None, (user / "run.log").read_text()
            time.sleep(0.02)
        victim = json.loads((run / "env" / "servers.json").read_text())["servers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, (user / "run.log").read_text()
    out = (user / "run.log").read_text()
    assert "env server 0 was killed by SIGKILL (signal 9)" in out and "restarted" in out, out
    wa, wb = _weights(ref), _weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["reward"] for m in _metrics(ref)] == [m["reward"] for m in _metrics(run)]


STUCK = """\
import time


class Stuck:
    def reset(self, *, seed):
        return "go:", {}

    def step(self, action):
        time.sleep(600)
"""


@pytest.mark.slow
def test_a_stuck_env_on_the_rollout_rank_stops_the_run_with_one_line(tmp_path):
    """An env that hangs in step, in the rollout rank's process (env.servers 0): env.step_timeout stops it
    and the run ends with one line naming the setting and the fix, exit 2, no traceback."""
    (tmp_path / "my_env.py").write_text(STUCK)
    env = {"name": "my_env.py:Stuck", "servers": 0, "max_turns": 2, "max_action_tokens": 2, "step_timeout": 2}
    (tmp_path / "job.yaml").write_text(
        f"env: {json.dumps(env)}\nrollout: {{max_prompt_length: 8}}\n"
        "train: {per_device_batch: 16, max_steps: 2}\noutput: {dir: out}\nplacement: {rollout: [1]}\n"
    )
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    error = [line for line in (p.stdout + p.stderr).splitlines() if "error:" in line]
    assert len(error) == 1, p.stdout + p.stderr
    assert "env.step_timeout" in error[0] and "Stuck.step (episode g0r" in error[0], error[0]
    assert "--set env.step_timeout=8" in error[0], error[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "example, files, values",
    [
        pytest.param("agent-tools.yaml", (), ("train.per_device_batch=32",), id="chat-with-a-tool"),
        pytest.param(
            "agent-trl-env.yaml",
            ("trl_env.py",),
            ("train.per_device_batch=16", "env.servers=auto"),
            id="trl-env",
        ),
    ],
)
def test_chat_env_jobs_on_the_rollout_rank_equal_colocated(tmp_path, example, files, values):
    """Chat episodes share the episode code: a tool called in the rollout rank's process (agent-tools) and a
    TRL environment class on env servers (agent-trl-env) train as colocated, tool metrics included."""
    user = _user(tmp_path, example, *files)
    colocated, remote = user / "runs" / "colocated", user / "runs" / "remote"
    values = (*values, "train.max_steps=4", "train.log_every=1", "output.save_every=0")
    _train(user, example, colocated, *values)
    _train(user, example, remote, *values, "placement.rollout=1")
    assert_same_run(colocated, remote)
    a, b = _metrics(colocated), _metrics(remote)
    assert [m["tools/call_frequency"] for m in a] == pytest.approx([m["tools/call_frequency"] for m in b])


def test_check_refuses_a_reward_that_takes_the_environments_played_elsewhere(tmp_path):
    """A TRL environment class in process with rollout ranks: its instances live on the rollout rank, so a
    reward function that takes TRL's `environments` is refused (one error, the fix); without one, ok."""
    user = _user(tmp_path, "agent-trl-env.yaml", "trl_env.py")
    (user / "my_rewards.py").write_text(
        "def by_state(prompts, completions, environments, **kwargs):\n    return [0.0 for _ in environments]\n"
    )
    layout = ("placement.policy=0", "placement.rollout=1")
    p = run_user("check", "agent-trl-env.yaml", "--gpus", "2x24GB", *sets(*layout), cwd=user)
    assert p.returncode == 0 and "environments" not in p.stdout, p.stdout
    reward = ("reward.functions=my_rewards.py:by_state", "reward.weights=1.0")
    p = run_user("check", "agent-trl-env.yaml", "--gpus", "2x24GB", *sets(*layout, *reward), cwd=user)
    assert p.returncode == 2, p.stdout
    assert "reward function my_rewards.py:by_state takes TRL's `environments`" in p.stdout, p.stdout
    assert "--set placement.rollout=colocate" in p.stdout
    p = run_user("check", "agent-trl-env.yaml", "--gpus", "2x24GB", *sets(*reward), cwd=user)
    assert "takes TRL's `environments`" not in p.stdout, p.stdout  # colocated: they are here
