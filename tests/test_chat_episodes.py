"""Chat episodes (env.format: chat) and tools (rollout.tools): the trained sequence is the first prompt
rendered once, the sampled tokens, and between them the bridge tokens the template defines (mask 0);
tool calls run, fail softly and are answered as tool messages; check refuses what train would stop on."""

from __future__ import annotations

import json
import textwrap

import pytest

from helpers import kill9_after_steps, run_process

TOOLS = '''
import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("boom")


async def slow() -> str:
    """Takes too long."""
    time.sleep(30)
    return "late"


def nodoc(a):
    return a
'''


def _job(tmp_path, **rollout):
    from gpufleet.config.schema import Job

    return Job.model_validate(
        {
            "env": {
                "name": "builtin:keys",
                "format": "chat",
                "servers": 0,
                "kwargs": {"doors": 3, "length": 8, "letters": "a"},
                "max_turns": 6,
                "max_action_tokens": 16,
                "max_observation_tokens": 8,
                "max_episode_tokens": 400,
            },
            "rollout": {"max_prompt_length": 64, **rollout},
            "output": {"dir": str(tmp_path / "run")},
        }
    )


def _runs(ids: list[int], mask: list[float]) -> list[tuple[bool, list[int]]]:
    """The row as (trained?, tokens) runs of equal mask."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(ids, mask, strict=True):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(t)
        else:
            out.append((bool(m), [t]))
    return out


def test_chat_episode_is_the_rendered_prompt_sampled_tokens_and_template_bridges(tmp_path):
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    p = build(_job(tmp_path))
    e = play(p, list(range(32)), [j // 8 for j in range(32)], list(range(32)), gen_index=0)
    tok = p.tokenizer
    user_a = p.chat.fmt.bridge([{"role": "user", "content": "\na:"}])
    assert tok.decode(user_a) == "U:\na:\nA:"  # the template's end of turn, user message, generation prompt
    went_on = 0
    for i in range(32):
        prompt = e.rollout.prompt_ids[i][e.rollout.prompt_mask[i].bool()].tolist()
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": "a:"}], add_generation_prompt=True, return_dict=False
        )
        assert prompt == list(rendered) and tok.decode(prompt) == "U:a:\nA:"
        attn = e.rollout.completion_mask[i].bool()
        runs = _runs(e.rollout.completion_ids[i][attn].tolist(), e.loss_mask[i][attn].tolist())
        assert [trained for trained, _ in runs] == [k % 2 == 0 for k in range(len(runs))]
        actions = [ids for trained, ids in runs if trained]
        assert [tok.decode(a, skip_special_tokens=True) for a in actions] == [
            t for t, mine in e.segments[i] if mine
        ]
        assert all(len(a) <= 16 for a in actions)
        for trained, ids in runs:
            if not trained:
                assert ids == user_a
                went_on += 1
    assert went_on > 0


def _scripted(monkeypatch, script: list[str]):
    """The policy's turns, fixed (the thing under test is what happens after sampling)."""
    from gpufleet.rl import episodes

    def act(p, live, turn, budget):
        tok = p.tokenizer
        text = script[turn]
        ids = tok.encode(text.removesuffix("<eos>"), add_special_tokens=False)
        ids += [tok.eos_token_id] if text.endswith("<eos>") else []
        return [(ids, text.removesuffix("<eos>")) for _ in live]

    monkeypatch.setattr(episodes, "_act", act)


def test_tool_calls_run_fail_softly_and_are_spliced_as_tool_messages(tmp_path, monkeypatch):
    from gpufleet.rl.episodes import episode_stats, play
    from gpufleet.rl.parts import build

    (tmp_path / "mytools.py").write_text(TOOLS)
    tools = [f"{tmp_path}/mytools.py:{n}" for n in ("add", "boom", "slow")]
    job = _job(tmp_path, tools=tools, tool_timeout=1.0, max_tool_calling_iterations=3)
    job.env.kwargs = {"doors": 1, "length": 1, "letters": "a"}
    script = ["[add a=2,b=3]<eos>", "[boom x=1][nope]<eos>", "[slow]", "[add a=1,b=1]a<eos>"]
    _scripted(monkeypatch, script)
    p = build(job)
    e = play(p, [0, 1], [0, 0], [0, 1], gen_index=0)
    tok, fmt = p.tokenizer, p.chat.fmt
    assert "tools: add(a,b) boom(x) slow()\n" in tok.decode(e.rollout.prompt_ids[0].tolist())

    def tool(name, content):
        return {"role": "tool", "name": name, "content": content}

    error = "{'error': 'slow did not return within rollout.tool_timeout 1 s'}"
    want = (
        tok.encode("[add a=2,b=3]")
        + [tok.eos_token_id]
        + fmt.bridge([tool("add", "5")])
        + tok.encode("[boom x=1][nope]")
        + [tok.eos_token_id]
        + fmt.bridge([tool("boom", "{'error': 'boom'}"), tool("nope", "{'error': 'Tool nope not found.'}")])
        + tok.encode("[slow]")
        + fmt.bridge([tool("slow", error)])
        + tok.encode("[add a=1,b=1]a")
        + [tok.eos_token_id]
    )  # the 4th turn is past max_tool_calling_iterations: its content "a" goes to the environment
    attn = e.rollout.completion_mask[0].bool()
    assert e.rollout.completion_ids[0][attn].tolist() == want
    assert float(e.env_rewards[0]) == 1.0  # the door opened: the episode went on after the failures
    assert tok.decode(fmt.bridge([tool("add", "5")])) == "T:5\nA:"

    class Rt:
        distributed = False

    stats = episode_stats(Rt(), e)
    assert stats["tools/call_frequency"] == 4.0 and stats["tools/failure_frequency"] == 0.75


@pytest.mark.parametrize("budget", [19, 20])
def test_a_tool_result_that_exactly_fills_the_episode_budget_is_kept_in_a_chat_env_episode(
    tmp_path, monkeypatch, budget
):
    """TRL 1.16's rule for tool results at the end of the budget, in an env's chat episode: the call's 14
    tokens and its result's 6 bridge tokens are 20, so at env.max_episode_tokens 20 the result is kept
    (mask 0, its tool message in the completion) and the episode ends there; at 19 it is dropped."""
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    (tmp_path / "mytools.py").write_text(TOOLS)
    job = _job(tmp_path, tools=[f"{tmp_path}/mytools.py:add"])
    job.env.max_episode_tokens = budget
    _scripted(monkeypatch, ["[add a=2,b=3]<eos>"] * 6)
    p = build(job)
    e = play(p, [0], [0], [0], gen_index=0)
    tok = p.tokenizer
    turn = tok.encode("[add a=2,b=3]") + [tok.eos_token_id]
    bridge = tok.encode("T:5\nA:") if budget == 20 else []
    attn = e.rollout.completion_mask[0].bool()
    assert e.rollout.completion_ids[0][attn].tolist() == turn + bridge
    assert e.loss_mask[0][attn].tolist() == [1.0] * 14 + [0.0] * len(bridge)
    roles = [m["role"] for m in e.conversation["completions"][0]]
    assert roles == ["assistant", "tool"][: 1 + bool(bridge)] and int(e.counts["turns"][0]) == 1
    assert bool(e.rollout.is_truncated[0]) and e.counts["tool_calls"].tolist() == [1.0]


def _check(tmp_path, *sets):
    job = tmp_path / "job.yaml"
    job.write_text(
        textwrap.dedent(
            """
            model: {path: builtin:tiny-qwen2}
            env: {name: builtin:keys, format: chat, servers: 0, max_episode_tokens: 256}
            rollout: {max_prompt_length: 64}
            """
        )
    )
    argv = ["check", str(job), "--gpus", "cpu"]
    for s in sets:
        argv += ["--set", s]
    return run_process(*argv, cwd=tmp_path, timeout=120)


def test_check_refuses_a_template_that_re_renders_earlier_turns(tmp_path):
    from gpufleet.models.builtin import materialize

    folder = materialize("tiny-qwen2", tmp_path / "cache")
    jinja = folder / "chat_template.jinja"
    jinja.write_text(
        jinja.read_text().replace(
            "{{ 'A:' + (m.content or '') }}",
            "{{ 'A:' + ((m.content or '') if loop.last else (m.content or '').split('</think>')[-1]) }}",
        )
    )
    p = _check(tmp_path, f"model.path={folder}")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "chat template cannot lay out episodes: adding message 3 re-renders the conversation" in p.stdout
    assert "rollout.chat_template_kwargs" in p.stdout and "env.format=text" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (("rollout.tools=mytools.py:nodoc",), "transformers cannot describe mytools.py:nodoc"),
        (("rollout.tools=mytools.py:add", "env.format=text"), "in chat episodes only"),
        (("rollout.tools=mytools.py:gone",), "gone"),
        (
            ("rollout.tools=mytools.py:add,mytools.py:slow", "rollout.max_prompt_length=20"),
            "the chat template's first prompt is 28 tokens before any observation (the tools it offers",
        ),
    ],
)
def test_check_refuses_bad_tools_in_one_line(tmp_path, sets, line):
    (tmp_path / "mytools.py").write_text(TOOLS)
    p = _check(tmp_path, *sets)
    assert p.returncode == 2 and line in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr


def test_check_accepts_tools_in_chat_episodes(tmp_path):
    (tmp_path / "mytools.py").write_text(TOOLS)
    p = _check(tmp_path, "rollout.tools=mytools.py:add,mytools.py:slow")
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_a_chat_episode_job(tmp_path):
    """The agent-keys example in chat format: seeds come from the episode and turn, never the rank."""
    from test_env_train import metrics, train, weights

    sets = ("env.format=chat", "env.max_episode_tokens=48", "rollout.max_prompt_length=16")
    sets += ("train.max_steps=3", "train.learning_rate=1e-3", "output.save_every=0")
    one, two = tmp_path / "one", tmp_path / "two"
    p = train(one, "train.per_device_batch=32", *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    p = train(two, "train.per_device_batch=16", "launch.nproc_per_node=2", *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = weights(one), weights(two)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
    assert [x["reward"] for x in metrics(one)] == pytest.approx([x["reward"] for x in metrics(two)], abs=1e-6)
    assert metrics(one)[-1]["env/turns_mean"] == pytest.approx(metrics(two)[-1]["env/turns_mean"])


@pytest.mark.slow
def test_kill9_then_resume_is_bitwise_identical_on_a_chat_episode_job_with_a_tool(tmp_path):
    """The agent-tools example (chat episodes, a tool): kill -9 mid-run, resume, same weights bit for bit."""
    import subprocess
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from helpers import console_script, process_env

    example = Path(__file__).resolve().parents[1] / "examples" / "agent-tools.yaml"
    sets = ["train.max_steps=8", "output.save_every=3", "train.per_device_batch=32", "train.log_every=1"]

    def argv(run):
        return [console_script(), "train", str(example), "--set", f"output.dir={run}"] + [
            x for s in sets for x in ("--set", s)
        ]

    def rows(run):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    ref, run = tmp_path / "ref", tmp_path / "run"
    p = subprocess.run(
        argv(ref), capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=600
    )
    assert p.returncode == 0, p.stdout + p.stderr
    kill9_after_steps(argv(run), run, 5, cwd=tmp_path, log=tmp_path / "killed.log")
    p = subprocess.run(
        argv(run), capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=600
    )
    assert p.returncode == 0 and "resuming from" in p.stdout, p.stdout + p.stderr
    a, b = load_file(ref / "final" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [x["reward"] for x in rows(ref)] == [x["reward"] for x in rows(run)]
    assert "tools/call_frequency" in rows(run)[-1]
