"""Issue 18: faults and hostile inputs never hang, never blow up memory, never exit silently.

Each case builds a user's folder (job, data, rewards) with one thing wrong in it: a FIFO, /dev/zero, a
symlink loop, a job file with a tab, a reward module that exits or never returns, a read-only disk...
and runs the installed `gpufleet` from there, under a timeout and a 4 GiB address-space cap. The answer
must be one line that says what is really wrong (exit 2, no traceback), or a run that simply works.
"""

from __future__ import annotations

import gzip
import json
import os
import resource
import subprocess
from pathlib import Path

import pytest

from helpers import console_script, sets

JOB = """\
model: {path: "builtin:tiny-qwen2"}
data: {path: prompts.jsonl}
reward: {functions: ["my_rewards:length"]}
rollout: {max_prompt_length: 16, max_completion_length: 8}
train: {per_device_batch: 4, max_steps: 1, samples_every: 0}
algorithm: {num_generations: 2}
output: {dir: run}
"""
REWARDS = "def length(prompts, completions, **columns):\n    return [float(len(c)) for c in completions]\n"
ROWS = '{"prompt": "ab", "answer": "1"}\n{"prompt": "cd", "answer": "2"}\n'
CAP = 4 << 30
IS_ROOT = os.geteuid() == 0


def _cap():
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def gpufleet(home: Path, *args: str, env: dict | None = None, timeout: int = 60, as_user: bool = False):
    """The installed console script in `home`, capped at 4 GiB; `as_user`: without root's right to
    read and write everything (so permission bits count, as for a user)."""
    e = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    e.pop("PYTHONPATH", None)
    e.update(env or {})
    cmd = [console_script(), *args]
    if as_user and IS_ROOT:
        cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    p = subprocess.run(cmd, cwd=home, env=e, capture_output=True, text=True, timeout=timeout, preexec_fn=_cap)
    return p.returncode, p.stdout + p.stderr


def one_clean_error(code: int, out: str, *must: str) -> str:
    """Exit 2, no traceback, and the texts in the one problem reported; returns that problem's text."""
    assert code == 2, out
    assert "Traceback" not in out, out
    problems = [line for line in out.splitlines() if line.startswith(("error:", "gpufleet: error:"))]
    assert len(problems) == 1, out
    for text in must:
        assert text in out, f"{text!r} not in:\n{out}"
    return problems[0]


@pytest.fixture()
def home(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "prompts.jsonl").write_text(ROWS)
    return tmp_path


def mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {p.stderr.decode().strip()}")


# ---------------------------------------------------------------------------------- data paths


def _fifo(h):
    os.mkfifo(h / "d.jsonl")


def _loop(h):
    os.symlink("e.jsonl", h / "d.jsonl")
    os.symlink("d.jsonl", h / "e.jsonl")


def _gz_named_plain(h):
    (h / "d.jsonl").write_bytes(gzip.compress(ROWS.encode()))


# (id, make the data in the folder, data.path, texts of the one error)
DATA_FAULTS = [
    ("dev-zero", None, "/dev/zero", ["/dev/zero is a device"]),
    ("dev-zero-link", lambda h: os.symlink("/dev/zero", h / "d.jsonl"), "d.jsonl", ["is a device"]),
    ("fifo", _fifo, "d.jsonl", ["d.jsonl is a named pipe (FIFO)"]),
    (
        "folder-named-as-file",
        lambda h: (h / "d.jsonl").mkdir(),
        "d.jsonl",
        ["d.jsonl is a folder with no data files"],
    ),
    ("symlink-loop", _loop, "d.jsonl", ["symbolic link loop"]),
    ("dangling-link", lambda h: os.symlink("gone.jsonl", h / "d.jsonl"), "d.jsonl", ["link to gone.jsonl"]),
    ("gzip-named-plain", _gz_named_plain, "d.jsonl", ["gz-compressed", "rename it to d.jsonl.gz"]),
    ("plain-named-gzip", lambda h: (h / "d.jsonl.gz").write_text(ROWS), "d.jsonl.gz", ["not gz-compressed"]),
    ("zstd", lambda h: (h / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd"), "d.jsonl.zst", ["zstd"]),
    (
        "deep-json",
        lambda h: (h / "d.jsonl").write_text('{"a": ' + "[" * 100_000 + "\n"),
        "d.jsonl",
        ["line 1", "nested"],
    ),
    (
        "huge-integer",
        lambda h: (h / "d.jsonl").write_text('{"prompt": "a", "n": ' + "9" * 5000 + "}\n"),
        "d.jsonl",
        ["line 1 is not readable JSON"],
    ),
    (
        "token-id-prompts",
        lambda h: (h / "d.jsonl").write_text('{"prompt": [3, 4, 5]}\n'),
        "d.jsonl",
        ["line 1", "token ids", "as text"],
    ),
]


@pytest.mark.parametrize("make, path, must", [c[1:] for c in DATA_FAULTS], ids=[c[0] for c in DATA_FAULTS])
def test_a_data_path_that_is_not_a_data_file(home, make, path, must):
    if make is not None:
        make(home)
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets(f"data.path={path}"), timeout=30)
    one_clean_error(code, out, "data.path", *must)


def test_a_folder_of_data_files(home):
    from gpufleet import datafile

    (home / "data").mkdir()
    (home / "data" / "a.jsonl").write_text(ROWS)
    (home / "data" / "b.csv.gz").write_bytes(gzip.compress(b"prompt,answer\nef,3\n"))
    (home / "data" / "README.md").write_text("# not data\n")
    found = datafile.scan(home / "data", "prompt", keep=True)
    assert [found[i]["prompt"] for i in range(len(found))] == ["ab", "cd", "ef"]
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets("data.path=data"))
    assert code == 0 and "ok: no problems found" in out, out
    (home / "data" / "c.jsonl").write_text('{"prompt": ""}\n')
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets("data.path=data"))
    one_clean_error(code, out, "c.jsonl line 1", "an empty string")


def test_an_unreadable_data_file(home):
    (home / "prompts.jsonl").chmod(0)
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", as_user=True)
    one_clean_error(code, out, "prompts.jsonl cannot be read: permission denied", "chmod a+r")


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_compressed_data_is_read(home, suffix):
    import bz2
    import lzma

    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[suffix]
    (home / f"d.csv{suffix}").write_bytes(compress(b"prompt,answer\nab,1\ncd,2\n"))
    (home / f"d.jsonl{suffix}").write_bytes(compress(b'{"prompt": "ab"}\n{"prompt": ""}\n'))
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets(f"data.path=d.csv{suffix}"))
    assert code == 0 and "ok: no problems found" in out, out
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets(f"data.path=d.jsonl{suffix}"))
    one_clean_error(code, out, f"d.jsonl{suffix} line 2", "an empty string")  # parsed, row by row


def _sparse_config(h):
    (h / "m").mkdir()
    with open(h / "m" / "config.json", "wb") as f:
        f.truncate(10 << 30)  # 10 GiB of holes: reading it would take the memory cap


MODEL_FAULTS = [
    ("dev-zero", None, "/dev/zero", ["model.path"]),
    ("fifo", lambda h: os.mkfifo(h / "m"), "./m", ["model.path"]),
    ("huge-config", _sparse_config, "./m", ["config.json is 10240 MiB (at most 64 MiB)"]),
    ("no-such-user", None, "~nosuchuser0", ["'~nosuchuser0' is neither a local folder"]),  # pathlib raised
]


@pytest.mark.parametrize("make, path, must", [c[1:] for c in MODEL_FAULTS], ids=[c[0] for c in MODEL_FAULTS])
def test_a_model_path_that_is_not_a_model_folder(home, make, path, must):
    if make is not None:
        make(home)
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets(f"model.path={path}"), timeout=30)
    assert code == 2 and "Traceback" not in out and "error: model.path" in out, out
    for text in must:
        assert text in out, out


# ------------------------------------------------------------------------------------ job files


def _job_edit(old: str, new: str):
    return lambda h: (h / "job.yaml").write_text(JOB.replace(old, new))


# (id, change the folder, extra args, env, texts of the one error)
JOB_FAULTS = [
    (
        "duplicate-section",
        lambda h: (h / "job.yaml").write_text(JOB + "train: {seed: 3}\n"),
        [],
        {},
        ["lines 5 and 8"],
    ),
    (
        "tab-indent",
        lambda h: (h / "job.yaml").write_text(JOB + "env:\n\tname: x\n"),
        [],
        {},
        ["tab", "use spaces"],
    ),
    (
        "huge-job-file",
        lambda h: (h / "job.yaml").write_text(JOB + "#" + "x" * (3 << 20) + "\n"),
        [],
        {},
        ["3.0 MiB; a job file is at most 1 MiB"],
    ),
    ("inf-flag", None, sets("train.learning_rate=inf"), {}, ["train.learning_rate", "finite"]),
    (
        "nan-env",
        None,
        [],
        {"GPUFLEET_TRAIN__LEARNING_RATE": "nan"},
        ["GPUFLEET_TRAIN__LEARNING_RATE", "finite"],
    ),
    (
        "inf-file",
        _job_edit("max_steps: 1", "max_steps: 1, learning_rate: .inf"),
        [],
        {},
        ["job.yaml:5", "finite"],
    ),
    ("overflow-file", _job_edit("max_steps: 1", "max_steps: 1, max_grad_norm: 1e999"), [], {}, ["finite"]),
    ("nan-temperature", None, sets("rollout.temperature=NaN"), {}, ["rollout.temperature", "finite"]),
]


@pytest.mark.parametrize("make, args, env, must", [c[1:] for c in JOB_FAULTS], ids=[c[0] for c in JOB_FAULTS])
def test_a_bad_job_file_or_value(home, make, args, env, must):
    if make is not None:
        make(home)
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *args, env=env)
    one_clean_error(code, out, *must)


@pytest.mark.parametrize("verb", ["check", "plan", "train"])
def test_a_bad_plan_overhead_names_the_variable_first(home, verb):
    code, out = gpufleet(home, verb, "job.yaml", "--gpus", "cpu", env={"GPUFLEET_PLAN_OVERHEAD": "banana"})
    problem = one_clean_error(code, out, "'banana'")
    assert (
        problem.split(":", 2)[1 if problem.startswith("error:") else 2]
        .strip()
        .startswith("GPUFLEET_PLAN_OVERHEAD")
    ), problem


# ---------------------------------------------------------------------------------- user's code

REWARD_MODULES = [
    ("sys-exit-at-import", "import sys\nsys.exit(3)\n", ["my_rewards", "sys.exit(3)", "my_rewards.py:2"]),
    ("missing-package", "import not_a_package_xyz\n" + REWARDS, ["No module named 'not_a_package_xyz'"]),
    ("import-never-ends", "while True:\n    pass\n", ["did not finish within 2 s", "my_rewards.py:"]),
]


@pytest.mark.parametrize("module, must", [c[1:] for c in REWARD_MODULES], ids=[c[0] for c in REWARD_MODULES])
def test_a_reward_module_that_misbehaves_at_import(home, module, must):
    (home / "my_rewards.py").write_text(module)
    for verb in ("check", "train"):
        code, out = gpufleet(home, verb, "job.yaml", "--gpus", "cpu", *sets("reward.timeout=2"), timeout=60)
        one_clean_error(code, out, "reward.functions", *must)


# ------------------------------------------------------------------------------- where it writes


def test_output_dir_on_a_read_only_file_system(home):
    mount_tmpfs(home / "ro", "size=1m,ro")
    try:
        code, out = gpufleet(
            home, "check", "job.yaml", "--gpus", "cpu", *sets(f"output.dir={home / 'ro' / 'run'}")
        )
    finally:
        subprocess.run(["umount", "-l", str(home / "ro")], check=False)
    one_clean_error(code, out, "output.dir", "read-only file system")


def test_output_dir_this_user_may_not_write(home):
    (home / "theirs").mkdir(mode=0o555)
    if IS_ROOT:
        os.chown(home / "theirs", 65534, 65534)
    code, out = gpufleet(
        home, "check", "job.yaml", "--gpus", "cpu", *sets("output.dir=theirs/run"), as_user=True
    )
    one_clean_error(code, out, "output.dir", "may not write in", "theirs")


def test_output_dir_under_a_file(home):
    (home / "afile").write_text("x")
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets("output.dir=afile/run"))
    one_clean_error(code, out, "output.dir", "afile is a file")


def test_a_cache_that_is_a_file(home):
    (home / "cache").write_text("not a folder")
    for verb in ("check", "train"):
        code, out = gpufleet(
            home, verb, "job.yaml", "--gpus", "cpu", env={"GPUFLEET_CACHE": str(home / "cache")}
        )
        one_clean_error(code, out, "GPUFLEET_CACHE", "is a file")


def test_check_warns_when_the_disk_cannot_hold_the_checkpoints(home):
    mount_tmpfs(home / "small", "size=600k")
    try:
        code, out = gpufleet(
            home, "check", "job.yaml", "--gpus", "cpu", *sets(f"output.dir={home / 'small' / 'run'}")
        )
    finally:
        subprocess.run(["umount", "-l", str(home / "small")], check=False)
    assert code == 0 and "warning: output.dir" in out and "MiB free" in out and "need about" in out, out


def test_a_disk_that_is_full_before_training_starts(home):
    disk = home / "full"
    mount_tmpfs(disk, "size=400k")
    try:
        _fill(disk)
        code, out = gpufleet(home, "train", "job.yaml", "--gpus", "cpu", *sets(f"output.dir={disk / 'run'}"))
        left = sorted(p.name for p in (disk / "run").iterdir()) if (disk / "run").exists() else []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    problem = one_clean_error(code, out, f"no space left on {disk} writing {disk / 'run'}")
    assert "MiB free" in problem and "run the same command again" in problem
    assert left == [], left  # no half-written file stays on the full disk


def _fill(disk: Path) -> None:
    """Write until the file system says it is full."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


# --------------------------------------------------------------------------------------- training

ODD_ROWS = [
    "café — naïve",
    "emoji 🎉 and a NUL \x00 here",
    "ab" * 300_000,  # a 600 kB prompt: cut by characters before it is tokenised
    "plain",
]
NUMPY_REWARDS = """\
import numpy as np
import torch

def length(prompts, completions, **columns):
    out = [np.float32(len(c)) if i % 2 else torch.tensor(float(len(c))) for i, c in enumerate(completions)]
    out[0] = np.int64(3)
    out[1], out[2] = True, np.bool_(False)  # TRL's float32 tensor of them: 1.0, 0.0
    return out
"""


def test_any_text_trains_and_numpy_and_tensor_rewards_count(home):
    (home / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ODD_ROWS))
    (home / "my_rewards.py").write_text(NUMPY_REWARDS)
    # one step of 4 prompts x 2: every row above is tokenised and scored
    code, out = gpufleet(
        home, "train", "job.yaml", "--gpus", "cpu", *sets("train.per_device_batch=8"), timeout=300
    )
    assert code == 0 and "Traceback" not in out, out
    metrics = [json.loads(x) for x in (home / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and metrics[0]["reward"] > 0, metrics


@pytest.mark.slow  # end to end (~10 s); make test-slow runs it
def test_a_reward_that_never_returns_times_out(home):
    (home / "my_rewards.py").write_text(
        "import time\n\ndef length(prompts, completions, **columns):\n"
        "    for c in completions:\n        time.sleep(10**6)\n"
    )
    code, out = gpufleet(home, "train", "job.yaml", "--gpus", "cpu", *sets("reward.timeout=2"), timeout=300)
    problem = one_clean_error(code, out, "reward function length did not return within 2 s", "reward.timeout")
    assert "on sample 0 (prompt" in problem and "my_rewards.py:5" in problem, problem
    assert not (home / "run" / "final").exists()


def test_file_system_faults_become_one_line(tmp_path):
    import errno

    from gpufleet.fsfaults import fault_error

    ro = fault_error(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "run" / "m.jsonl")))
    assert ro is not None and "the file system is read-only" in str(ro) and "m.jsonl" in str(ro)

    def write_fails(target: Path):
        with target.open("w") as f:
            f.write("{}")
            raise OSError(errno.ENOSPC, "No space left on device")  # as a flush would: no file name

    try:
        write_fails(tmp_path / "metrics.jsonl")
    except OSError as e:
        full = fault_error(e)
    assert full is not None and f"writing {tmp_path / 'metrics.jsonl'}" in str(full), full
    assert fault_error(BrokenPipeError(errno.EPIPE, "Broken pipe")) is None
    assert fault_error(FileNotFoundError(errno.ENOENT, "No such file", "x")) is None


@pytest.mark.slow
def test_a_reward_that_hangs_on_one_rank_stops_every_rank(home):
    """The watchdog runs in every rank's process: rank 1 hangs, the launcher stops both with its line."""
    (home / "my_rewards.py").write_text(
        "import os, time\n\ndef length(prompts, completions, **columns):\n"
        "    if os.environ.get('RANK') == '1':\n        time.sleep(10**6)\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    args = sets("launch.nproc_per_node=2", "reward.timeout=3")
    code, out = gpufleet(home, "train", "job.yaml", "--gpus", "cpu", *args, timeout=400)
    one_clean_error(code, out, "reward function length did not return within 3 s", "my_rewards.py:5")
    assert not (home / "run" / "final").exists()
