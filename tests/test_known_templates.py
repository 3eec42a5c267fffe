"""Real models' chat templates that TRL 1.16 knows (models/known_templates.py): recognised as TRL does, TRL's
response template attached for tools, TRL's training template where the original is not prefix-preserving;
`gpufleet check` of a tools job on such a model folder passes where it refused before. The tokenizers are
built locally (tests/known_tok.py) with the original templates (tests/data/chat_templates/, from TRL).
The expected messages are TRL 1.16's: bench/trl_templates_equal.py compares every family with TRL itself."""

from __future__ import annotations

import json
import textwrap

import pytest

from gpufleet.models import known_templates
from gpufleet.rl.chat import ChatFormat, adopt_known, parse_response, template_problem
from helpers import run_user, sets
from known_tok import CALL, TOOL, fixture_tokenizer

# a sampled tool-call turn, as each family's model writes it (what the template renders for CALL)
SAMPLED = {
    "qwen2_5": '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": "75001"}}\n</tool_call><|im_end|>',
    "qwen3": '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": "75001"}}\n</tool_call><|im_end|>',
    "llama3_1": '{"name": "multiply", "parameters": {"a": 3, "b": "75001"}}<|eot_id|>',
}
NAMES = {"qwen2_5": "Qwen2.5", "qwen3": "Qwen3", "llama3_1": "Llama-3.1"}


def _prompt(tok, kwargs=None) -> list[int]:
    return ChatFormat(tok, [TOOL], kwargs).first_prompt("What is 3 times 75001?")


@pytest.mark.parametrize("key", sorted(SAMPLED))
def test_a_known_template_is_recognised_and_its_tool_calls_parse_as_trl(key):
    tok = fixture_tokenizer(key)
    assert known_templates.family(tok.chat_template).name == NAMES[key]
    assert known_templates.family(tok.chat_template + " ") is None  # exact, as TRL's string comparison
    assert getattr(tok, "response_template", None) is None  # as a hub tokenizer ships it
    kwargs, note = adopt_known(tok, [TOOL], {})
    assert note.startswith(f"chat template: {NAMES[key]} (TRL's response template attached")
    assert tok.response_template["fields"]["tool_calls"]["repeats"] is True
    ids = tok.encode(SAMPLED[key], add_special_tokens=False)
    # TRL 1.16's add_response_schema + parse_response give exactly this (bench/trl_templates_equal.py)
    assert parse_response(tok, ids, _prompt(tok, kwargs), [TOOL]) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [CALL],
    }
    answer = "The answer is 225003." + ("<|eot_id|>" if key == "llama3_1" else "<|im_end|>")
    said = parse_response(tok, tok.encode(answer, add_special_tokens=False), _prompt(tok, kwargs), [TOOL])
    assert said == {"role": "assistant", "content": "The answer is 225003."}
    assert template_problem(tok, [TOOL], kwargs) is None


def test_without_tools_nothing_is_attached_and_an_unknown_template_is_left_alone():
    tok = fixture_tokenizer("qwen2_5")
    assert adopt_known(tok, [], {"enable_thinking": False}) == (
        {"enable_thinking": False},
        "chat template: Qwen2.5 (known to TRL, used as it is)",
    )
    assert getattr(tok, "response_template", None) is None  # TRL attaches it only with tools
    tok.chat_template += "\n"
    assert adopt_known(tok, [TOOL], {}) == ({}, None)
    why = template_problem(tok, [TOOL], {})
    assert why.startswith("the tokenizer has no response_template") and "TRL 1.16" in why
    assert "Qwen2.5" in known_templates.no_parser_fix() and "Llama-3.1" in known_templates.no_parser_fix()


def test_qwen3_episodes_render_with_trls_training_template():
    """Qwen3's original template drops earlier turns' reasoning (not prefix-preserving by TRL's check):
    TRL's GRPOTrainer renders with qwen3_training.jinja, and so do gpufleet's chat episodes."""
    tok = fixture_tokenizer("qwen3")
    why = template_problem(tok, [TOOL], {})
    assert "re-renders the conversation before it" in why  # today's refusal, with the original
    with pytest.raises(ValueError, match="not prefix-preserving"):
        ChatFormat(tok, [TOOL]).bridge([{"role": "user", "content": "wrong"}])
    kwargs, note = adopt_known(tok, [TOOL], {})
    training = (known_templates.DATA / "qwen3_training.jinja").read_text()
    assert kwargs == {"chat_template": training}
    assert note == (
        "chat template: Qwen3 (TRL's response template attached; episodes rendered with TRL's "
        "prefix-preserving qwen3_training.jinja)"
    )
    assert template_problem(tok, [TOOL], kwargs) is None
    fmt = ChatFormat(tok, [TOOL], kwargs)
    bridge = fmt.bridge([{"role": "tool", "name": "multiply", "content": "225003"}])
    assert tok.decode(bridge) == (
        "\n<|im_start|>user\n<tool_response>\n225003\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(fmt.bridge([{"role": "user", "content": "wrong"}])) == (
        "\n<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n"
    )


TOOLS = '''
def multiply(a: int, b: int) -> str:
    """Multiply two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a * b)
'''
REWARDS = "def reward_func(completions, **kwargs):\n    return [0.0 for _ in completions]\n"


def _model_folder(folder, key: str, template_edit: str = ""):
    """A model folder as a user has it: a tiny Qwen2 (config and random weights) with a tokenizer whose chat
    template is `key`'s original (with `template_edit` appended: a template TRL does not know), both saved
    with save_pretrained."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = fixture_tokenizer(key)
    tok.chat_template += template_edit
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,  # the byte-level prompt with the tools is ~750 tokens
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def _tools_job(folder) -> None:
    (folder / "my_tools.py").write_text(TOOLS)
    (folder / "my_rewards.py").write_text(REWARDS)
    rows = [{"prompt": [{"role": "user", "content": f"{i}*3="}]} for i in range(8)]
    (folder / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "job.yaml").write_text(
        textwrap.dedent(
            """
            data: {path: tasks.jsonl}
            rollout:
              tools: [my_tools.py:multiply]
              max_prompt_length: 1200
              max_completion_length: 64
            reward: {functions: [my_rewards.py:reward_func]}
            algorithm: {num_generations: 4}
            train: {per_device_batch: 8, max_steps: 1}
            output: {dir: run}
            """
        )
    )


@pytest.mark.parametrize("key", ["qwen2_5", "qwen3"])
def test_check_passes_a_tools_job_on_a_known_model(tmp_path, key):
    """From the installed CLI in the user's folder, on a model folder with the hub's template: it passes
    (it refused before: no response_template), naming the family and the training template used."""
    _tools_job(tmp_path)
    folder = _model_folder(tmp_path / "model", key)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(f"model.path={folder}"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    training = (
        "; episodes rendered with TRL's prefix-preserving qwen3_training.jinja" if key == "qwen3" else ""
    )
    assert f"  chat template: {NAMES[key]} (TRL's response template attached{training})\n" in p.stdout


def test_check_refuses_a_tools_job_on_a_template_trl_does_not_know(tmp_path):
    """Qwen2.5's template changed by one character: no response template, refused as before, and the fix
    names the families gpufleet knows."""
    _tools_job(tmp_path)
    folder = _model_folder(tmp_path / "model", "qwen2_5", "\n")
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(f"model.path={folder}"), cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "chat template:" not in p.stdout.split("error:")[0]
    assert "cannot lay out tool calls: the tokenizer has no response_template" in p.stdout
    assert "fix: use a model whose chat template is one TRL 1.16 knows (Gemma 4, GLM-4-MoE" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr


def test_train_sees_what_check_sees(tmp_path):
    """The run's chat layout (rl/chatturns.chat_run, on the tokenizer load_tokenizer gives) attaches the same
    response template and renders with the same training template as check."""
    from gpufleet.config.load import load_job
    from gpufleet.models.load import load_tokenizer
    from gpufleet.rl.chatturns import chat_run

    _tools_job(tmp_path)
    folder = _model_folder(tmp_path / "model", "qwen3")
    job = load_job(str(tmp_path / "job.yaml"), [f"model.path={folder}"], env={}).job
    tok = load_tokenizer(str(folder))
    assert getattr(tok, "response_template", None) is None
    run = chat_run(job, tok)
    assert run.fmt.kwargs["chat_template"] == (known_templates.DATA / "qwen3_training.jinja").read_text()
    ids = tok.encode(SAMPLED["qwen3"], add_special_tokens=False)
    assert run.fmt.parse(ids, run.fmt.first_prompt("2*3="))["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 75001}}}
    ]


def test_train_runs_a_tools_job_on_a_qwen3_model_folder(tmp_path):
    """From the installed CLI: a Qwen3 model folder (the hub's template, no response_template) with tools
    trains a step; before, train refused it (chat_run: the template is not prefix-preserving)."""
    _tools_job(tmp_path)
    folder = _model_folder(tmp_path / "model", "qwen3")
    argv = ["train", "job.yaml", *sets(f"model.path={folder}", "rollout.max_completion_length=16")]
    p = run_user(*argv, cwd=tmp_path, env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "run").is_dir() and "Traceback" not in p.stdout + p.stderr


def test_the_shipped_data_is_whole():
    """Every family's response template and training template is in the package (pyproject's package data),
    with TRL's notice; Qwen2.5, Qwen3 and Llama-3.1 (the fixtures) are among them."""
    data = json.loads((known_templates.DATA / "known.json").read_text())
    assert (
        data["trl"] == "1.16.0"
        and "Apache\nLicense, Version 2.0" in (known_templates.DATA / "NOTICE").read_text()
    )
    for fam in data["families"]:
        assert fam["response"] is None or fam["response"] in data["response_templates"], fam
        assert fam["training"] is None or (known_templates.DATA / fam["training"]).is_file(), fam
    assert {"Qwen2.5", "Qwen3", "Llama-3.1", "GLM-4-MoE", "gpt-oss"} <= set(known_templates.tool_families())
