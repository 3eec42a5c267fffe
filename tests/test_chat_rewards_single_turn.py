"""Single-turn jobs on chat-format data pass reward functions TRL 1.16's conversational forms: `prompts`
the rows' message lists, `completions` one assistant message each, as TRL's `_generate` builds it (the
tokenizer's `parse_response` on the sampled ids after the rendered prompt, or the decoded text for a
tokenizer without a response template); text data still passes text."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest

from helpers import run_user

ROWS = [
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}],
        "answer": "5",
    },
    {"prompt": [{"role": "user", "content": "hi"}], "answer": "x"},
]


def _source(folder, rows):
    from gpufleet.config.schema import DataSection
    from gpufleet.rl.data import PromptSource

    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptSource(DataSection(path=str(folder / "data.jsonl"), shuffle=False), 0)


def _ids(tok, text: str) -> list[int]:
    """One token per character; "<eos>" and "<pad>" are those tokens."""
    out, rest = [], text
    while rest:
        for special, token in (("<eos>", tok.eos_token_id), ("<pad>", tok.pad_token_id)):
            if rest.startswith(special):
                out.append(token)
                rest = rest[len(special) :]
                break
        else:
            out.append(tok.convert_tokens_to_ids(rest[0]))
            rest = rest[1:]
    return out


def _rollout(tok, prompts: list[list[int]], completions: list[list[int]]):
    import torch

    from gpufleet.engine.rollout import Rollout, left_pad

    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
    width = max(len(c) for c in completions)
    ids = torch.full((len(completions), width), tok.pad_token_id)
    mask = torch.zeros((len(completions), width), dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    lengths = mask.sum(1)
    return Rollout(prompt_ids, prompt_mask, ids, mask, lengths, lengths == width)


# The sampled turns and what TRL 1.16 passes for them, worked out from its code by hand:
# `parse_response(tokenizer, ids, prefix=prompt_ids, tools=[])` calls `tokenizer.parse_response(ids, ...)`
# (decoded with special tokens), cuts a trailing eos_token off the content, makes an empty content "".
TURNS = [
    ("[add a=2,b=3]<eos>", {"name": "add", "arguments": {"a": "2", "b": "3"}}, ""),  # a call: content "<eos>"
    ("ab<pad>c<eos>", None, "ab<pad>c"),  # special tokens inside stay (TRL decodes them)
    ("hel", None, "hel"),  # cut by max_completion_length: no EOS to cut
    ("[]<eos>", None, "[]"),  # not a call
]


def test_chat_data_passes_trls_message_lists_worked_out_by_hand(tmp_path):
    from gpufleet.models.builtin import char_tokenizer
    from gpufleet.rl.rewards import chat_said

    tok = char_tokenizer()
    p = SimpleNamespace(source=_source(tmp_path, ROWS), tokenizer=tok)
    row_pos = [0, 0, 1, 1]
    heads = [
        tok.apply_chat_template(ROWS[i]["prompt"], add_generation_prompt=True, return_dict=False)
        for i in row_pos
    ]
    rollout = _rollout(tok, heads, [_ids(tok, t) for t, _, _ in TURNS])
    texts = ["prompt text"] * 4, ["completion text"] * 4
    said = chat_said(p, row_pos, rollout, *texts)
    assert said["prompts"] == [ROWS[0]["prompt"]] * 2 + [ROWS[1]["prompt"]] * 2
    want = []
    for _, call, content in TURNS:
        message = {"role": "assistant", "content": content}
        if call is not None:
            message["tool_calls"] = [{"type": "function", "function": call}]
        want.append([message])
    assert said["completions"] == want
    said["prompts"][0][0]["content"] = "changed by a reward function"
    assert p.source.examples(0, 1)[0]["prompt"] == ROWS[0]["prompt"]  # the data row is not (a copy)

    tok.response_template = None  # TRL: no response template, the text decoded without special tokens
    said = chat_said(p, row_pos, rollout, *texts)
    assert said["completions"] == [
        [{"role": "assistant", "content": c}] for c in ("[add a=2,b=3]", "abc", "hel", "[]")
    ]

    text_rows = [{"prompt": "2+3?", "answer": "5"}]  # text data: None, the functions get the text
    p.source = _source(tmp_path, text_rows)
    assert chat_said(p, [0], _rollout(tok, [[5]], [[6]]), ["2+3?"], ["x"]) is None


REWARDS = """
import json


def typed(prompts, completions, completion_ids, answer, **kwargs):
    for p, c, ids in zip(prompts, completions, completion_ids):
        assert isinstance(p, list) and p[-1] == {"role": "user", "content": p[-1]["content"]}, p
        assert isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant", c
        assert isinstance(c[0]["content"], str) and isinstance(ids, list), c
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "ids": completion_ids}) + "\\n")
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]
"""


@pytest.mark.slow  # end to end (~10 s); make test-slow runs it
def test_a_single_turn_job_on_chat_data_passes_message_lists_from_the_installed_cli(tmp_path):
    """A user's reward function that asserts TRL's conversational types runs a real single-turn job."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    with (tmp_path / "chat.jsonl").open("w") as f:
        for i in range(8):
            f.write(
                json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)}) + "\n"
            )
    (tmp_path / "job.yaml").write_text(
        textwrap.dedent(
            """
            model: {path: builtin:tiny-qwen2}
            data: {path: chat.jsonl}
            rollout: {max_prompt_length: 32, max_completion_length: 12}
            reward: {functions: [my_rewards.py:typed]}
            algorithm: {num_generations: 4}
            train: {per_device_batch: 8, max_steps: 2, log_every: 1}
            output: {dir: run}
            """
        )
    )
    p = run_user("train", "job.yaml", cwd=tmp_path, env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    seen = [json.loads(x) for x in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 2
    data = [json.loads(x)["prompt"] for x in (tmp_path / "chat.jsonl").read_text().splitlines()]
    from gpufleet.models.builtin import char_tokenizer

    tok = char_tokenizer()
    for batch in seen:
        assert all(prompt in data for prompt in batch["prompts"])
        for (message,), ids in zip(batch["completions"], batch["ids"], strict=True):
            text = tok.decode(ids[:-1] if ids[-1:] == [tok.eos_token_id] else ids)
            if "tool_calls" not in message and "[" not in text and "A:" not in text:
                assert message == {"role": "assistant", "content": text}


def test_the_shipped_answer_rewards_read_chat_completions():
    """gpufleet.rewards' functions score a TRL chat completion as its content, like the text."""
    from gpufleet.rewards import answer_format, answer_match

    chat = [
        [{"role": "assistant", "content": "so <answer>1,234</answer>"}],
        [{"role": "assistant", "content": "7"}],
    ]
    text = [c[0]["content"] for c in chat]
    answers = ["... #### 1234", "#### 8"]
    assert answer_match([], chat, answer=answers) == answer_match([], text, answer=answers) == [1.0, 0.0]
    assert answer_format([], chat) == answer_format([], text) == [0.2, 0.0]


def test_chat_data_prompts_are_rendered_with_chat_template_kwargs(tmp_path):
    """rollout.chat_template_kwargs reach the template for a single-turn job's chat prompts (TRL passes
    them to apply_chat_template there too), and check does not call them unread for a data job."""
    from gpufleet.models.builtin import char_tokenizer
    from gpufleet.rl.batch import tokenize_prompts

    tok = char_tokenizer()
    tok.chat_template = (
        "{% if brief %}B|{% endif %}{% for m in messages %}U:{{ m['content'] }}\n{% endfor %}A:"
    )
    rows = [[{"role": "user", "content": "hi"}]]
    assert tokenize_prompts(tok, rows, 64)[1] == ["U:hi\nA:"]
    ids, texts = tokenize_prompts(tok, rows, 64, template_kwargs={"brief": True})
    assert texts == ["B|U:hi\nA:"] and ids == [tok.encode("B|U:hi\nA:", add_special_tokens=False)]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": rows[0], "answer": "x"}) + "\n")
    job = "model: {path: builtin:tiny-qwen2}\ndata: {path: chat.jsonl}\n"
    job += "reward: {functions: [gpufleet.rewards:answer_match]}\n"
    (tmp_path / "job.yaml").write_text(job + "rollout: {chat_template_kwargs: {brief: true}}\n")
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0 and "is only read" not in p.stdout, p.stdout + p.stderr
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "hi", "answer": "x"}) + "\n")  # text prompts
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rollout.chat_template_kwargs is only read for chat-format prompts" in p.stdout, p.stdout


def test_check_refuses_a_prompt_length_the_chat_frame_does_not_fit(tmp_path):
    """Prompts are cut from the left: a max_prompt_length under the template's frame would cut every chat
    prompt's start (its role markers); check says so, exit 2, with the length that fits."""
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}) + "\n"
    )
    (tmp_path / "job.yaml").write_text(
        "model: {path: builtin:tiny-qwen2}\ndata: {path: chat.jsonl}\n"
        "reward: {functions: [gpufleet.rewards:answer_match]}\n"
    )
    p = run_user("check", "job.yaml", "--gpus", "cpu", "--set", "rollout.max_prompt_length=3", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert "the chat template's frame around a prompt is" in p.stdout and "line 1" in p.stdout, p.stdout
    assert "fix: --set rollout.max_prompt_length=" in p.stdout
    p = run_user("check", "job.yaml", "--gpus", "cpu", "--set", "rollout.max_prompt_length=32", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
