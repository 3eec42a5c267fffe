"""Layers and provenance: defaults < file < env < flags, presets, derived values, round trips."""

from __future__ import annotations

import json

import yaml

from gpufleet.config.load import load_job
from gpufleet.config.schema import SECTIONS, field_doc, field_paths
from helpers import run_cli

JOB = """\
model:
  path: builtin:tiny-qwen2
train:
  per_device_batch: 16
  learning_rate: 1e-5
algorithm:
  name: gspo
  epsilon: 0.001
"""


def write(tmp_path, text=JOB):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_default_layer(tmp_path):
    r = load_job(write(tmp_path, ""), env={})
    assert r.job.train.max_steps == 100
    assert str(r.source("train.max_steps")) == "default"
    assert not r.problems


def test_file_layer_with_line_numbers(tmp_path):
    p = write(tmp_path)
    r = load_job(p, env={})
    assert r.job.train.per_device_batch == 16
    assert r.job.train.learning_rate == 1e-5  # YAML 1.1 reads 1e-5 as text; the field type parses it
    assert str(r.source("train.per_device_batch")) == f"{p}:4"
    assert str(r.source("algorithm.epsilon")) == f"{p}:8"


def test_env_beats_file(tmp_path):
    r = load_job(write(tmp_path), env={"GPUFLEET_TRAIN__PER_DEVICE_BATCH": "4", "GPUFLEET_CACHE": "/x"})
    assert r.job.train.per_device_batch == 4
    assert str(r.source("train.per_device_batch")) == "env GPUFLEET_TRAIN__PER_DEVICE_BATCH"
    assert not r.problems  # GPUFLEET_CACHE has no "__": a setting, not a field


def test_flag_beats_env(tmp_path):
    r = load_job(write(tmp_path), ["train.per_device_batch=2"], env={"GPUFLEET_TRAIN__PER_DEVICE_BATCH": "4"})
    assert r.job.train.per_device_batch == 2
    assert str(r.source("train.per_device_batch")) == "flag --set train.per_device_batch=2"


def test_last_flag_wins(tmp_path):
    r = load_job(write(tmp_path), ["train.seed=1", "train.seed=7"], env={})
    assert r.job.train.seed == 7 and "train.seed=7" in str(r.source("train.seed"))


def test_bad_higher_layer_falls_back(tmp_path):
    r = load_job(
        write(tmp_path), ["train.per_device_batch=zero"], env={"GPUFLEET_TRAIN__PER_DEVICE_BATCH": "4"}
    )
    assert r.job.train.per_device_batch == 4  # the flag was rejected, the env value stands
    assert [p.field for p in r.problems] == ["train.per_device_batch"]


def test_presets_fill_unset_fields(tmp_path):
    r = load_job(write(tmp_path), env={})
    a = r.job.algorithm
    assert (a.importance_level, a.epsilon_high, a.loss_type) == ("sequence", 4e-4, "grpo")
    assert a.epsilon == 0.001 and r.source("algorithm.epsilon").kind == "file"  # the job's value wins
    assert str(r.source("algorithm.epsilon_high")) == "preset gspo"


def test_preset_per_algorithm(tmp_path):
    for name, expect in {
        "dapo": ("dapo", 0.28, "group"),
        "dr_grpo": ("dr_grpo", 0.2, "none"),
        "grpo": ("grpo", 0.2, "group"),
    }.items():
        a = load_job(write(tmp_path, ""), [f"algorithm.name={name}"], env={}).job.algorithm
        assert (a.loss_type, a.epsilon_high, a.scale_rewards) == expect


def test_micro_batch_derived(tmp_path):
    r = load_job(write(tmp_path), env={})
    assert r.job.train.micro_batch == 16 and r.source("train.micro_batch").kind == "derived"


def test_lists_parse_from_text(tmp_path):
    r = load_job(
        write(tmp_path, ""),
        ["placement.policy=0,1", "placement.reference=[2]", "reward.weights=1,0.5"],
        env={"GPUFLEET_REWARD__FUNCTIONS": "a:b,c:d", "GPUFLEET_PLACEMENT__REWARD": "2"},
    )
    pl = r.job.placement
    assert pl.policy == [0, 1] and pl.reference == [2] and pl.reward == [2]
    assert r.job.reward.functions == ["a:b", "c:d"] and r.job.reward.weights == [1.0, 0.5]
    assert not r.problems


def test_null_from_text(tmp_path):
    r = load_job(write(tmp_path, "algorithm: {epsilon: 0.1}\n"), ["algorithm.epsilon=null"], env={})
    assert r.job.algorithm.epsilon == 0.2 and r.source("algorithm.epsilon").kind == "preset"


def test_every_field_documented():
    for path in field_paths():
        assert len(field_doc(path)) > 15, path
    assert set(SECTIONS) == {
        "model",
        "data",
        "reward",
        "algorithm",
        "rollout",
        "env",
        "train",
        "placement",
        "launch",
        "output",
        "script",
        "monitor",
    }


def test_config_yaml_is_a_valid_job(tmp_path, capsys):
    p = write(tmp_path)
    code, out = run_cli(
        capsys,
        ["config", str(p), "--format", "yaml", "--set", "train.seed=3"],
        {"GPUFLEET_TRAIN__MAX_STEPS": "9"},
    )
    assert code == 0
    assert "# env GPUFLEET_TRAIN__MAX_STEPS" in out and "# flag --set train.seed=3" in out
    again = tmp_path / "again.yaml"
    again.write_text(out)
    r1 = load_job(p, ["train.seed=3"], env={"GPUFLEET_TRAIN__MAX_STEPS": "9"})
    r2 = load_job(again, env={})
    assert not r2.problems
    assert r2.job == r1.job


def test_config_json_and_table(tmp_path, capsys):
    p = write(tmp_path)
    code, out = run_cli(capsys, ["config", str(p), "--format", "json"], {"GPUFLEET_TRAIN__SEED": "5"})
    data = json.loads(out)
    assert code == 0
    assert data["train"]["seed"] == {"value": 5, "source": "env GPUFLEET_TRAIN__SEED"}
    assert data["train"]["per_device_batch"]["source"] == f"{p}:4"
    assert data["launch"]["nproc_per_node"] == {"value": "auto", "source": "default"}
    code, out = run_cli(capsys, ["config", str(p)])
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("algorithm.epsilon_high"))
    assert "0.0004" in line and "preset gspo" in line


def test_config_reports_bad_values(tmp_path, capsys):
    code, out = run_cli(capsys, ["config", str(write(tmp_path)), "--set", "train.max_stepz=3"])
    assert code == 2 and "did you mean train.max_steps" in out


def test_example_yaml_files_load(capsys):
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[1].glob("examples/*.yaml")):
        r = load_job(path, env={})
        assert not r.problems, (path, [p.render() for p in r.problems])
        yaml.safe_load(path.read_text())


def test_none_is_a_choice_where_the_field_has_one(tmp_path):
    """`--set algorithm.scale_rewards=none` (or the env variable) is the choice "none", not a null the preset
    then fills with "group"; elsewhere "none" is still null."""
    r = load_job(write(tmp_path, ""), ["algorithm.scale_rewards=none", "reward.timeout=none"], env={})
    assert r.job.algorithm.scale_rewards == "none"
    assert r.job.reward.timeout is None
    r = load_job(write(tmp_path, ""), env={"GPUFLEET_ALGORITHM__SCALE_REWARDS": "None"})
    assert r.job.algorithm.scale_rewards == "none"


def test_a_misspelt_variable_gets_the_variable_that_works(tmp_path):
    """The fix of a misspelt GPUFLEET_ variable names the whole variable to set (a misspelt section keeps
    its field), not one that would be ignored."""
    for name, want in (
        ("GPUFLEET_TRAINN__SEED", "did you mean train? (GPUFLEET_TRAIN__SEED)"),
        ("GPUFLEET_TRAIN__SEDE", "did you mean train.seed? (GPUFLEET_TRAIN__SEED)"),
    ):
        r = load_job(write(tmp_path), env={name: "3"})
        assert [p.fix for p in r.problems] == [want], name


def test_a_key_inside_a_mapping_field_gets_the_mapping_form(tmp_path):
    r = load_job(write(tmp_path), ["env.kwargs.mode=fast"], env={})
    assert [(p.field, p.fix) for p in r.problems] == [
        ("env.kwargs.mode", '--set "env.kwargs={mode: fast}" (with its other keys, if any)')
    ]
    r = load_job(write(tmp_path), ["env.kwargs={mode: fast}"], env={})
    assert r.problems == [] and r.job.env.kwargs == {"mode": "fast"}
