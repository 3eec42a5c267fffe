"""A new user's first hour (issue 17), through the installed console script from a folder outside the
repository: what `check` passes `train` runs, and the lines the CLI prints are true."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from helpers import run_user, sets

ROOT = Path(__file__).resolve().parents[1]


def user_folder(tmp_path: Path) -> Path:
    home = tmp_path / "me"
    home.mkdir()
    shutil.copy(ROOT / "examples" / "quickstart.yaml", home / "job.yaml")
    return home


def test_train_refuses_what_if_hardware(tmp_path):
    home = user_folder(tmp_path)
    p = run_user("train", "job.yaml", "--gpus", "4x24GB", "--set", "output.dir=run", cwd=home)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--gpus '4x24GB'" in lines[0] and "gpufleet plan" in lines[0], p.stderr
    assert "Traceback" not in p.stderr and not (home / "run").exists()
    # the same spec is a fine question for plan / check, and for --print-launch (runs nothing)
    assert run_user("check", "job.yaml", "--gpus", "4x24GB", cwd=home).returncode == 0
    p = run_user("train", "job.yaml", "--gpus", "4x24GB", "--print-launch", cwd=home)
    assert p.returncode == 0 and "--nproc-per-node 4" in p.stdout, p.stdout + p.stderr


def test_config_yaml_behaves_as_it_reads(tmp_path):
    home = user_folder(tmp_path)
    p = run_user("config", "job.yaml", "--format", "yaml", cwd=home)
    assert p.returncode == 0, p.stderr
    (home / "resolved.yaml").write_text(p.stdout.replace("name: grpo", "name: gspo"))
    p = run_user("config", "resolved.yaml", "--format", "json", cwd=home)
    import json

    algo = json.loads(p.stdout)["algorithm"]
    assert algo["importance_level"] == {"value": "sequence", "source": "preset gspo"}
    assert algo["epsilon"]["value"] == 3e-4  # GSPO's own clip range, not grpo's 0.2
    data = yaml.safe_load((home / "resolved.yaml").read_text())
    assert "epsilon" not in data["algorithm"] and data["algorithm"]["name"] == "gspo"
    assert run_user("check", "resolved.yaml", "--gpus", "cpu", cwd=home).returncode == 0


def test_config_explain_documents_each_field(tmp_path):
    home = user_folder(tmp_path)
    p = run_user("config", "job.yaml", "--explain", cwd=home)
    assert p.returncode == 0
    assert "train.global_batch" in p.stdout and "kept whatever the number of ranks" in p.stdout


@pytest.mark.slow
def test_global_batch_is_said_and_can_be_pinned(tmp_path):
    home = user_folder(tmp_path)
    two = ["--gpus", "cpu", "--set", "launch.nproc_per_node=2", "--set", "train.per_device_batch=16"]
    p = run_user("check", "job.yaml", *two, cwd=home)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "32 completions per optimizer step = per_device_batch 16 x 2 policy ranks" in p.stdout
    assert "train.global_batch" in p.stdout and "learning rate is not scaled" in p.stdout
    job = yaml.safe_load((home / "job.yaml").read_text())
    del job["train"]["per_device_batch"]  # global_batch decides it now
    (home / "job.yaml").write_text(yaml.safe_dump(job))
    pinned = ["--gpus", "cpu", "--set", "train.global_batch=16"]
    for n, per in ((1, 16), (2, 8)):
        # per_device_batch is derived where the rank count is known (check, plan, train)
        p = run_user("check", "job.yaml", "--set", f"launch.nproc_per_node={n}", *pinned, cwd=home)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"generation batch 16 = {per} per device x" in p.stdout, p.stdout
        assert "completions per optimizer step" not in p.stdout  # pinned: nothing to warn about
    p = run_user(
        "train",
        "job.yaml",
        *pinned,
        *sets("launch.nproc_per_node=2", "train.max_steps=2", "output.dir=run"),
        cwd=home,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 steps x 16 completions" in p.stdout and "completions per optimizer step" not in p.stdout
    assert p.stdout.count("done: reward") == 1 and "model:" in p.stdout
    # unpinned, train says what check says: the batch doubled with the second rank
    p = run_user("train", "job.yaml", *two, *sets("train.max_steps=1", "output.dir=run2"), cwd=home)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "32 completions per optimizer step = per_device_batch 16 x 2 policy ranks" in p.stdout
    p = run_user(
        "check", "job.yaml", "--gpus", "cpu", "--set", "launch.nproc_per_node=3", *pinned[2:], cwd=home
    )
    assert p.returncode == 2 and "does not split evenly over 3 policy ranks" in p.stdout
    assert "--set train.global_batch=18 (or 15)" in p.stdout


def test_lines_read_right(tmp_path):
    home = user_folder(tmp_path)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=home)
    assert "1 policy rank on cpu process [0]; 1 process" in p.stdout, p.stdout
    assert "(1 accumulation step)" in p.stdout and "rank(s)" not in p.stdout
    (home / "bad.yaml").write_text("train:\n  max_steps: many\n")
    p = run_user("check", "bad.yaml", cwd=home)
    assert "fix: use a whole number, e.g. the default: write `max_steps: 100` at bad.yaml:2" in p.stdout


def test_one_process_run_has_a_log_and_readable_model(tmp_path):
    home = user_folder(tmp_path)
    p = run_user("train", "job.yaml", "--gpus", "cpu", *sets("train.max_steps=2", "output.dir=run"), cwd=home)
    assert p.returncode == 0, p.stdout + p.stderr
    run = home / "run"
    assert "step 2/2" in (run / "logs" / "rank0.log").read_text()
    assert p.stdout.count("done: reward") == 1 and "(sd " in p.stdout
    for f in (run / "final").iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, f  # group and others may read (umask 022)
    p = run_user("export", "run", "--to", "exported", cwd=home)
    assert p.returncode == 0 and (home / "exported" / "model.safetensors").stat().st_mode & 0o044 == 0o044
