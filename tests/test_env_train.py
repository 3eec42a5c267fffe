"""Multi-turn agent RL (the `env:` section) end to end: the loss mask, learning, rank invariance, exact
resume, no orphan servers, metrics and samples. Real env server processes, real torchrun, tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import kill9_after_steps, process_env

ROOT = Path(__file__).resolve().parents[1]
AGENT = str(ROOT / "examples" / "agent-keys.yaml")


def env(**extra) -> dict:
    return process_env(**extra)


def argv(run: Path, *sets: str) -> list[str]:
    out = [sys.executable, "-m", "gpufleet", "train", AGENT, "--gpus", "cpu", "--set", f"output.dir={run}"]
    for s in sets:
        out += ["--set", s]
    return out


def train(run: Path, *sets: str, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv(run, *sets), capture_output=True, text=True, env=env(), cwd=ROOT, timeout=timeout
    )


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


# ---------------------------------------------------------------------------------------- the loss mask


def test_observations_are_attended_but_never_trained(tmp_path):
    """play(): actions carry mask 1, observations mask 0 and attention 1; the trained tokens are the
    sampled tokens; the normaliser counts policy tokens only."""
    from gpufleet.config.schema import Job
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    job = Job.model_validate(
        {
            "env": {
                "name": "builtin:keys",
                "servers": 0,
                "kwargs": {"doors": 3, "length": 8, "letters": "a"},
                "max_turns": 3,
                "max_action_tokens": 8,
            },
            "rollout": {"max_prompt_length": 8},
            "output": {"dir": str(tmp_path)},
        }
    )
    p = build(job)  # random init: one letter, keys of 8: some episodes type an "a" and reach door 2
    e = play(p, list(range(64)), [j // 8 for j in range(64)], list(range(64)), gen_index=0)
    tok = p.tokenizer
    attn, loss = e.rollout.completion_mask, e.loss_mask
    assert ((loss == 1) <= (attn == 1)).all()  # trained tokens are attended tokens
    went_on = 0
    for i, segments in enumerate(e.segments):
        row = e.rollout.completion_ids[i][attn[i].bool()].tolist()
        mask = loss[i][attn[i].bool()].tolist()
        pos = 0
        for text, mine in segments:
            # Each piece occupies consecutive tokens with one mask value.
            n = len(tok.encode(text, add_special_tokens=False)) if not mine else None
            if not mine:
                assert mask[pos : pos + n] == [0.0] * n and tok.decode(row[pos : pos + n]) == text
                went_on += 1
                pos += n
            else:
                start = pos
                while pos < len(mask) and mask[pos] == 1.0:
                    pos += 1
                action = [t for t in row[start:pos] if t != tok.eos_token_id]
                assert tok.decode(action, skip_special_tokens=True) == text
        assert pos == len(mask)
        assert int(e.rollout.completion_lengths[i]) == int(loss[i].sum())
    assert went_on > 0  # some episodes had an observation after their first action
    # Episode reward = the env's rewards summed; doors of 8 letters pay 1/24 per right letter.
    assert all(abs(r * 24 - round(r * 24)) < 1e-5 for r in e.env_rewards.tolist())


# ------------------------------------------------------------------------------------- through the CLI


@pytest.mark.slow
def test_env_job_learns_with_servers_and_reports_metrics(tmp_path):
    """From the CLI with env servers (one per policy device): mean episode reward from <= 0.2 to >= 0.8;
    env metrics per step; samples show transcripts with the observations marked untrained."""
    run = tmp_path / "run"
    p = train(run, "train.max_steps=100")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "env: 1 server of builtin:keys on 127.0.0.1:" in p.stdout
    m = metrics(run)
    first = sum(x["reward"] for x in m[:5]) / 5
    last = sum(x["reward"] for x in m[-5:]) / 5
    assert first <= 0.2 and last >= 0.8, (first, last)
    for key in (
        "env/turns_mean",
        "env/success_rate",
        "env/invalid_action_rate",
        "timing/env",
        "rewards/env/mean",
    ):
        assert key in m[-1], key
    assert m[-1]["env/turns_mean"] > m[0]["env/turns_mean"]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    pieces = [t for s in samples for t in s["transcript"]]
    assert any(t["trained"] for t in pieces) and any(not t["trained"] for t in pieces)
    servers = json.loads((run / "env" / "servers.json").read_text())["servers"]
    assert all(not _alive(s["pid"]) for s in servers)  # stopped at the end


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_an_env_job(tmp_path):
    sets = ("train.max_steps=3", "train.learning_rate=1e-3", "output.save_every=0")
    one, two = tmp_path / "one", tmp_path / "two"
    p = train(one, "train.per_device_batch=32", *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    p = train(two, "train.per_device_batch=16", "launch.nproc_per_node=2", *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "env: 2 servers" in p.stdout
    a, b = weights(one), weights(two)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
    assert [x["reward"] for x in metrics(one)] == pytest.approx([x["reward"] for x in metrics(two)], abs=1e-6)


@pytest.mark.slow
def test_kill9_then_resume_is_bitwise_identical_on_an_env_job(tmp_path):
    sets = ("train.max_steps=8", "output.save_every=3", "train.per_device_batch=32", "train.log_every=1")
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *sets).returncode == 0
    kill9_after_steps(argv(run, *sets), run, 5, cwd=ROOT, log=tmp_path / "killed.log", env=env(), timeout=120)
    assert not (run / "final").exists()
    p = train(run, *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from" in p.stdout
    a, b = weights(ref), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [x["reward"] for x in metrics(ref)] == [x["reward"] for x in metrics(run)]


@pytest.mark.slow  # end to end (~10 s); make test-slow runs it
def test_sigkill_of_the_trainer_leaves_no_env_server(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        argv(run, "train.max_steps=2000", "launch.nproc_per_node=2", "train.per_device_batch=16"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env(),
        cwd=ROOT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    servers = json.loads((run / "env" / "servers.json").read_text())["servers"]
    assert len(servers) == 2 and all(_alive(s["pid"]) for s in servers)
    proc.kill()  # SIGKILL to the trainer (the launcher) alone: no handler of ours runs
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(_alive(s["pid"]) for s in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(s["pid"]) for s in servers)
    # the torchrun workers die too (they watch their parent): leave nothing behind for the next test
    os.killpg(proc.pid, signal.SIGKILL) if _group_alive(proc.pid) else None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.slow
def test_a_server_killed_mid_run_is_restarted_and_changes_nothing(tmp_path):
    """kill -9 an env server while the trainer uses it: the manager restarts it, the client replays the
    episodes it held from their seeds, and the run ends with exactly the weights of an undisturbed run."""
    sets = ("train.max_steps=12", "train.per_device_batch=32", "train.log_every=1", "output.save_every=0")
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *sets).returncode == 0
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen(argv(run, *sets), stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and len(metrics(run)) >= 3):
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "run.log").read_text()
        time.sleep(0.02)
    victim = json.loads((run / "env" / "servers.json").read_text())["servers"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, (tmp_path / "run.log").read_text()
    out = (tmp_path / "run.log").read_text()
    assert "env server 0 was killed by SIGKILL (signal 9)" in out and "restarted" in out, out
    a, b = weights(ref), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [x["reward"] for x in metrics(ref)] == [x["reward"] for x in metrics(run)]


@pytest.mark.slow
def test_frozenlake_runs_end_to_end_and_its_reward_rises(tmp_path):
    """Gymnasium's FrozenLake-v1 (4x4, not slippery) through the text adapter and a reward function on
    the transcript (examples/frozenlake_rewards.py, found next to the job file), servers and all."""
    run = tmp_path / "run"
    job = str(ROOT / "examples" / "agent-frozenlake.yaml")
    out = [sys.executable, "-m", "gpufleet", "train", job, "--gpus", "cpu", "--set", f"output.dir={run}"]
    p = subprocess.run(
        [
            *out,
            "--set",
            "train.max_steps=40",
            "--set",
            "train.log_every=10",
            "--set",
            "train.samples_every=20",
        ],
        capture_output=True,
        text=True,
        env=env(),
        cwd=tmp_path,  # the user's own folder: the reward file is found next to the job file
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    m = metrics(run)
    first = sum(x["reward"] for x in m[:10]) / 10
    last = sum(x["reward"] for x in m[-10:]) / 10
    assert last > first + 0.05, (first, last)
    assert m[-1]["env/turns_mean"] > 1 and "rewards/progress/mean" in m[-1]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert any("*" in t["text"] and not t["trained"] for s in samples for t in s["transcript"])


@pytest.mark.slow
def test_servers_someone_else_runs_give_the_same_run_and_a_wrong_token_is_one_line(tmp_path):
    """env.address + env.token_file: a server started by hand (python -m gpufleet.env.server) gives the
    same weights as environments inside the trainer (env.servers 0); a wrong token is one line, exit 2."""
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "wrong").write_text("guess\n")
    ready = tmp_path / "ready.json"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.env.server",
            "--env",
            "builtin:keys",
            "--kwargs",
            json.dumps({"doors": 3, "length": 4, "letters": "abcdef"}),
            "--token-file",
            str(tmp_path / "token"),
            "--ready-file",
            str(ready),
            "--port",
            "0",
        ],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        sets = ("train.max_steps=3", "train.per_device_batch=32", "train.learning_rate=1e-3")
        inside, remote = tmp_path / "inside", tmp_path / "remote"
        p = train(inside, *sets, "env.servers=0")
        assert p.returncode == 0, p.stdout + p.stderr
        p = train(remote, *sets, f"env.address={address}", f"env.token_file={tmp_path / 'token'}")
        assert p.returncode == 0, p.stdout + p.stderr
        assert "env:" not in p.stdout  # gpufleet started no server of its own
        a, b = weights(inside), weights(remote)
        assert all(torch.equal(a[k], b[k]) for k in a)
        p = train(tmp_path / "bad", *sets, f"env.address={address}", f"env.token_file={tmp_path / 'wrong'}")
        assert p.returncode == 2, p.stdout + p.stderr
        assert "Traceback" not in p.stderr and "env.address" in p.stderr and "token" in p.stderr, p.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_users_env_that_raises_is_one_line_with_its_file_and_line(tmp_path):
    """The installed command from the user's own folder, their env as file.py:Class next to the job."""
    from helpers import run_user

    (tmp_path / "my_env.py").write_text(
        "class Flaky:\n"
        "    def reset(self, *, seed):\n"
        "        self.t = 0\n"
        "        return 'go:', {}\n"
        "    def step(self, action):\n"
        "        self.t += 1\n"
        "        if self.t == 2:\n"
        "            raise KeyError('broken door')\n"
        "        return '\\ngo:', 0.5, False, False, {}\n"
    )
    (tmp_path / "job.yaml").write_text(
        "env: {name: 'my_env.py:Flaky', servers: 0, max_turns: 3, max_action_tokens: 2}\n"
        "rollout: {max_prompt_length: 8}\ntrain: {per_device_batch: 16, max_steps: 2}\n"
    )
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    assert "env.name" in p.stderr and "KeyError" in p.stderr and "my_env.py:8" in p.stderr, p.stderr


def test_plan_counts_the_episode_and_check_weighs_servers_against_cores(capsys):
    from helpers import run_cli

    code, out = run_cli(capsys, ["plan", AGENT, "--gpus", "4x24GB", "--format", "json"])
    plan = json.loads(out)["plan"]
    assert code == 0 and plan["completion_tokens"] == 3 * (4 + 4)  # max_turns x (action + observation)
    code, out = run_cli(
        capsys, ["plan", AGENT, "--gpus", "4x24GB", "--format", "json", "--set", "env.max_turns=6"]
    )
    assert json.loads(out)["plan"]["completion_tokens"] == 48
    code, out = run_cli(capsys, ["check", AGENT, "--gpus", "cpu", "--set", "env.servers=64"])
    assert code == 0 and "warning: env.servers" in out and "fix: --set env.servers=" in out, out
