"""A TRL environment class (TRL 1.16's `environment_factory` contract) run unchanged: its methods are the
tools, reset() gives the prompt, get_reward() scores the episode; in process and on env servers (killed
and replayed, a hung tool bounded by env.step_timeout); check refuses what train would stop on."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from helpers import kill9_after_steps, run_user, sets

ROOT = Path(__file__).resolve().parents[1]
ENV = (ROOT / "examples" / "trl_env.py").read_text()
EXTRA = '''

class Hangs(Vault):
    def unlock(self, n: int) -> str:
        """Never returns.

        Args:
            n: The vault number.
        """
        import time

        time.sleep(60)
        return "late"


class NoDoc(Vault):
    def peek(self, n):
        return n


class NoReward:
    def reset(self, **kwargs):
        return "hi"

    def wave(self) -> str:
        """Wave."""
        return "bye"
'''


def _job(tmp_path, **env):
    from gpufleet.config.schema import Job

    (tmp_path / "trl_env.py").write_text(ENV + EXTRA)
    return Job.model_validate(
        {
            "env": {
                "name": f"{tmp_path}/trl_env.py:Vault",
                "format": "chat",
                "servers": 0,
                "max_turns": 4,
                "max_action_tokens": 16,
                "max_episode_tokens": 200,
                **env,
            },
            "rollout": {"max_prompt_length": 32, "max_tool_calling_iterations": 2},
            "output": {"dir": str(tmp_path / "run")},
        }
    )


def _scripted(monkeypatch, script):
    """The policy's turns, fixed: `script(turn, prompt text)` -> text (ending in <eos> or not)."""
    from gpufleet.rl import episodes

    def act(p, live, turn, budget):
        tok, out = p.tokenizer, []
        for e in live:
            text = script(turn, tok.decode(e.prompt))
            ids = tok.encode(text.removesuffix("<eos>"), add_special_tokens=False)
            out.append(
                (ids + ([tok.eos_token_id] if text.endswith("<eos>") else []), text.removesuffix("<eos>"))
            )
        return out

    monkeypatch.setattr(episodes, "_act", act)


def _number(prompt: str) -> int:
    return int(re.search(r"U:(\d+):", prompt).group(1))


def _calls(turn, prompt):
    n = _number(prompt)
    return [f"[unlock n={n + 1}][nope]<eos>", f"[unlock n={n}]<eos>", "[unlock n=1]<eos>", "x<eos>"][turn]


def test_trl_env_class_runs_unchanged_in_process(tmp_path, monkeypatch):
    """Its method is offered as a tool, each turn's calls run on the episode's own instance and come back
    as tool messages spliced by the template (mask 0); the turn past max_tool_calling_iterations ends the
    episode; the env reward is get_reward() at the end; a group shares reset's random state."""
    from gpufleet.rl.episodes import episode_stats, play
    from gpufleet.rl.parts import build

    _scripted(monkeypatch, _calls)
    p = build(_job(tmp_path))
    e = play(p, [0, 1, 2], [0, 0, 1], [0, 1, 2], gen_index=0)
    tok, fmt = p.tokenizer, p.chat.fmt
    prompts = [
        tok.decode(e.rollout.prompt_ids[i][e.rollout.prompt_mask[i].bool()].tolist()) for i in range(3)
    ]
    assert prompts[0].startswith("tools: unlock(n)\nU:") and prompts[0] == prompts[1] != prompts[2]
    n = _number(prompts[0])

    def tool(content, name="unlock"):
        return {"role": "tool", "name": name, "content": content}

    want = (
        tok.encode(f"[unlock n={n + 1}][nope]")
        + [tok.eos_token_id]
        + fmt.bridge([tool("locked"), tool("{'error': 'Tool nope not found.'}", "nope")])
        + tok.encode(f"[unlock n={n}]")
        + [tok.eos_token_id]
        + fmt.bridge([tool("open")])
        + tok.encode("[unlock n=1]")  # past max_tool_calling_iterations 2: its calls are not run, it ends
        + [tok.eos_token_id]
    )
    attn = e.rollout.completion_mask[0].bool()
    assert e.rollout.completion_ids[0][attn].tolist() == want
    mask = e.loss_mask[0][attn].tolist()
    assert sum(mask) == len(tok.encode(f"[unlock n={n + 1}][nope][unlock n={n}][unlock n=1]")) + 3
    assert e.env_rewards.tolist() == [1.0, 1.0, 1.0] and not e.rollout.is_truncated.any()

    class Rt:
        distributed = False

    stats = episode_stats(Rt(), e)
    assert stats["tools/call_frequency"] == 3.0 and stats["tools/failure_frequency"] == pytest.approx(1 / 3)


def test_get_reward_counts_when_gpufleet_truncates_the_episode(tmp_path, monkeypatch):
    """env.max_turns cuts the episode after its opening call: get_reward() at that point is its reward."""
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    _scripted(monkeypatch, lambda turn, prompt: f"[unlock n={_number(prompt)}]<eos>")
    p = build(_job(tmp_path, max_turns=1))
    e = play(p, [0, 1], [0, 1], [0, 1], gen_index=0)
    assert e.env_rewards.tolist() == [1.0, 1.0] and e.rollout.is_truncated.all()


def _pool_episodes(pool, seeds):
    """Reset, one tool turn (right number), a second tool turn, then the answer: every result."""
    from gpufleet.env.trl import message

    ids = [f"e{i}" for i in range(len(seeds))]
    got = [pool.reset(list(zip(ids, seeds, strict=True)))]
    numbers = [int(obs.rstrip(":")) for obs, _ in got[0]]

    def call(n):
        return [{"type": "function", "function": {"name": "unlock", "arguments": {"n": n}}}]

    for turn in (0, 1):
        got.append(pool.step([(i, message("", call(n + turn))) for i, n in zip(ids, numbers, strict=True)]))
        yield got[-1]
    got.append(pool.step([(i, message("done", [])) for i in ids]))
    yield got[-1]


def test_trl_env_on_servers_is_replayed_after_a_kill_and_equals_in_process(tmp_path):
    from gpufleet.env.client import EnvPool, LocalPool
    from gpufleet.env.servers import EnvServers
    from gpufleet.env.source import factory

    (tmp_path / "trl_env.py").write_text(ENV)
    name, seeds = f"{tmp_path}/trl_env.py:Vault", [3, 3, 11, 12]
    local = list(_pool_episodes(LocalPool(factory(name, {}), name), seeds))
    assert [r[1] for r in local[0]] == [1.0, 1.0, 1.0, 1.0] and all(r[2] for r in local[2])
    with EnvServers(name, {}, [str(tmp_path)], 2, tmp_path / "run") as servers:
        servers.start()
        pool = EnvPool.from_file(servers.servers_json, retry_for=60.0)
        steps = _pool_episodes(pool, seeds)
        got = [next(steps)]
        os.kill(servers.pids()[0], signal.SIGKILL)  # mid-episode: its instances are lost
        got += list(steps)
        assert got == local
        assert servers.restarts == 1 and pool.stats["replays"] >= 1
        assert pool.stats["lost"] == pool.stats["duplicated"] == 0


def test_a_hung_tool_is_stopped_by_env_step_timeout_naming_the_call(tmp_path):
    from gpufleet.env.client import LocalPool
    from gpufleet.env.runner import EnvTimeout
    from gpufleet.env.source import factory
    from gpufleet.env.trl import message

    (tmp_path / "trl_env.py").write_text(ENV + EXTRA)
    name = f"{tmp_path}/trl_env.py:Hangs"
    pool = LocalPool(factory(name, {}), name, step_timeout=1.0, say=lambda _: None)
    pool.reset([("a", 1)])
    call = [{"type": "function", "function": {"name": "unlock", "arguments": {"n": 5}}}]
    with pytest.raises(EnvTimeout) as e:
        pool.step([("a", message("", call))])
    assert "Hangs.step (episode a, tool calls unlock(n=5)) did not return within env.step_timeout 1 s" in str(
        e.value
    )
    assert "trl_env.py:" in str(e.value)


JOB = """
model: {path: builtin:tiny-qwen2}
env: {name: trl_env.py:Vault, format: chat, servers: 0, max_turns: 2, max_action_tokens: 12,
      max_episode_tokens: 40}
rollout: {max_prompt_length: 32, max_tool_calling_iterations: 1}
"""


@pytest.mark.parametrize(
    ("sets_", "line"),
    [
        (("env.format=text",), "trl_env.py:Vault is a TRL environment class (a reset method, no step"),
        (("env.name=trl_env.py:NoDoc",), "transformers cannot describe its tool NoDoc.peek"),
        (("env.name=trl_env.py:NoReward",), "NoReward has no get_reward() and reward.functions is empty"),
        (("rollout.tools=[trl_env.py:Vault]",), "rollout.tools with a TRL environment class"),
        (("env.name=trl_env.py:Gone",), "Gone"),
    ],
)
def test_check_refuses_what_a_trl_env_job_would_stop_on(tmp_path, sets_, line):
    (tmp_path / "trl_env.py").write_text(ENV + EXTRA)
    (tmp_path / "job.yaml").write_text(JOB)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(*sets_), cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and line in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.slow
def test_example_runs_from_the_installed_cli_on_env_servers(tmp_path):
    """examples/agent-trl-env.yaml and its class, copied to a user's folder: check, then train on env
    servers; the environment's reward is above 0 on some episodes."""
    for f in ("agent-trl-env.yaml", "trl_env.py"):
        (tmp_path / f).write_text((ROOT / "examples" / f).read_text())
    p = run_user("check", "agent-trl-env.yaml", "--gpus", "cpu", cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    args = sets("train.max_steps=4", "train.log_every=1", "env.servers=1", "output.dir=run")
    p = run_user("train", "agent-trl-env.yaml", *args, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["tools/call_frequency"] >= 0 for r in rows)
    assert any(r["reward"] > 0 for r in rows), [r["reward"] for r in rows]


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_a_trl_env_job_on_env_servers(tmp_path):
    """The example on env servers (one per rank): 2 ranks (gloo) train the same weights as 1."""
    from safetensors.torch import load_file

    for f in ("agent-trl-env.yaml", "trl_env.py"):
        (tmp_path / f).write_text((ROOT / "examples" / f).read_text())
    common = ("train.max_steps=3", "train.log_every=1", "env.servers=auto", "train.learning_rate=1e-3")
    runs = {
        "one": ("train.per_device_batch=32",),
        "two": ("train.per_device_batch=16", "launch.nproc_per_node=2"),
    }
    for run, own in runs.items():
        args = sets(*common, *own, f"output.dir={run}", "output.save_every=0")
        p = run_user("train", "agent-trl-env.yaml", *args, cwd=tmp_path, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
    a, b = (load_file(tmp_path / r / "final" / "model.safetensors") for r in runs)
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-5
    rows = {
        r: [json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in runs
    }
    for key in ("reward", "tools/call_frequency"):
        assert [x[key] for x in rows["one"]] == pytest.approx([x[key] for x in rows["two"]], abs=1e-6)


# ---- TRL's dict form: a data column picks each episode's environment

MULTI = '''

class Counter:
    def reset(self, target: int = 0, **kwargs) -> None:
        self.counter, self.target = 0, target

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)


ENVIRONMENTS = {"vault": Vault, "counter": Counter}
'''
ROWS = [
    {"prompt": "open", "environment": "vault"},
    {"prompt": [{"role": "user", "content": "count to 3"}], "environment": "counter", "target": 3},
]


def _multi_job(tmp_path, rows=ROWS):
    from gpufleet.config.schema import Job

    (tmp_path / "envs.py").write_text(ENV + MULTI)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Job.model_validate(
        {
            "env": {
                "name": f"{tmp_path}/envs.py:ENVIRONMENTS",
                "format": "chat",
                "servers": 0,
                "max_turns": 3,
            },
            "data": {"path": str(tmp_path / "data.jsonl")},
            "rollout": {"max_prompt_length": 48},
            "output": {"dir": str(tmp_path / "run")},
        }
    )


def test_dict_form_a_data_column_picks_the_environment_and_its_tools(tmp_path, monkeypatch):
    """Each episode gets its row's environment, only that environment's tools, the row's prompt with
    reset()'s text appended, and the row's other columns as reset(**row) (the counter's target)."""
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    def script(turn, prompt):
        if "count to 3" in prompt:
            return ["[increment step=1]<eos>", "[increment step=2]<eos>", "done<eos>"][turn]
        return [f"[unlock n={_number(prompt.replace('open', 'U:'))}]<eos>", "done<eos>", "x"][turn]

    _scripted(monkeypatch, script)
    p = build(_multi_job(tmp_path))
    e = play(p, [0, 1, 2, 3], [0, 0, 1, 1], [0, 1, 2, 3], gen_index=0)
    tok = p.tokenizer
    prompts = [
        tok.decode(e.rollout.prompt_ids[i][e.rollout.prompt_mask[i].bool()].tolist()) for i in range(4)
    ]
    assert sorted({x.split("\n")[0] for x in prompts}) == ["tools: increment(step)", "tools: unlock(n)"]
    for i, text in enumerate(prompts):
        if "increment" in text:
            assert text == "tools: increment(step)\nU:count to 3\nA:"  # reset returned None
            assert e.segments[i][1][0] == "T:1\nA:" and e.segments[i][3][0] == "T:3\nA:"
        else:
            assert re.fullmatch(r"tools: unlock\(n\)\nU:open\d\d:\nA:", text)
    assert e.env_rewards.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_dict_form_episodes_replay_with_their_row_on_a_restarted_server(tmp_path):
    from gpufleet.env.client import EnvPool, LocalPool
    from gpufleet.env.servers import EnvServers
    from gpufleet.env.source import factory
    from gpufleet.env.trl import message

    (tmp_path / "envs.py").write_text(ENV + MULTI)
    name = f"{tmp_path}/envs.py:ENVIRONMENTS"
    items = [(f"c{i}", i, {"environment": "counter", "row": {"target": 2}}) for i in range(4)]
    step = [{"type": "function", "function": {"name": "increment", "arguments": {"step": 1}}}]

    def run(pool, between=lambda: None):
        out = [pool.reset(items)]
        for _ in range(2):
            out.append(pool.step([(eid, message("", step)) for eid, *_ in items]))
            between()
        return out + [pool.step([(eid, message("done", [])) for eid, *_ in items])]

    local = run(LocalPool(factory(name, {}), name))
    assert [r[1] for r in local[-1]] == [0.0] * 4 and sum(r[1] for t in local[1:] for r in t) == 4.0
    with EnvServers(name, {}, [str(tmp_path)], 1, tmp_path / "run") as servers:
        servers.start()
        pool = EnvPool.from_file(servers.servers_json, retry_for=60.0)
        killed = []

        def kill():
            if not killed:
                killed.append(servers.pids()[0])
                os.kill(killed[0], signal.SIGKILL)

        assert run(pool, kill) == local
        assert servers.restarts == 1 and pool.stats["replays"] >= 1


@pytest.mark.parametrize(
    ("data", "line"),
    [
        (None, "picks each episode's environment by its data row's 'environment' column"),
        ([{"prompt": "a", "environment": "vault"}, {"prompt": "b", "environment": "gym"}], "row 2 of"),
    ],
)
def test_check_refuses_a_dict_form_without_its_routing_column(tmp_path, data, line):
    (tmp_path / "envs.py").write_text(ENV + MULTI)
    job = JOB.replace("trl_env.py:Vault", "envs.py:ENVIRONMENTS")
    if data is not None:
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        job += "data: {path: data.jsonl}\n"
    (tmp_path / "job.yaml").write_text(job)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and line in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr


def test_reset_options_on_the_wire_are_an_object_and_only_on_reset():
    from gpufleet.env.server import BadRequest, parse_batch

    ok = parse_batch({"episodes": [{"id": "a", "seed": 1, "options": {"row": {"x": 1}}}]}, "reset")
    assert ok[0]["options"] == {"row": {"x": 1}}
    with pytest.raises(BadRequest, match=r"episodes\[0\].options must be an object"):
        parse_batch({"episodes": [{"id": "a", "seed": 1, "options": [1]}]}, "reset")
    with pytest.raises(BadRequest, match=r"episodes\[0\] must be"):
        parse_batch({"episodes": [{"id": "a", "action": "x", "options": {}}]}, "step")


NEEDS = """

class Needs(Vault):
    def reset(self, target, **kwargs) -> str:
        self.number, self.unlocked = target, False
        return f"{target}:"
"""


def test_check_tries_reset_with_the_first_data_row_as_train_does(tmp_path):
    """TRL's reset(self, target, **kwargs) reads a data column: check's trial passes it the first row."""
    (tmp_path / "trl_env.py").write_text(ENV + EXTRA + NEEDS)
    (tmp_path / "data.jsonl").write_text('{"prompt": "open ", "target": 42}\n')
    (tmp_path / "job.yaml").write_text(JOB.replace("trl_env.py:Vault", "trl_env.py:Needs"))
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and "missing 1 required positional argument: 'target'" in p.stdout, p.stdout
    p = run_user(
        "check", "job.yaml", "--gpus", "cpu", *sets("data.path=data.jsonl"), cwd=tmp_path, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_kill9_then_resume_is_bitwise_identical_on_a_trl_env_job_on_env_servers(tmp_path):
    """The example on an env server: kill -9 the whole run mid-way, resume, the same weights bit for bit
    (episodes are rebuilt from their seeds: reset's random state is the episode's)."""
    import subprocess

    import torch
    from safetensors.torch import load_file

    from helpers import console_script, process_env

    for f in ("agent-trl-env.yaml", "trl_env.py"):
        (tmp_path / f).write_text((ROOT / "examples" / f).read_text())
    common = ("train.max_steps=8", "output.save_every=3", "train.per_device_batch=32", "train.log_every=1")

    def argv(run):
        return [
            console_script(),
            "train",
            "agent-trl-env.yaml",
            *sets(*common, "env.servers=1", f"output.dir={run}"),
        ]

    def rows(run):
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    p = subprocess.run(
        argv("ref"), capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=600
    )
    assert p.returncode == 0, p.stdout + p.stderr
    kill9_after_steps(argv("run"), tmp_path / "run", 5, cwd=tmp_path, log=tmp_path / "killed.log")
    p = subprocess.run(
        argv("run"), capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=600
    )
    assert p.returncode == 0 and "resuming from" in p.stdout, p.stdout + p.stderr
    a = load_file(tmp_path / "ref" / "final" / "model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [x["reward"] for x in rows("ref")] == [x["reward"] for x in rows("run")]


def test_check_refuses_a_template_that_drops_the_environments_tool_results(tmp_path):
    """The chat template is checked with the class's tools (there are no rollout.tools here)."""
    from gpufleet.models.builtin import materialize

    folder = materialize("tiny-qwen2", tmp_path / "cache")
    jinja = folder / "chat_template.jinja"
    jinja.write_text(jinja.read_text().replace("{{ 'T:' + (m.content | string) + '\\n' }}", ""))
    (tmp_path / "trl_env.py").write_text(ENV)
    (tmp_path / "job.yaml").write_text(JOB)
    p = run_user(
        "check", "job.yaml", "--gpus", "cpu", *sets(f"model.path={folder}"), cwd=tmp_path, timeout=120
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "chat template cannot lay out episodes: it drops tool calls or tool results" in p.stdout, p.stdout
