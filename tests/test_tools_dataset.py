"""Tools on a plain data set (TRL 1.16's `GRPOTrainer(tools=[...])` without an environment_factory): a job
with data.path + rollout.tools + reward functions and no env section runs TRL's tool loop as chat
episodes (the row's prompt rendered once with the tools, tool results spliced as the template's bridge,
up to max_tool_calling_iterations, the whole conversation in max_completion_length), its reward functions
get TRL's arguments (message lists, data columns, trainer_state, ...), check refuses what train would stop
on, and the usual guarantees hold (2 ranks == 1 rank, kill -9 then resume is bitwise identical)."""

from __future__ import annotations

import json
import textwrap

import pytest

from helpers import kill9_after_steps, run_user, sets

TOOLS = '''
import time


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def add(a: int, b: int) -> int:  # TRL docs: async_add (the built-in vocabulary has no "_")
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b
'''

# A reward function written for TRL 1.16 (its docs' conversational form and Example 6's logging), unchanged.
REWARDS = """
import json


def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    contents = [completion[-1]["content"] for completion in completions]
    rewards = [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({
            "prompts": kwargs["prompts"], "completions": completions, "ground_truth": ground_truth,
            "level": kwargs["level"], "step": kwargs["trainer_state"].global_step,
            "ids": kwargs["completion_ids"], "keys": sorted(kwargs),
        }) + "\\n")
    return rewards
"""


def _files(folder, chat: bool = False):
    (folder / "my_tools.py").write_text(TOOLS)
    (folder / "my_rewards.py").write_text(REWARDS)
    with (folder / "tasks.jsonl").open("w") as f:
        for i in range(16):
            a, b = i % 4, i % 3
            text = f"{a}*{b}="
            prompt = [{"role": "user", "content": text}] if chat else text
            f.write(json.dumps({"prompt": prompt, "ground_truth": str(a * b), "level": i % 2}) + "\n")


def _job(folder, **rollout):
    from gpufleet.config.schema import Job

    tools = [f"{folder}/my_tools.py:multiply", f"{folder}/my_tools.py:add"]
    return Job.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen2"},
            "data": {"path": str(folder / "tasks.jsonl")},
            "rollout": {"tools": tools, "max_prompt_length": 64, "max_completion_length": 40, **rollout},
            "reward": {"functions": [f"{folder}/my_rewards.py:reward_func"]},
            "output": {"dir": str(folder / "run")},
        }
    )


def _scripted(monkeypatch, script: list[str]):
    """The policy's turns, fixed (what is under test happens after sampling); cut to the budget as `_act`."""
    from gpufleet.rl import episodes

    def act(p, live, turn, budget):
        tok = p.tokenizer
        text = script[turn]
        ids = tok.encode(text.removesuffix("<eos>"), add_special_tokens=False)
        ids += [tok.eos_token_id] if text.endswith("<eos>") else []
        return [(ids[: budget - len(e.tokens)], text.removesuffix("<eos>")) for e in live]

    monkeypatch.setattr(episodes, "_act", act)


def _tool(name, content):
    return {"role": "tool", "name": name, "content": content}


@pytest.mark.parametrize("chat", [False, True])
def test_trls_tool_loop_on_data_rows(tmp_path, monkeypatch, chat):
    """The row's prompt (text wrapped as a user message, or chat messages) rendered with the tools; a call
    answered by its tool message spliced as the template's bridge (mask 0); a second call past
    max_tool_calling_iterations 1 is not run and ends the episode (TRL); the data columns and TRL's
    message lists come with the episodes."""
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    _files(tmp_path, chat=chat)
    _scripted(monkeypatch, ["[multiply a=2,b=3]<eos>", "[add a=1,b=1]<eos>", "x<eos>"])
    p = build(_job(tmp_path, max_tool_calling_iterations=1))
    e = play(p, [0, 1, 2], [0, 0, 5], [0, 1, 2], gen_index=0)
    tok, fmt = p.tokenizer, p.chat.fmt
    row0 = p.source.examples(0, 1)[0]
    said = [{"role": "user", "content": row0["prompt"]}] if not chat else row0["prompt"]
    prompt = e.rollout.prompt_ids[0][e.rollout.prompt_mask[0].bool()].tolist()
    assert prompt == fmt.first_prompt(said)
    assert tok.decode(prompt).startswith("tools: multiply(a,b) add(a,b)\nU:")
    bridge = fmt.bridge([_tool("multiply", "6")])
    assert tok.decode(bridge) == "T:6\nA:"
    call, again = tok.encode("[multiply a=2,b=3]"), tok.encode("[add a=1,b=1]")
    eos = [tok.eos_token_id]
    attn = e.rollout.completion_mask[0].bool()
    assert e.rollout.completion_ids[0][attn].tolist() == call + eos + bridge + again + eos
    assert e.loss_mask[0][attn].tolist() == [1.0] * (len(call) + 1) + [0.0] * len(bridge) + [1.0] * (
        len(again) + 1
    )
    prompts, completions = e.conversation["prompts"], e.conversation["completions"]
    assert prompts[0] == said
    function = {"name": "multiply", "arguments": {"a": 2, "b": 3}}
    assert completions[0][0]["tool_calls"] == [{"type": "function", "function": function}]
    assert completions[0][1] == _tool("multiply", "6")
    assert completions[0][2]["tool_calls"][0]["function"]["name"] == "add"  # not run: the limit
    assert len(completions[0]) == 3 and e.counts["tool_calls"].tolist() == [1.0, 1.0, 1.0]
    assert e.columns["ground_truth"][0] == row0["ground_truth"] and "prompt" not in e.columns
    row5 = p.source.examples(5, 1)[0]
    assert e.columns["level"] == [row0["level"], row0["level"], row5["level"]]


def test_a_tool_result_past_max_completion_length_is_dropped_and_ends_the_episode(tmp_path, monkeypatch):
    """TRL's budget: everything after the prompt fits max_completion_length; a tool answer that leaves no
    room is not spliced (nor kept in the completion's messages); an async tool runs; no limit on iterations
    (None) but the budget."""
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    _files(tmp_path)
    _scripted(monkeypatch, ["[add a=2,b=3]<eos>"] * 8)
    p = build(_job(tmp_path, max_completion_length=38))
    e = play(p, [0], [0], [0], gen_index=0)
    tok = p.tokenizer
    attn = e.rollout.completion_mask[0].bool()
    turn = tok.encode("[add a=2,b=3]") + [tok.eos_token_id]  # 14 tokens; the bridge "T:5\nA:" 6
    bridge = p.chat.fmt.bridge([_tool("add", "5")])
    assert e.rollout.completion_ids[0][attn].tolist() == turn + bridge + turn  # 34 + 6 > 38: dropped
    completions = e.conversation["completions"]
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant"]
    assert completions[0][1]["content"] == "5"
    assert not bool(e.rollout.is_truncated[0])  # TRL's is_truncated: it ends with EOS
    assert e.counts["tool_calls"].tolist() == [2.0]  # the dropped result's call ran (TRL counts it too)


def test_mask_truncated_completions_drops_the_loss_of_episodes_not_ending_in_eos(tmp_path, monkeypatch):
    """TRL's mask_truncated_completions on its tool loop: an episode whose last token is not EOS (here the
    second turn, cut by the budget) gets loss mask 0; one ending in EOS keeps its mask (policy tokens 1,
    the tool result 0)."""
    import yaml

    from gpufleet.config.load import load_job
    from gpufleet.rl import trainer

    _files(tmp_path)
    monkeypatch.chdir(tmp_path)  # the reward function writes seen.jsonl where it runs
    _scripted(monkeypatch, ["[add a=2,b=3]<eos>", "12345678901234567890"])
    masks = {}
    for flag in (False, True):
        spec = _job(tmp_path, max_completion_length=38).model_dump(exclude_defaults=True)
        spec |= {"algorithm": {"num_generations": 4, "mask_truncated_completions": flag}}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec | {"train": {"per_device_batch": 4}}))
        job = load_job(str(tmp_path / "job.yaml"), [], env={}).job
        p = trainer.build(job)
        scored = trainer.generation_step(p, 0, trainer.autocast_for(job, p.device))
        assert scored.rollout.is_truncated.all()  # 14 + 6 + 18 = 38: the second turn is cut, no EOS
        masks[flag] = scored.batch.completion_mask
    assert masks[False].sum() > 0 and masks[True].sum() == 0
    _scripted(monkeypatch, ["[add a=2,b=3]<eos>", "5<eos>"])
    scored = trainer.generation_step(p, 0, trainer.autocast_for(job, p.device))
    assert not scored.rollout.is_truncated.any() and scored.batch.completion_mask.sum() == 4 * (14 + 2)


@pytest.mark.parametrize("budget", [40, 41])
def test_a_tool_result_that_exactly_fills_max_completion_length_is_kept_and_ends_the_episode(
    tmp_path, monkeypatch, budget
):
    """TRL 1.16's `_tool_call_loop` drops a tool result only past max_completion_length (`len > max`): at
    40 the second result's 6 tokens end exactly at the budget, so they are kept (mask 0), its tool
    message is in the completion, and the episode ends there (TRL samples again and keeps 0 tokens), cut
    (its last token is not EOS); at 41 the policy samples one more token, and it is trained."""
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    _files(tmp_path)
    _scripted(monkeypatch, ["[add a=2,b=3]<eos>"] * 8)
    p = build(_job(tmp_path, max_completion_length=budget))
    e = play(p, [0], [0], [0], gen_index=0)
    tok = p.tokenizer
    attn = e.rollout.completion_mask[0].bool()
    ids = e.rollout.completion_ids[0][attn].tolist()
    turn = tok.encode("[add a=2,b=3]") + [tok.eos_token_id]  # 14 tokens
    bridge = tok.encode("T:5\nA:")  # the template's tool bridge, 6 tokens: 14 + 6 + 14 + 6 = 40
    assert p.chat.fmt.bridge([_tool("add", "5")]) == bridge
    extra = tok.encode("[") if budget == 41 else []  # what the next turn has room for
    assert ids == turn + bridge + turn + bridge + extra and len(ids) == budget
    assert e.loss_mask[0][attn].tolist() == ([1.0] * 14 + [0.0] * 6) * 2 + [1.0] * len(extra)
    said = e.conversation["completions"][0]
    roles = ["assistant", "tool", "assistant", "tool"] + ["assistant"] * len(extra)
    assert [m["role"] for m in said] == roles and said[3] == _tool("add", "5")
    assert bool(e.rollout.is_truncated[0]) and e.counts["tool_calls"].tolist() == [2.0]
    assert int(e.rollout.completion_lengths[0]) == 28 + len(extra)


def _job_file(folder) -> None:
    (folder / "job.yaml").write_text(
        textwrap.dedent(
            """
            model: {path: builtin:tiny-qwen2}
            data: {path: tasks.jsonl}
            rollout:
              tools: [my_tools.py:multiply, my_tools.py:add]
              max_tool_calling_iterations: 2
              max_prompt_length: 48
              max_completion_length: 32
            reward: {functions: [my_rewards.py:reward_func]}
            algorithm: {num_generations: 4}
            train: {per_device_batch: 8, max_steps: 2, log_every: 1, learning_rate: 0.001}
            output: {dir: run}
            """
        )
    )


def test_trl_reward_function_gets_trls_arguments_from_the_installed_cli(tmp_path):
    """The TRL-style reward function runs unchanged: prompts and completions as message lists, the data
    columns, completion_ids, trainer_state, log_extra / log_metric; TRL's tool metrics are logged."""
    _files(tmp_path)
    _job_file(tmp_path)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("train", "job.yaml", cwd=tmp_path, env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    seen = [json.loads(x) for x in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert [s["step"] for s in seen] == [0, 1]
    first = seen[0]
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in first["completions"])
    assert first["prompts"][0] == [{"role": "user", "content": first["prompts"][0][0]["content"]}]
    assert len(first["ground_truth"]) == len(first["level"]) == len(first["completions"]) == 8
    assert {"trainer_state", "completion_ids", "prompts", "level"} <= set(first["keys"])
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("tools/call_frequency", "tools/failure_frequency", "rewards/reward_func/mean", "accuracy"):
        assert key in rows[-1], key


@pytest.mark.parametrize(
    ("sets_", "line"),
    [
        (("rollout.min_completion_length=2",), "min_completion_length is not implemented"),
        (("rollout.max_prompt_length=20",), "the chat template's first prompt is 35 tokens before the data"),
        (("env.name=builtin:keys",), "rollout.tools are offered to the policy in chat episodes only"),
        (("rollout.tools=my_tools.py:nope",), "nope"),
    ],
)
def test_check_refuses_what_a_tools_on_data_job_would_stop_on(tmp_path, sets_, line):
    _files(tmp_path)
    _job_file(tmp_path)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(*sets_), cwd=tmp_path)
    assert p.returncode == 2 and line in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_a_tools_on_data_job(tmp_path):
    """Seeds come from the prompt position, the generation and the turn, never the rank."""
    from safetensors.torch import load_file

    _files(tmp_path)
    _job_file(tmp_path)
    common = ("train.max_steps=3", "output.save_every=0")
    p = run_user(
        "train", "job.yaml", *sets("output.dir=one", "train.per_device_batch=16", *common), cwd=tmp_path
    )
    assert p.returncode == 0, p.stdout + p.stderr
    two = ("output.dir=two", "train.per_device_batch=8", "launch.nproc_per_node=2", *common)
    p = run_user("train", "job.yaml", *sets(*two), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = (
        load_file(tmp_path / "one/final/model.safetensors"),
        load_file(tmp_path / "two/final/model.safetensors"),
    )
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [x["reward"] for x in one] == pytest.approx([x["reward"] for x in two], abs=1e-6)
    assert [x["tools/call_frequency"] for x in one] == pytest.approx([x["tools/call_frequency"] for x in two])
    assert sum(x["tools/call_frequency"] for x in one) > 0  # the episodes did call tools


@pytest.mark.slow
def test_kill9_then_resume_is_bitwise_identical_on_a_tools_on_data_job(tmp_path):
    import subprocess

    import torch
    from safetensors.torch import load_file

    from helpers import console_script, process_env

    _files(tmp_path)
    _job_file(tmp_path)
    common = ["train.max_steps=8", "output.save_every=3", "train.per_device_batch=16"]

    def argv(run):
        return [console_script(), "train", "job.yaml", *sets(f"output.dir={run}", *common)]

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
    assert [x["reward"] for x in _rows(ref)] == [x["reward"] for x in _rows(run)]
    assert [x["tools/call_frequency"] for x in _rows(ref)] == [x["tools/call_frequency"] for x in _rows(run)]


TRL_ENV = '''
import json


class Counter:
    def reset(self, **kwargs) -> str | None:
        self.target, self.count = kwargs["target"], 0
        return None

    def bump(self) -> str:
        """Add one to the counter."""
        self.count += 1
        return str(self.count)


def counted(prompts, completions, environments, target, **kwargs):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"counts": [e.count for e in environments], "target": list(target),
                            "calls": [sum(len(m.get("tool_calls") or []) for m in c) for c in completions],
                            "prompts": prompts, "keys": sorted(kwargs)}) + "\\n")
    return [float(e.count == t) for e, t in zip(environments, target)]
'''


@pytest.mark.slow  # end to end (~10 s); make test-slow runs it
def test_trl_environment_reward_functions_get_the_instances_and_the_data_columns(tmp_path):
    """TRL's `environments` (the episode's instances, env.servers 0) and the rows' columns."""
    (tmp_path / "counter.py").write_text(TRL_ENV)
    with (tmp_path / "rows.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i % 3}:", "target": i % 3}) + "\n")
    (tmp_path / "job.yaml").write_text(
        textwrap.dedent(
            """
            model: {path: builtin:tiny-qwen2}
            data: {path: rows.jsonl}
            env: {name: counter.py:Counter, format: chat, servers: 0, max_turns: 3, max_action_tokens: 8}
            rollout: {max_prompt_length: 32}
            reward: {functions: [counter.py:counted]}
            algorithm: {num_generations: 4}
            train: {per_device_batch: 16, max_steps: 2, log_every: 1}
            output: {dir: run}
            """
        )
    )
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("env.servers=auto"), cwd=tmp_path)
    assert p.returncode == 2 and "'environments', which gpufleet does not pass" in p.stdout, p.stdout
    assert "--set env.servers=0" in p.stdout  # the instances live on the servers then
    p = run_user("train", "job.yaml", cwd=tmp_path, env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    seen = [json.loads(x) for x in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 2 and all(len(s["counts"]) == len(s["target"]) == 16 for s in seen)
    assert all(
        0 <= c <= 2 and c <= calls for s in seen for c, calls in zip(s["counts"], s["calls"], strict=True)
    )
    assert [m["content"] for m in seen[0]["prompts"][0]] == [f"{seen[0]['target'][0]}:"]
    assert "environment" not in seen[0]["keys"] and "trainer_state" in seen[0]["keys"]


def test_check_refuses_a_template_that_drops_tool_results_with_tools_on_data(tmp_path):
    """The template must support tool calling (TRL's supports_tool_calling): said on rollout.tools."""
    from gpufleet.models.builtin import materialize

    folder = materialize("tiny-qwen2", tmp_path / "cache")
    jinja = folder / "chat_template.jinja"
    jinja.write_text(jinja.read_text().replace("{{ 'T:' + (m.content | string) + '\\n' }}", ""))
    _files(tmp_path)
    _job_file(tmp_path)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(f"model.path={folder}"), cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert (
        "rollout.tools: " in p.stdout
        and "cannot lay out tool calls: it drops tool calls or tool results" in p.stdout
    )
    assert "or remove rollout.tools" in p.stdout and "Traceback" not in p.stdout + p.stderr
