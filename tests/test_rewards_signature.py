"""Reward functions are called as TRL 1.16's GRPOTrainer calls them: every argument by keyword,
`fn(prompts=, completions=, completion_ids=, **columns)` (`usercode.call_reward`), and `gpufleet check`
and `gpufleet train` bind them to the data's columns with the same function (`usercode.import_function`
with `usercode.reward_columns`). An unreadable data file is one error on data.path, not a second,
false one on reward.functions.

The end-to-end cases run the installed `gpufleet` from a user's folder with the user's own reward file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpufleet import usercode
from gpufleet.errors import UserError
from gpufleet.rl.rewardlog import RewardLog
from gpufleet.rl.rewards import _call_checked
from helpers import console_script, run_user

# (id, source of `f`, the data's columns, None when check accepts it / a text of its error)
SIGNATURES = [
    ("trl-docs-reward-len", "def f(completions, **kwargs):\n    return [1.0] * len(completions)", ["target"], None),
    ("column-after-completions", "def f(completions, target, **kwargs):\n    return [1.0] * len(target)", ["target"], None),
    ("column-with-prompts", "def f(prompts, completions, target, **kwargs):\n    return [1.0] * len(target)", ["target"], None),
    ("completion-ids", "def f(prompts, completions, completion_ids, **kwargs):\n    return [float(len(i)) for i in completion_ids]", [], None),
    ("keyword-only", "def f(*, completions, target, **kwargs):\n    return [1.0] * len(completions)", ["target"], None),
    ("all-named-no-kwargs", "def f(prompts, completions, completion_ids, target):\n    return [1.0] * len(completions)", ["target"], None),
    ("kwargs-only", "def f(**kwargs):\n    return [1.0] * len(kwargs['completions'])", ["target"], None),
    ("defaulted-column", "def f(completions, answer=None, **kwargs):\n    return [1.0] * len(completions)", ["target"], None),
    ("async", "async def f(completions, **kwargs):\n    return [1.0] * len(completions)", [], None),
    (
        "missing-column",
        "def f(prompts, completions, target, **kwargs):\n    return []",
        ["answer"],
        "f(prompts, completions, target, **kwargs) needs the argument 'target', which is not a column of the "
        "data (its columns: answer)",
    ),
    (
        "no-kwargs",
        "def f(prompts, completions):\n    return []",
        ["target"],
        "has no parameter for 'completion_ids', 'target'",
    ),
    ("positional-only", "def f(prompts, completions, /, **kwargs):\n    return []", [], "positional-only"),
    ("trl-trainer-state", "def f(completions, trainer_state, log_metric, **kwargs):\n    log_metric('x', 1.0)\n    return [float(trainer_state.global_step)] * len(completions)", [], None),
    ("trl-state-no-kwargs", "def f(prompts, completions, completion_ids, trainer_state):\n    return [float(trainer_state.max_steps)] * len(completions)", [], None),
    ("trl-environments", "def f(completions, environments, **kwargs):\n    return []", [], "TRL's 'environments', which gpufleet does not pass"),
]  # fmt: skip


def _reward_file(tmp_path: Path, source: str) -> str:
    path = tmp_path / "sig_rewards.py"
    path.write_text(source + "\n")
    return f"{path}:f"


@pytest.mark.parametrize("case", SIGNATURES, ids=[c[0] for c in SIGNATURES])
def test_check_refuses_exactly_what_the_keyword_call_cannot_take(tmp_path, case):
    """Accepted signatures take the call with the data's columns; refused ones fail it with a TypeError,
    and the refusal is one line naming the function, the parameter and the fix."""
    _, source, columns, error = case
    ref = _reward_file(tmp_path, source)
    n = 2
    values = {c: [c] * n for c in columns}
    if error is None:
        fn = usercode.import_function(ref, columns, folders=[])
        log = RewardLog(3, 10)  # TRL's trainer_state, log_metric, log_extra: given to what takes them
        out = usercode.call_reward(fn, ["p"] * n, ["c"] * n, [[1, 2], [3]], values, log.keywords())
        assert len(out) == n
        return
    with pytest.raises(usercode.RewardImportError) as e:
        usercode.import_function(ref, columns, folders=[])
    text = str(e.value)
    assert error in text and f"reward function {ref!r}" in text and "\n" not in e.value.why
    assert e.value.fix  # the fix is given
    fn = usercode.import_object(ref, folders=[])
    with pytest.raises(TypeError):
        usercode.call_reward(fn, ["p"] * n, ["c"] * n, [[1, 2], [3]], values)


def test_unknown_columns_refuse_only_what_no_column_can_fill(tmp_path):
    """The data could not be read (columns None): a parameter a column might fill is not refused, a
    function without **kwargs that cannot take completion_ids still is."""
    ok = _reward_file(tmp_path, "def f(prompts, completions, target, **kwargs):\n    return []")
    usercode.import_function(ok, None, folders=[])
    (tmp_path / "sig2.py").write_text("def f(prompts, completions):\n    return []\n")
    with pytest.raises(usercode.RewardImportError, match="'completion_ids'"):
        usercode.import_function(f"{tmp_path / 'sig2.py'}:f", None, folders=[])


def test_reward_columns_leave_out_the_prompt_and_the_passed_keywords():
    names = ["question", "prompt", "target", "completion", "completions", "completion_ids", "prompts", "id"]
    assert usercode.reward_columns(names, "question") == ["target", "id"]


def test_the_trainer_calls_by_keyword_with_columns_and_token_ids():
    seen = {}

    def match_target(completions, target, **kwargs):  # TRL's docs' shape: no `prompts` parameter
        seen.update(kwargs, target=target)
        return [float(c == t) for c, t in zip(completions, target, strict=True)]

    out = _call_checked(
        match_target,
        "match_target",
        ["a:", "b:"],
        ["aa", "bx"],
        {"target": ["aa", "bb"]},
        None,
        [[5, 5, 1], [6]],
    )
    assert out == [1.0, 0.0]
    assert seen == {"prompts": ["a:", "b:"], "completion_ids": [[5, 5, 1], [6]], "target": ["aa", "bb"]}


def test_an_async_reward_is_awaited():
    async def later(completions, **kwargs):
        return [0.5] * len(completions)

    assert _call_checked(later, "later", ["p"], ["c"], {}) == [0.5]


def test_a_failing_keyword_reward_names_its_first_bad_sample():
    def picky(completions, target, **kwargs):
        return [1.0 / (t != "zero") for t in target]

    with pytest.raises(UserError, match=r"picky raised ZeroDivisionError.*sample 1 \(prompt 'q'"):
        _call_checked(picky, "picky", ["p", "q"], ["a", "b"], {"target": ["one", "zero"]})


# ------------------------------------------------------------------------- the installed command

JOB = """\
model: {path: "builtin:tiny-qwen2"}
data: {path: data.jsonl}
reward: {functions: ["my_rewards.py:match_target", "my_rewards:reward_len", "my_rewards:token_count"]}
rollout: {max_prompt_length: 16, max_completion_length: 6}
train: {per_device_batch: 4, max_steps: 1}
algorithm: {num_generations: 2}
output: {dir: run}
"""

REWARDS = """\
import json


def match_target(prompts, completions, target, **kwargs):
    with open("seen.json", "w") as f:
        json.dump({"keys": sorted(kwargs), "target": target, "ids": kwargs["completion_ids"]}, f)
    return [float(c == t) for c, t in zip(completions, target)]


def reward_len(completions, **kwargs):
    return [-abs(5 - len(c)) / 5 for c in completions]


def token_count(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
"""

ROWS = "".join(
    json.dumps({"prompt": p, "target": p[0] * 3, "level": i}) + "\n" for i, p in enumerate(["a:", "b:"])
)


@pytest.fixture()
def home(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "data.jsonl").write_text(ROWS)
    return tmp_path


def test_check_and_train_take_trl_reward_signatures(home):
    """A column argument (`target`) and TRL's `reward_len(completions, **kwargs)`: check and train agree,
    and the function gets the columns and completion_ids by keyword."""
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=home, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=home, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    seen = json.loads((home / "seen.json").read_text())
    assert seen["keys"] == ["completion_ids", "level", "log_extra", "log_metric", "trainer_state"]  # TRL's
    assert set(seen["target"]) <= {"aaa", "bbb"} and len(seen["target"]) == 4
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in seen["ids"])
    metrics = [json.loads(x) for x in (home / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(
        m["rewards/token_count/mean"] >= 1 for m in metrics if "rewards/token_count/mean" in m
    )


def test_train_refuses_what_check_refuses(home):
    """The same one-line error from check and from train when a column the function needs is missing."""
    (home / "data.jsonl").write_text('{"prompt": "a:", "answer": "aaa"}\n{"prompt": "b:", "answer": "bbb"}\n')
    outs = []
    for verb in ("check", "train"):
        p = run_user(verb, "job.yaml", "--gpus", "cpu", cwd=home, timeout=300)
        assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
        outs.append(p.stdout + p.stderr)
    why = "needs the argument 'target', which is not a column of the data (its columns: answer)"
    assert all(why in out for out in outs), outs


def test_a_builtin_reward_on_data_without_its_column_is_refused_before_training(home):
    """A built-in task's reward reads the task's `target` column: on data without it, check says so
    (check used to pass, and train failed at its first reward call), and train stops before step 1."""
    (home / "data.jsonl").write_text('{"prompt": "a:", "answer": "aaa"}\n{"prompt": "b:", "answer": "bbb"}\n')
    flags = ["--set", "reward.functions=[repeat/letters, my_rewards:reward_len]"]
    for verb in ("check", "train"):
        p = run_user(verb, "job.yaml", "--gpus", "cpu", *flags, cwd=home, timeout=300)
        out = p.stdout + p.stderr
        assert p.returncode == 2 and "Traceback" not in out, out
        assert "built-in reward 'repeat/letters' cannot score this data" in out, out
        assert "needs the dataset column 'target', got columns ['answer']" in out, out
    assert not (home / "run" / "metrics.jsonl").exists()
    p = run_user("check", "job.yaml", "--gpus", "cpu", "--set", "data.path=builtin:repeat", *flags, cwd=home)
    assert p.returncode == 0, p.stdout + p.stderr  # its own task's data has the column


IS_ROOT = os.geteuid() == 0


def _as_user(argv: list[str]) -> list[str]:
    """Without root's right to read everything, so permission bits count as for a user."""
    return (
        ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", *argv]
        if IS_ROOT
        else argv
    )


@pytest.mark.parametrize("broken", ["unreadable", "malformed"])
def test_unreadable_data_is_one_error_not_a_false_reward_error(home, broken):
    import subprocess

    data = home / "data.jsonl"
    if broken == "unreadable":
        data.chmod(0)
    else:
        data.write_text('{"prompt": "a:", "target": "aaa"}\n{not json\n')
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env.pop("PYTHONPATH", None)
    p = subprocess.run(
        _as_user([console_script(), "check", "job.yaml", "--gpus", "cpu"]),
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: data.path"), out
    assert "reward.functions" not in out, out
    assert ("permission denied" in out and "chmod" in out) if broken == "unreadable" else "line 2" in out, out


def test_reward_values_are_read_as_trl_reads_them():
    """TRL makes a float32 tensor of a function's list: numbers, numpy scalars, 0-d tensors and bools
    (True -> 1.0); None is NaN (unscored); what is not a finite real number is refused (None here)."""
    import math

    import numpy as np
    import torch

    from gpufleet.rl.rewards import _real

    assert [
        _real(v) for v in (True, False, np.bool_(True), np.float32(0.5), np.int64(3), torch.tensor(2.0))
    ] == [
        1.0,
        0.0,
        1.0,
        0.5,
        3.0,
        2.0,
    ]
    assert math.isnan(_real(None))
    assert [_real(v) for v in ("1", float("inf"), [1.0], math.nan)] == [None, None, None, None]
