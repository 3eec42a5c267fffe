"""Jobs `gpufleet check` passes must not fail in `gpufleet train` (and what train would refuse, check says
first): the gaps found by varying the shipped examples' settings, each run through the installed CLI
from a user's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_user, sets

KEYS = """\
model: {path: builtin:tiny-qwen2}
env:
  name: builtin:keys
  kwargs: {doors: 3, length: 4, letters: abcdef}
  servers: 0
  max_turns: 2
  max_action_tokens: 4
  max_observation_tokens: 4
algorithm: {name: grpo, num_generations: 2}
rollout: {max_prompt_length: 8}
train: {per_device_batch: 4, learning_rate: 0.003, max_steps: 1}
output: {dir: runs/keys}
"""


def _job(tmp_path: Path, text: str) -> Path:
    (tmp_path / "job.yaml").write_text(text)
    return tmp_path


@pytest.mark.slow
def test_the_largest_seed_check_passes_trains_an_env_job(tmp_path):
    """Each turn's sampling seed grew with train.seed past what torch.Generator takes (2**64): an env job
    with a seed from about 1.8e7 on stopped with a traceback after check had passed it."""
    user = _job(tmp_path, KEYS)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("train.seed=4294967295"), cwd=user)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("train", "job.yaml", "--gpus", "cpu", *sets("train.seed=4294967295"), cwd=user, timeout=240)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert (user / "runs" / "keys" / "final").is_dir()


def test_check_refuses_a_seed_numpy_and_torch_cannot_take(tmp_path):
    user = _job(tmp_path, KEYS)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("train.seed=99999999999999999999"), cwd=user)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "train.seed" in p.stdout and "less than or equal to 4294967295" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr


DATA_JOB = """\
model: {path: builtin:tiny-qwen2}
data: {path: rows.jsonl}
reward: {functions: ["my_rewards.py:score"]}
algorithm: {name: grpo, num_generations: 2}
rollout: {max_prompt_length: 16, max_completion_length: 4}
train: {per_device_batch: 4, learning_rate: 0.003, max_steps: 1}
output: {dir: runs/data}
"""


def _data_job(tmp_path: Path, rows: list[dict], rewards: str) -> Path:
    import json

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(rewards)
    return _job(tmp_path, DATA_JOB)


def _check_then_train(user: Path) -> None:
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=user)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=user, timeout=240)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr


@pytest.mark.slow
def test_a_column_named_as_a_logging_keyword_is_not_passed_twice(tmp_path):
    """A data column named log_extra / log_metric / trainer_state went to the reward function beside the
    keyword of that name (TypeError: multiple values); the keyword wins, as TRL's trainer_state does."""
    rows = [
        {"prompt": f"p{i}", "log_extra": i, "log_metric": i, "trainer_state": i, "answer": "a"}
        for i in range(4)
    ]
    rewards = (
        "def score(completions, answer, log_extra, log_metric, trainer_state, **kwargs):\n"
        "    assert callable(log_extra) and callable(log_metric), (log_extra, log_metric)\n"
        "    assert not isinstance(trainer_state, (int, list)), trainer_state\n"
        "    assert answer == ['a'] * len(completions)\n"
        "    return [0.0] * len(completions)\n"
    )
    _check_then_train(_data_job(tmp_path, rows, rewards))


@pytest.mark.slow
def test_rows_with_different_columns_give_every_column_none_where_missing(tmp_path):
    """Rows that do not all have the same columns: the batch took its column names from its first row (a
    KeyError traceback when a later row lacked one, and a column only later rows have was missing for a
    function whose signature check had accepted it). Now every row has every column of the file, None
    where it lacks it, as `datasets` loads such a file."""
    rows = [
        {"prompt": "a", "x": 1},
        {"prompt": "b", "y": 2},
        {"prompt": "c", "x": 3, "y": 4},
        {"prompt": "d"},
    ]
    rewards = (
        "def score(completions, x, y, **kwargs):\n"
        "    assert len(x) == len(y) == len(completions), (x, y)\n"
        "    assert set(x) <= {1, 3, None} and set(y) <= {2, 4, None}, (x, y)\n"
        "    return [0.0] * len(completions)\n"
    )
    user = _data_job(tmp_path, rows, rewards)
    (user / "job.yaml").write_text(DATA_JOB.replace("per_device_batch: 4", "per_device_batch: 8"))
    _check_then_train(user)


QUICK = """\
model: {path: builtin:tiny-qwen2}
data: {path: builtin:repeat}
algorithm: {name: grpo, num_generations: 2}
rollout: {max_prompt_length: 8, max_completion_length: 4}
train: {per_device_batch: 4, learning_rate: 0.003, max_steps: 1}
output: {dir: runs/q, save_every: 1}
"""


@pytest.mark.slow
def test_resuming_a_full_run_as_lora_is_refused_in_one_line(tmp_path):
    """The saved job.yaml writes defaults as comments: a breaking field left at its default there
    (model.use_peft: false) and set now was not seen as a change, and train stopped with peft's
    traceback (no adapter_config.json in the checkpoint)."""
    user = _job(tmp_path, QUICK)
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=user, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    lora = sets("model.use_peft=true", "train.max_steps=2")
    p = run_user("train", "job.yaml", "--gpus", "cpu", *lora, cwd=user, timeout=240)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "model.use_peft: False -> True" in p.stderr and "Nothing was started" in p.stderr  # check's line


@pytest.mark.slow
def test_check_says_what_train_would_refuse_to_resume(tmp_path):
    """output.resume's checkpoint (auto: the newest in output.dir) against the job, as train checks it
    before anything starts -- without importing torch; a path that is no checkpoint is refused too."""
    import subprocess
    import sys

    user = _job(tmp_path, QUICK)
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=user, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("model.use_peft=true"), cwd=user)
    assert p.returncode == 2, p.stdout + p.stderr
    assert (
        "train would resume runs/q/checkpoints/step-1" in p.stdout
        and "model.use_peft: False -> True" in p.stdout
    )
    assert "model.use_peft = true (flag --set model.use_peft=true)" in p.stdout
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("train.per_device_batch=8"), cwd=user)
    assert p.returncode == 2 and "global batch (per_device_batch x policy ranks): 4 -> 8" in p.stdout
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("output.resume=job.yaml"), cwd=user)
    assert p.returncode == 2 and "job.yaml is not a complete checkpoint" in p.stdout, p.stdout
    code = (
        "import sys; from gpufleet.cli import main\n"
        "assert main(['check', 'job.yaml', '--gpus', 'cpu', '--set', 'train.log_every=3']) == 0\n"
        "assert 'torch' not in sys.modules\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=user, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_check_refuses_weights_train_could_not_read(tmp_path):
    """A model folder whose model.safetensors was cut short (a copy interrupted), or whose index names a
    shard that is not there: check passed it, and train's from_pretrained stopped with safetensors'
    traceback. An intact copy still passes."""
    import shutil

    from gpufleet.models.builtin import materialize

    user = _job(tmp_path, QUICK)
    good = user / "good"
    shutil.copytree(materialize("tiny-qwen2"), good)
    for name, cut in (("short", 100), ("header", None)):
        shutil.copytree(good, user / name)
        data = (good / "model.safetensors").read_bytes()
        (user / name / "model.safetensors").write_bytes(data[:-cut] if cut else data[:100])
    sharded = user / "sharded"
    shutil.copytree(good, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = (
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    )
    (sharded / "model.safetensors.index.json").write_text(index)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("model.path=./good"), cwd=user)
    assert p.returncode == 0, p.stdout + p.stderr
    for name, said in (
        ("short", "its tensors need"),
        ("header", "a header of"),
        ("sharded", "names model-00002-of-00002.safetensors, which is not in"),
    ):
        p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(f"model.path=./{name}"), cwd=user)
        assert p.returncode == 2 and said in p.stdout and "error: model.path" in p.stdout, (name, p.stdout)


def test_check_refuses_a_built_in_reward_an_env_job_cannot_feed(tmp_path):
    """A task's built-in reward in an env job: its episodes bring no data columns, so the reward's column
    (repeat/letters reads `target`) is missing; check passed it (the default data.path is that task's)
    and train stopped at the first reward call."""
    user = _job(tmp_path, KEYS)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets("reward.functions=[repeat/letters]"), cwd=user)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "built-in reward 'repeat/letters' cannot score this env job's episodes" in p.stdout
    assert "env.name = builtin:keys" in p.stdout


STRICT_TEMPLATE = (
    "{%- for m in messages %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{{ m.role[0] | upper + ':' + m.content + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'A:' }}{%- endif %}"
)


def test_check_renders_each_chat_row_as_train_will(tmp_path):
    """Chat-format rows go through the model's chat template: a row it refuses (here a template that wants
    user/assistant turns and gets two user messages) passed check, and train stopped at that row's batch."""
    import json
    import shutil

    from gpufleet.models.builtin import materialize

    user = _job(tmp_path, DATA_JOB.replace("builtin:tiny-qwen2", "./strict"))
    shutil.copytree(materialize("tiny-qwen2"), user / "strict")
    (user / "strict" / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    (user / "my_rewards.py").write_text(
        "def score(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    fine = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    for rows, code in (
        (fine, 0),
        (fine + [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]], 2),
    ):
        (user / "rows.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
        p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=user)
        assert p.returncode == code, p.stdout + p.stderr
    assert "cannot render row 4 of " in p.stdout
    assert "rows.jsonl: TemplateError: Conversation roles must alternate" in p.stdout
