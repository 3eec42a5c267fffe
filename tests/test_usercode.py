"""gpufleet.usercode: where the user's `module:function` / `file.py:function` are found and loaded, and the
job file's folder as the place its relative paths and modules are looked for (issue 17 item 1)."""

import os
import sys

import pytest

from gpufleet import usercode
from gpufleet.errors import UserError
from helpers import run_user, sets

REWARD = "def reverse_match(prompts, completions, **kw):\n    return [float(c == p[::-1]) for p, c in zip(prompts, completions)]\n"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_file_references_are_anchored_to_the_base_folder(tmp_path):
    assert usercode.anchored("rewards/r.py:f", tmp_path) == f"{tmp_path / 'rewards' / 'r.py'}:f"
    assert usercode.anchored("pkg.mod:f", tmp_path) == "pkg.mod:f"


def test_load_by_file_path_with_sibling_imports(tmp_path):
    write(tmp_path / "r" / "helper_mod_abc.py", "K = 3\n")
    f = write(
        tmp_path / "r" / "main_rw.py",
        "from helper_mod_abc import K\ndef f(prompts, completions, **kw):\n    return [K]\n",
    )
    assert usercode.import_function(f"{f}:f", folders=[])([], []) == [3]


def test_a_module_in_a_given_folder_and_did_you_mean(tmp_path):
    write(tmp_path / "rw_typo_mod.py", REWARD)
    assert usercode.import_function("rw_typo_mod:reverse_match", folders=[str(tmp_path)])
    with pytest.raises(UserError) as e:
        usercode.import_function("rw_typo_mod:reverse_mach", folders=[str(tmp_path)])
    assert "did you mean rw_typo_mod:reverse_match?" in str(e.value)
    sys.modules.pop("rw_typo_mod", None)


def test_a_path_given_where_a_module_is_expected_says_which_form(tmp_path):
    with pytest.raises(UserError) as e:
        usercode.import_function("rewards.my-file:f", folders=[str(tmp_path)])
    assert "path/to/file.py:f" in str(e.value) and "__path__" not in str(e.value)


def test_error_at_import_points_at_the_users_line(tmp_path):
    f = write(tmp_path / "raises_at_import.py", "import os\nvalue = undefined_name\n")
    with pytest.raises(UserError) as e:
        usercode.import_function(f"{f}:f", folders=[])
    assert "NameError" in str(e.value) and f"{f}:2" in str(e.value)


def test_pythonpath_puts_the_roots_first_once():
    assert usercode.pythonpath(["/a", "/b"], {"PYTHONPATH": "/b:/c"}) == os.pathsep.join(["/a", "/b", "/c"])


JOB = """model:
  path: builtin:tiny-qwen2
data:
  path: prompts.jsonl
reward:
  functions: [my_rewards:reverse_match, rewards/extra.py:reverse_match]
train:
  per_device_batch: 8
  max_steps: 1
algorithm:
  num_generations: 4
rollout:
  max_completion_length: 4
"""


def project(tmp_path):
    """A user's project: job, data and rewards in one folder; commands run from a sibling folder."""
    proj = tmp_path / "proj"
    write(proj / "job.yaml", JOB)
    write(proj / "prompts.jsonl", "".join(f'{{"prompt": "ab{i}"}}\n' for i in range(8)))
    write(proj / "my_rewards.py", REWARD)
    write(proj / "rewards" / "extra.py", REWARD)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return proj, elsewhere


def test_check_finds_modules_and_data_next_to_the_job_from_another_folder(tmp_path):
    proj, elsewhere = project(tmp_path)
    p = run_user("check", "../proj/job.yaml", "--gpus", "cpu", cwd=elsewhere)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("config", "../proj/job.yaml", "--format", "json", cwd=elsewhere)
    assert str(proj / "prompts.jsonl") in p.stdout and str(proj / "rewards" / "extra.py") in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_train_imports_the_users_rewards_on_every_rank(tmp_path, nproc):
    proj, elsewhere = project(tmp_path)
    extra = sets(f"launch.nproc_per_node={nproc}", f"train.per_device_batch={8 // nproc}", "output.dir=run")
    p = run_user("train", "../proj/job.yaml", "--gpus", "cpu", *extra, cwd=elsewhere, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "done: reward" in p.stdout and (elsewhere / "run" / "final").is_dir()
