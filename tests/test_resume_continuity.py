"""Resuming a run under a changed job, through the installed CLI from a user's folder: every change is
said (also of a field the first run left at its default), a change that breaks the run is refused by
check and train with a fix that works, and a finished run's model is where train says it is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import run_user, sets

ROOT = Path(__file__).resolve().parents[1]
ENV = {"OMP_NUM_THREADS": "1"}


def _job(folder: Path) -> None:
    """examples/quickstart.yaml, shrunk: 4 generations, 8 completions a step, 5 steps, a checkpoint each."""
    text = (ROOT / "examples" / "quickstart.yaml").read_text(encoding="utf-8")
    for a, b in (
        ("num_generations: 8", "num_generations: 4"),
        ("per_device_batch: 128", "per_device_batch: 8"),
        ("max_steps: 400", "max_steps: 5"),
        ("log_every: 20", "log_every: 1"),
        ("dir: runs/quickstart", "dir: runs/q\n  save_every: 1"),
    ):
        assert a in text
        text = text.replace(a, b)
    (folder / "T.yaml").write_text(text, encoding="utf-8")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A user's folder holding T.yaml and runs/base: 2 steps trained, checkpoints step-1 and step-2."""
    folder = tmp_path_factory.mktemp("user")
    _job(folder)
    p = gpufleet(folder, "train", *sets("train.max_steps=2", "output.dir=runs/base"))
    assert p.returncode == 0, p.stdout + p.stderr
    return folder


def gpufleet(folder: Path, verb: str, *args: str):
    return run_user(verb, "T.yaml", *args, cwd=folder, env_extra=ENV)


@pytest.fixture
def user(base, tmp_path) -> Path:
    """A fresh copy of the user's folder (the run in it at the same relative path)."""
    shutil.copytree(base, tmp_path / "u")
    return tmp_path / "u"


def test_a_change_of_a_field_left_at_its_default_is_said_and_applied(user):
    """The first run left algorithm.beta, train.lr_scheduler, model.dtype and train.micro_batch at their
    default (or derived) values: resuming with them set says each change (it said none: a field missing
    from the saved job was taken as unchanged); a breaking one (train.steps_per_generation) is refused."""
    changes = (
        "algorithm.beta=0.04",
        "train.lr_scheduler=cosine",
        "model.dtype=bfloat16",
        "train.micro_batch=4",
        "model.lora_alpha=8",  # no adapter (model.use_peft false): no effect, said
    )
    p = gpufleet(user, "train", *sets("output.dir=runs/base", "train.max_steps=3", *changes))
    assert p.returncode == 0, p.stdout + p.stderr
    said = next(line for line in p.stdout.splitlines() if line.startswith("resuming from"))
    for text in (
        "algorithm.beta: 0.0 -> 0.04",
        "train.lr_scheduler: 'constant' -> 'cosine'",
        "model.dtype: 'auto' -> 'bfloat16'",
        "train.micro_batch: 8 -> 4",
        "train.max_steps: 2 -> 3",
        "model.lora_alpha: 32 -> 8",
    ):
        assert text in said, said
    assert "output.dir" not in said  # nothing else changed
    p = gpufleet(user, "train", *sets("output.dir=runs/base", "train.steps_per_generation=2"))  # check: below
    assert p.returncode == 2 and "train.steps_per_generation: 1 -> 2" in p.stderr, p.stdout + p.stderr


def test_a_saved_job_without_its_default_lines_is_read_with_the_schema_defaults(user):
    """A checkpoint whose job.yaml names only the fields set (no '#   ' default lines): a field it does
    not name had its default, so setting it is a change (said, or refused when it breaks the run)."""
    ckpt = user / "runs" / "base" / "checkpoints" / "step-2" / "job.yaml"
    ckpt.write_text(
        "".join(x for x in ckpt.read_text(encoding="utf-8").splitlines(True) if "#   " not in x),
        encoding="utf-8",
    )
    p = gpufleet(user, "check", *sets("output.dir=runs/base", "algorithm.num_iterations=2"))
    assert p.returncode == 2 and "algorithm.num_iterations: 1 -> 2" in p.stdout, p.stdout + p.stderr


def test_a_lora_setting_changed_on_resume_is_refused(tmp_path):
    """lora_alpha and lora_dropout come back from the saved adapter (its adapter_config.json): a change was
    said and written into the run's job.yaml, but not applied. Refused now, by check and train."""
    _job(tmp_path)
    lora = ("model.use_peft=true", "output.dir=runs/lora")
    p = gpufleet(tmp_path, "train", *sets(*lora, "train.max_steps=1"))
    assert p.returncode == 0, p.stdout + p.stderr
    for verb, change, said in (
        ("check", "model.lora_alpha=8", "model.lora_alpha: 32 -> 8"),
        ("train", "model.lora_alpha=8", "model.lora_alpha: 32 -> 8"),
        ("check", "model.lora_dropout=0", "model.lora_dropout: 0.05 -> 0"),
    ):
        p = gpufleet(tmp_path, verb, *sets(*lora, "train.max_steps=2", change))
        assert p.returncode == 2 and said in p.stdout + p.stderr, p.stdout + p.stderr
    assert "lora_alpha: 32" in (tmp_path / "runs" / "lora" / "job.yaml").read_text(encoding="utf-8")


def test_the_fix_of_a_refused_resume_from_a_named_checkpoint_starts_a_new_run(user):
    """output.resume names a checkpoint: the fix `--set output.dir=runs/q-2` alone resumed it again (and
    was refused again, with runs/q-2-2). The fix said now starts a new run, in a folder that holds none."""
    import shlex

    (user / "runs" / "q-2").mkdir(parents=True)
    (user / "runs" / "q-2" / "metrics.jsonl").write_text("")  # taken: the fix names another folder
    asked = sets("output.resume=runs/base/checkpoints/step-2", "train.seed=3")
    p = gpufleet(user, "check", *asked)
    assert p.returncode == 2 and "train.seed: 0 -> 3" in p.stdout, p.stdout + p.stderr
    fix = shlex.split(p.stdout.split("start a new run: ", 1)[1].splitlines()[0])
    assert fix == sets("output.dir=runs/q-3", "output.resume=auto")
    p = gpufleet(user, "train", *asked, *fix, "--set", "train.max_steps=1")
    assert p.returncode == 0 and "resuming" not in p.stdout, p.stdout + p.stderr
    assert (user / "runs" / "q-3" / "final" / "model.safetensors").is_file()


def test_a_run_stopped_before_its_final_model_gets_it_from_the_checkpoint(user):
    """A run stopped at step 2 of 5 (checkpoints step-1 and step-2, no final/), then asked for 2 steps:
    train said `model in runs/base/final` and wrote nothing there. It writes final/ from step-2 now."""
    run = user / "runs" / "base"
    shutil.rmtree(run / "final")
    p = gpufleet(user, "train", *sets("output.dir=runs/base", "train.max_steps=2"))
    assert p.returncode == 0 and "wrote runs/base/final from runs/base/checkpoints/step-2" in p.stdout, (
        p.stdout + p.stderr
    )
    step2 = (run / "checkpoints" / "step-2" / "model.safetensors").read_bytes()
    assert (run / "final" / "model.safetensors").read_bytes() == step2
    assert (run / "final" / "tokenizer.json").is_file() and not (run / "final" / "optimizer.pt").exists()
    p = gpufleet(user, "train", *sets("output.dir=runs/base", "train.max_steps=2"))
    assert (
        p.returncode == 0 and "already holds a finished run (2 steps; model in runs/base/final)" in p.stdout
    )


def test_an_unchanged_job_saved_without_its_default_lines_has_no_changes(tmp_path):
    """The fields a saved job does not name had what train resolved: the schema default, the algorithm's
    preset (epsilon, loss_type, ...) and the derived micro_batch; the same job again is no change."""
    from gpufleet.config.load import load_job
    from gpufleet.continuity import continuity

    _job(tmp_path)
    r = load_job(tmp_path / "T.yaml", env={})
    saved = (tmp_path / "T.yaml").read_text(encoding="utf-8")  # only the fields the user set
    assert continuity(saved, {"global_batch": 8}, r.job, {"global_batch": 8}) == ([], [])
    r = load_job(tmp_path / "T.yaml", ["algorithm.epsilon=0.3"], env={})
    assert continuity(saved, {"global_batch": 8}, r.job, {"global_batch": 8}) == (
        [],
        ["algorithm.epsilon: 0.2 -> 0.3"],
    )


def test_a_new_run_keeps_a_folder_name_that_ends_in_digits(tmp_path, monkeypatch):
    """runs/2024-11 is the user's own name, not a -N folder of ours: the new run is runs/2024-11-2; a
    runs/x-2 beside runs/x becomes runs/x-3."""
    from types import SimpleNamespace

    from gpufleet.continuity import new_run

    monkeypatch.chdir(tmp_path)
    assert new_run(SimpleNamespace(dir="runs/2024-11", resume="auto")) == "--set output.dir=runs/2024-11-2"
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x-2").mkdir()
    (tmp_path / "runs" / "x-2" / "job.yaml").write_text("{}")  # the run whose resume was refused
    assert new_run(SimpleNamespace(dir="runs/x-2", resume="auto")) == "--set output.dir=runs/x-3"


def test_another_runs_checkpoint_at_max_steps_trains_nothing_and_says_where_the_model_is(user):
    ckpt = "runs/base/checkpoints/step-2"
    p = gpufleet(user, "train", *sets("output.dir=runs/other", f"output.resume={ckpt}", "train.max_steps=2"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"{ckpt} is at step 2, train.max_steps 2: nothing to train into runs/other" in p.stdout, p.stdout
    assert not (user / "runs" / "other" / "final").exists()
