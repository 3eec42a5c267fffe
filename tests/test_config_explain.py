"""`gpufleet config --explain [FIELD]` in every format, with the choices of a field that has named ones; the
YAML `config --format yaml` writes keeps working from another folder (the user's reward module and paths
given relative to the working directory); what-if hardware on `launch` / `train` names the command that
answers it. Through the installed `gpufleet` from folders outside the repository."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from helpers import run_user

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "examples" / "quickstart.yaml"


def test_explain_one_field_lists_its_choices(tmp_path):
    p = run_user("config", "--explain", "train.lr_scheduler", cwd=tmp_path)  # no job needed
    assert p.returncode == 0, p.stderr
    assert "train.lr_scheduler  constant  default" in p.stdout
    assert "Learning-rate schedule after warm-up. Choices: constant, linear, cosine." in p.stdout
    assert "train.warmup_steps" not in p.stdout
    p = run_user("config", str(QUICK), "--explain", "algorithm.scale_rewards", cwd=tmp_path)
    assert "Choices: group, batch, none, or null." in p.stdout, p.stdout  # unset: from the preset
    p = run_user("config", "--explain", "env.servers", cwd=tmp_path)
    assert "Choices: auto, or a whole number." in p.stdout, p.stdout
    p = run_user("config", "--explain", "train", cwd=tmp_path)  # a section: its fields
    assert "train.precision" in p.stdout and "Choices: fp32, bf16, fp16." in p.stdout
    assert "model.path" not in p.stdout


def test_explain_an_unknown_or_trl_name(tmp_path):
    p = run_user("config", "--explain", "train.gradient_accumulation_steps", cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "TRL's name: gpufleet's is `train.micro_batch`" in p.stderr
    assert p.stderr.strip().endswith("Fix: gpufleet config --explain train.micro_batch")
    p = run_user("config", "--explain", "train.lr_schedule", cwd=tmp_path)
    assert p.returncode == 2 and "Fix: gpufleet config --explain train.lr_scheduler" in p.stderr, p.stderr
    p = run_user("config", cwd=tmp_path)
    assert p.returncode == 2 and "config needs a job file" in p.stderr and "Traceback" not in p.stderr


def test_explain_in_yaml_and_json(tmp_path):
    (tmp_path / "job.yaml").write_text(QUICK.read_text())
    p = run_user("config", "job.yaml", "--explain", "--format", "yaml", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("  #   lr_scheduler: constant")))
    assert lines[at - 1] == "  # Learning-rate schedule after warm-up. Choices: constant, linear, cosine."
    # still a job file that behaves as it reads
    (tmp_path / "explained.yaml").write_text(p.stdout)
    assert yaml.safe_load(p.stdout)["train"] == yaml.safe_load(QUICK.read_text())["train"]
    assert run_user("check", "explained.yaml", "--gpus", "cpu", cwd=tmp_path).returncode == 0
    p = run_user("config", "job.yaml", "--explain", "--format", "json", cwd=tmp_path)
    entry = json.loads(p.stdout)["train"]["lr_scheduler"]
    assert entry["doc"] == "Learning-rate schedule after warm-up."
    assert entry["choices"] == ["constant", "linear", "cosine"] and entry["value"] == "constant"
    # --explain first, then the job: the job is the job
    p = run_user("config", "--explain", "job.yaml", cwd=tmp_path)
    assert p.returncode == 0 and "model.path" in p.stdout and "Choices:" in p.stdout, p.stderr


def test_exported_yaml_works_from_another_folder(tmp_path):
    jobs, work, other = tmp_path / "jobs", tmp_path / "work", tmp_path / "other"
    for d in (jobs, work, other, jobs / "pkg"):
        d.mkdir()
    (jobs / "job.yaml").write_text(
        "reward:\n  functions: [myrewards:length, pkg.rw:length]\ntrain:\n  max_steps: 2\n"
    )
    rewards = (
        "def length(prompts, completions, **columns):\n    return [float(len(c)) for c in completions]\n"
    )
    (jobs / "myrewards.py").write_text(rewards)
    (jobs / "pkg" / "__init__.py").write_text("")
    (jobs / "pkg" / "rw.py").write_text(rewards)
    (work / "prompts.jsonl").write_text('{"prompt": "a:"}\n{"prompt": "b:"}\n')
    p = run_user(
        "config", "../jobs/job.yaml", "--format", "yaml", "--set", "data.path=prompts.jsonl", cwd=work
    )
    assert p.returncode == 0, p.stderr
    (other / "job.yaml").write_text(p.stdout)
    data = yaml.safe_load(p.stdout)
    assert data["reward"]["functions"] == [f"{jobs / 'myrewards.py'}:length", "pkg.rw:length"]
    assert data["data"]["path"] == str(work / "prompts.jsonl")
    assert f"pkg.rw is imported from {jobs}: put it on PYTHONPATH" in p.stdout  # a package: said, kept
    # from another folder the module file and the data resolve (the package: with the PYTHONPATH it names)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=other, env_extra={"PYTHONPATH": str(jobs)})
    assert p.returncode == 0, p.stdout + p.stderr
    data["reward"]["functions"] = data["reward"]["functions"][:1]
    (other / "job.yaml").write_text(yaml.safe_dump(data))
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=other)
    assert p.returncode == 0, p.stdout + p.stderr


def test_what_if_hardware_names_the_command_that_answers_it(tmp_path):
    script = "script:\n  command: python train.py --bs {per_device_batch}\n  per_device_batch: 8\n"
    (tmp_path / "job.yaml").write_text(script)
    (tmp_path / "train.py").write_text("print('hi')\n")
    p = run_user("launch", "job.yaml", "--gpus", "4x24GB", cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert (
        "use `gpufleet launch job.yaml --dry-run --gpus 4x24GB`" in p.stderr
        and "gpufleet plan" not in p.stderr
    )
    assert "running nothing. Fix: --gpus auto (detect) or --gpus cpu" in p.stderr, p.stderr
    p = run_user("launch", "job.yaml", "--dry-run", "--gpus", "4x24GB", cwd=tmp_path)  # the hint works
    assert p.returncode == 0 and "4 processes per node" in p.stdout, p.stdout + p.stderr
    (tmp_path / "train.yaml").write_text(QUICK.read_text())
    p = run_user("train", "train.yaml", "--gpus", "4x24GB", cwd=tmp_path)
    assert p.returncode == 2 and "`gpufleet plan train.yaml --gpus 4x24GB`" in p.stderr, p.stderr
    assert "--print-launch` for the command. Fix: --gpus auto" in p.stderr, p.stderr
