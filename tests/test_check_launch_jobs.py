"""Issue 34 section 2: what `gpufleet check` passes, `train` and `launch` run, and what both refuse.

Through the installed `gpufleet` from a user's folder (tmp_path): `train` refuses a launch job instead of
training the built-in demo into its run folder; a command's script path has one rule (the working
directory's) and one verdict from `check` and `launch`; fields a launch job never reads are warned about
by both; `check --nproc` is launch's; a job given on stdin (`-`) or through a pipe (`<(...)`) is read once,
its relative paths from the working directory.
"""

from __future__ import annotations

import subprocess

import pytest

from helpers import console_script, run_user

LAUNCH_JOB = """\
script:
  command: python train.py --lr {learning_rate}
  learning_rate: 1.0e-4
output: {dir: run}
"""

TRAIN_JOB = """\
model: {path: "builtin:tiny-qwen2"}
data: {path: prompts.jsonl}
reward: {functions: ["gpufleet.rewards:answer_match"]}
rollout: {max_prompt_length: 16, max_completion_length: 8}
train: {per_device_batch: 2, max_steps: 1}
algorithm: {num_generations: 2}
output: {dir: run}
"""

ROWS = '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'


def both(p: subprocess.CompletedProcess) -> str:
    return p.stdout + p.stderr


def line_of(out: str, start: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(start))


@pytest.fixture()
def launch_home(tmp_path):
    """tmp_path/sub holds a launch job and its script; the user stands in tmp_path."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "job.yaml").write_text(LAUNCH_JOB)
    (tmp_path / "sub" / "train.py").write_text("print('trained')\n")
    return tmp_path


# --------------------------------------------------------------------------- train of a launch job


@pytest.mark.parametrize("job", [LAUNCH_JOB, "script:\n  per_device_batch: 8\noutput: {dir: run}\n"])
def test_train_refuses_a_launch_job_and_writes_nothing(launch_home, job):
    sub = launch_home / "sub"
    (sub / "run" / "logs").mkdir(parents=True)
    (sub / "run" / "logs" / "rank0.log").write_text("the script's own log\n")
    (sub / "job.yaml").write_text(job)
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=sub, timeout=60)
    out = both(p)
    assert p.returncode == 2 and "Traceback" not in out, out
    assert "this is a launch job" in out and "Fix: gpufleet launch job.yaml" in out, out
    assert "built-in demo" in out, out
    assert sorted(x.name for x in (sub / "run").iterdir()) == ["logs"], (
        out
    )  # no final/, checkpoints/, job.yaml
    assert (sub / "run" / "logs" / "rank0.log").read_text() == "the script's own log\n"


# ------------------------------------------------------------------------------- the script's path


def test_a_missing_script_is_the_same_error_from_check_and_launch(launch_home):
    """From another folder, `python train.py` is looked for in the working directory by both verbs: exit 2,
    the same line, naming the folder and the fix (the script is beside the job file)."""
    said = []
    for args in (
        ("check", "sub/job.yaml"),
        ("launch", "sub/job.yaml"),
        ("launch", "sub/job.yaml", "--dry-run"),
    ):
        p = run_user(*args, "--gpus", "cpu", cwd=launch_home, timeout=60)
        out = both(p)
        assert p.returncode == 2 and "Traceback" not in out, (args, out)
        said.append(line_of(out, "error: script.command"))
    assert said[0] == said[1] == said[2], said
    assert f"train.py does not exist in {launch_home}, the working directory" in said[0]
    assert f"cd {launch_home / 'sub'}" in said[0] and "(sub/train.py)" in said[0]
    assert not (launch_home / "run").exists() and not (launch_home / "sub" / "run").exists()
    # from the script's folder both pass; the fix's other form (the path from here) passes too
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=launch_home / "sub", timeout=60)
    assert p.returncode == 0 and "script.command" not in both(p), both(p)
    p = run_user(
        "check",
        "sub/job.yaml",
        "--gpus",
        "cpu",
        "--set",
        "script.command=python sub/train.py",
        cwd=launch_home,
    )
    assert p.returncode == 0, both(p)
    # a what-if machine is another machine: a warning there, from both
    for verb in (("check",), ("launch", "--dry-run")):
        p = run_user(*verb, "sub/job.yaml", "--gpus", "2x24GB", cwd=launch_home, timeout=60)
        assert p.returncode == 0 and "warning: script.command" in p.stdout, both(p)


# ------------------------------------------------------------------ fields a launch job never reads


def test_fields_with_no_effect_in_a_launch_job_are_warned_by_check_and_launch(launch_home):
    sub = launch_home / "sub"
    (sub / "job.yaml").write_text(
        LAUNCH_JOB + "train: {learning_rate: 3.0e-4}\nmodel: {path: Qwen/Qwen2.5-7B}\n"
    )
    outs = []
    for args in (("check", "job.yaml"), ("launch", "job.yaml", "--dry-run")):
        p = run_user(*args, "--gpus", "cpu", "--nproc", "2", cwd=sub, timeout=60)
        assert p.returncode == 0, both(p)
        outs.append(p.stdout)
        lr = line_of(p.stdout, "warning: train.learning_rate = 0.0003 (job.yaml:5)")
        assert "has no effect in a launch job" in lr and "Fix: remove it and set script.learning_rate" in lr
        assert "warning: model.path = Qwen/Qwen2.5-7B (job.yaml:6)" in p.stdout
        assert "2 processes per node" in p.stdout  # check --nproc is launch's
    assert outs[0] == outs[1]
    (sub / "job.yaml").write_text(LAUNCH_JOB)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=sub, timeout=60)
    assert p.returncode == 0 and "warning" not in both(p), both(p)


def test_check_nproc_on_a_trainer_job(tmp_path):
    (tmp_path / "job.yaml").write_text(TRAIN_JOB)
    (tmp_path / "prompts.jsonl").write_text(ROWS)
    p = run_user("check", "job.yaml", "--gpus", "cpu", "--nproc", "2", cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and "2 policy ranks" in p.stdout, both(p)


# ------------------------------------------------------------------------------- stdin and pipes


def piped(*args: str, cwd, stdin: str | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [console_script(), *args], input=stdin, capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def test_a_job_on_stdin_and_through_a_pipe(tmp_path):
    """`gpufleet check -` and `gpufleet check <(envsubst < job.yaml)`: read (once: check of a launch job
    loads it twice), relative paths from the working directory; every line cites the stream."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job.yaml").write_text(TRAIN_JOB)
    (tmp_path / "prompts.jsonl").write_text(ROWS)  # beside the user, not beside the job file
    p = piped("check", "-", "--gpus", "cpu", cwd=tmp_path, stdin=TRAIN_JOB)
    assert p.returncode == 0 and "ok: no problems found." in p.stdout, both(p)
    p = piped("config", "-", cwd=tmp_path, stdin=TRAIN_JOB)
    assert f"{tmp_path / 'prompts.jsonl'}" in p.stdout and "<stdin>:2" in p.stdout, both(p)
    bash = f"{console_script()} check <(cat {tmp_path / 'jobs' / 'job.yaml'}) --gpus cpu"
    p = subprocess.run(["bash", "-c", bash], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and "ok: no problems found." in p.stdout, both(p)
    # the same job from another folder: data.path is that folder's, said with the pipe's line
    p = subprocess.run(
        ["bash", "-c", bash], capture_output=True, text=True, cwd=tmp_path / "jobs", timeout=60
    )
    assert p.returncode == 2 and f"{tmp_path / 'jobs' / 'prompts.jsonl'} does not exist" in p.stdout, both(p)
    assert "(/dev/fd/" in p.stdout, p.stdout
    # a launch job through a pipe: check reads it twice, the pipe once
    (tmp_path / "train.py").write_text("print('x')\n")
    (tmp_path / "jobs" / "launch.yaml").write_text(LAUNCH_JOB)
    bash = f"{console_script()} check <(cat jobs/launch.yaml) --gpus cpu"
    p = subprocess.run(["bash", "-c", bash], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and "gpufleet launch: python train.py --lr 0.0001" in p.stdout, both(p)
    p = piped("check", "-", "--gpus", "cpu", cwd=tmp_path, stdin=LAUNCH_JOB)
    assert p.returncode == 0 and "gpufleet launch: python train.py" in p.stdout, both(p)


@pytest.mark.parametrize(
    "stdin, must",
    [
        ("", "job file '<stdin>' is empty"),
        ("#" + "x" * (2 << 20) + "\n", "job file '<stdin>' is over 1 MiB"),
        ("train: {seed: 1}\ntrain: {seed: 2}\n", "<stdin>:2: `train:` appears twice"),
        ("model: {path: [}\n", "<stdin>:1:"),
    ],
    ids=["empty", "over-1MiB", "duplicate", "bad-yaml"],
)
def test_a_bad_job_on_stdin_is_one_line(tmp_path, stdin, must):
    p = piped("check", "-", "--gpus", "cpu", cwd=tmp_path, stdin=stdin)
    assert p.returncode == 2 and "Traceback" not in both(p) and must in p.stderr, both(p)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow
def test_train_from_stdin_records_the_job_in_the_run_folder(tmp_path):
    (tmp_path / "prompts.jsonl").write_text(ROWS)
    p = piped("train", "-", "--gpus", "cpu", cwd=tmp_path, stdin=TRAIN_JOB, timeout=300)
    assert p.returncode == 0 and "done:" in p.stdout, both(p)
    recorded = (tmp_path / "run" / "job.yaml").read_text()
    assert recorded.startswith("# resolved by gpufleet config from <stdin>"), recorded
    assert f"path: {tmp_path / 'prompts.jsonl'}  # <stdin>:2" in recorded, recorded  # runs from anywhere
