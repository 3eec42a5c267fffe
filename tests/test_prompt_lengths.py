"""Prompts longer than rollout.max_prompt_length lose their start (train keeps the last tokens): `check`
names the longest prompts of a data file and the length that keeps them whole, and train says it once
at the first cut (a hub data set or an env's first observation, which check cannot read)."""

from __future__ import annotations

import json
import re

from helpers import run_user

JOB = """model: {path: builtin:tiny-qwen2}
data: {path: DATA}
rollout: {max_prompt_length: 64, max_completion_length: 8}
reward: {functions: [gpufleet.rewards:answer_match]}
algorithm: {num_generations: 4}
train: {per_device_batch: 8, max_steps: 1, log_every: 1}
output: {dir: run}
"""
WORDS = [2, 3, 40, 5, 60, 4, 2, 3]  # "abc " this many times: rows 3 and 5 are 160 and 240 tokens


def _job(folder, rows, name="data.jsonl"):
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "job.yaml").write_text(JOB.replace("DATA", name))


def _fix(stdout: str) -> int:
    return int(re.search(r"fix: --set rollout.max_prompt_length=(\d+) keeps them whole", stdout).group(1))


def test_check_names_the_longest_prompt_and_the_length_that_keeps_it_whole(tmp_path):
    _job(tmp_path, [{"prompt": "abc " * k, "answer": "x"} for k in WORDS])
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert "2 of the 8 longest prompts of data.jsonl are longer than rollout.max_prompt_length 64" in p.stdout
    assert "the longest 240 tokens (" in p.stdout and "data.jsonl line 5)" in p.stdout, p.stdout
    assert _fix(p.stdout) == 240  # one token per character (the built-in tokenizer)
    p = run_user("check", "job.yaml", "--gpus", "cpu", "--set", "rollout.max_prompt_length=240", cwd=tmp_path)
    assert p.returncode == 0 and "max_prompt_length" not in p.stdout, p.stdout
    p = run_user("check", "job.yaml", "--gpus", "cpu", "--set", "rollout.max_prompt_length=239", cwd=tmp_path)
    assert "1 prompt of data.jsonl is longer than rollout.max_prompt_length 239" in p.stdout, p.stdout


def test_check_counts_a_chat_prompt_as_the_template_renders_it(tmp_path):
    """The frame (role markers, the generation prompt) counts: the fix is the rendered prompt's length."""
    from gpufleet.models.builtin import char_tokenizer

    messages = [{"role": "system", "content": "s" * 30}, {"role": "user", "content": "u" * 50}]
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}] * 3 + [{"prompt": messages}]
    _job(tmp_path, rows, "chat.jsonl")
    tok = char_tokenizer()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    length = len(tok.encode(rendered, add_special_tokens=False))
    assert length > 80
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 prompt of chat.jsonl is longer" in p.stdout and "chat.jsonl line 4)" in p.stdout, p.stdout
    assert _fix(p.stdout) == length


def test_a_huge_prompt_is_counted_as_train_reads_it(tmp_path):
    """A 200,000-character line: train tokenises its last max(4096, 32 x max_prompt_length) characters
    (so a huge line costs what a short one does); check counts those and says the prompt is longer."""
    _job(tmp_path, [{"prompt": "x" * 200_000}, {"prompt": "abc"}])
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "the longest over 4096 tokens (" in p.stdout, p.stdout
    assert "fix: shorten those prompts: the model has 1024 positions" in p.stdout, p.stdout  # 4096 > 1016


def test_past_the_models_positions_the_fix_is_the_most_it_holds(tmp_path):
    """A 3,000-token prompt on a model of 1,024 positions: no max_prompt_length keeps it whole; the fix is
    the most the model holds beside the completions (1,024 - 8), and the context rule's fix keeps the
    completion length the user chose."""
    _job(tmp_path, [{"prompt": "y" * 3000}, {"prompt": "abc"}])
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert "the longest 3000 tokens" in p.stdout, p.stdout
    assert "fix: shorten those prompts: the model has 1024 positions" in p.stdout, p.stdout
    assert "--set rollout.max_prompt_length=1016 is the most it holds" in p.stdout, p.stdout
    p = run_user(
        "check", "job.yaml", "--gpus", "cpu", "--set", "rollout.max_prompt_length=3000", cwd=tmp_path
    )
    assert p.returncode == 2 and "fix: --set rollout.max_prompt_length=1016\n" in p.stdout, p.stdout


def test_a_folder_names_the_file_of_the_longest_prompt(tmp_path):
    (tmp_path / "data").mkdir()
    for name, k in (("a.jsonl", 3), ("b.jsonl", 50), ("c.jsonl", 4)):
        (tmp_path / "data" / name).write_text(json.dumps({"prompt": "abc " * k}) + "\n")
    (tmp_path / "job.yaml").write_text(JOB.replace("DATA", "data"))
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert "b.jsonl line 1)" in p.stdout and _fix(p.stdout) == 200, p.stdout


def test_train_says_once_that_a_prompt_is_cut_and_trains(tmp_path):
    _job(tmp_path, [{"prompt": "abc " * k, "answer": "x"} for k in WORDS])
    batch = ("--set", "train.per_device_batch=32")  # every prompt in the one step (x 4 generations)
    p = run_user("train", "job.yaml", *batch, cwd=tmp_path, env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    said = [
        x for x in p.stderr.splitlines() if x.startswith("gpufleet: warning:") and "max_prompt_length" in x
    ]
    assert len(said) == 1, p.stderr  # 2 prompts cut, said once
    assert re.search(
        r"row [35] of .*data.jsonl is (160|240) tokens, longer than rollout.max_prompt_length 64", said[0]
    )
    assert "--set rollout.max_prompt_length=" in said[0]
    (step,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert step["step"] == 1  # the cut prompts trained


def test_keep_last_keeps_the_last_tokens():
    from gpufleet.rl.batch import keep_last

    assert keep_last([1, 2, 3, 4], 2, "p") == [3, 4]
    assert keep_last([1, 2], 2, "p") == [1, 2]


def test_check_reads_the_tokenizer_from_this_machine_only(tmp_path, monkeypatch):
    """check never downloads: a hub id in the local cache is read from its snapshot folder; one that is not
    there gives no tokenizer (the model rule says what to download) and no connection is tried."""
    import shutil
    import socket

    from gpufleet.models.builtin import materialize
    from gpufleet.rules.prompts import tokenizer

    def no_network(*args, **kwargs):
        raise AssertionError("check tried the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert tokenizer("someone/not-here", env) is None
    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / "abc123"
    shutil.copytree(materialize("tiny-qwen2"), snapshot)
    tok = tokenizer("someone/tiny", env)
    assert tok is not None and tok.decode(tok.encode("abc", add_special_tokens=False)) == "abc"


def test_a_tools_job_counts_the_tools_its_first_prompt_offers(tmp_path):
    """Tools on a data set: each first prompt holds the tools the template lays out (35 tokens here), so a
    row that fits alone can be cut with them; check counts the whole first prompt, as train builds it."""
    from test_tools_dataset import _files, _job_file

    _files(tmp_path)
    _job_file(tmp_path)  # rollout.max_prompt_length 48
    with (tmp_path / "tasks.jsonl").open("a") as f:
        f.write(json.dumps({"prompt": "w" * 40, "ground_truth": "1", "level": 1}) + "\n")
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 prompt of tasks.jsonl is longer than rollout.max_prompt_length 48" in p.stdout, p.stdout
    assert _fix(p.stdout) == 35 + 40, p.stdout  # the frame (tools line, markers) + the row
