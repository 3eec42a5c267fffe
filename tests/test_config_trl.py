"""TRL's option names in a job file: the key is reported with gpufleet's field for it (the guide's "Coming
from TRL" map, docs/trl.md, `gpufleet.config.trl`), or as having no equivalent, never with a wrong "did you mean"; and
fields that have no effect in a job (env: without an env, script: in a trainer job) are warned about.
Through the installed `gpufleet` from a folder outside the repository, with the user's own job.yaml."""

from __future__ import annotations

import re
from pathlib import Path

from gpufleet.config.schema import SECTIONS, field_paths
from gpufleet.config.trl import OPTIONS, PREFIXES, lookup
from helpers import run_user

ROOT = Path(__file__).resolve().parents[1]


def _readme_trl_rows() -> list[tuple[str, str]]:
    """(TRL cell, gpufleet cell) of every row of the guide's "Coming from TRL" table (docs/trl.md)."""
    text = (ROOT / "docs" / "trl.md").read_text(encoding="utf-8")
    block = text.split("# Coming from TRL", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in block.splitlines():
        if not line.startswith("| ") or line.startswith(("| TRL 1.16", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows.append((cells[0], cells[1]))
    assert len(rows) > 40, "the TRL map in docs/trl.md was not found"
    return rows


def _trl_names(cell: str) -> list[str]:
    """TRL option names in a README cell: each backticked name (`ModelConfig.` dropped, cut at `=`, `(`, `:`);
    class names (GRPOTrainer(...)) are not options; `vllm_*` is a family."""
    names = []
    for span in re.findall(r"`([^`]+)`", cell):
        span = span.removeprefix("ModelConfig.")
        name = re.match(r"[A-Za-z_][A-Za-z0-9_]*\*?", span)
        if name and not name.group(0)[0].isupper():
            names.append(name.group(0))
    return names


def _gpufleet_fields(cell: str, trl_name: str) -> set[str]:
    """The job fields a README gpufleet cell names (`algorithm.` + the same names, `algorithm.vespo_*`)."""
    spans = re.findall(r"`([^`]+)`", cell)
    out = {s for s in spans if s in field_paths()}
    for s in spans:
        if s.endswith("*"):
            out |= {p for p in field_paths() if p.startswith(s[:-1])}
        if s.endswith(":") and s[:-1] in SECTIONS:  # `env:` section
            out |= {p for p in field_paths() if p.startswith(s[:-1] + ".")}
    if "+ the same names" in cell:
        out |= {s + trl_name for s in spans if s.endswith(".")}
    return out


def test_readme_trl_map_and_the_table_name_the_same_options():
    """Every TRL name in the README's map is in gpufleet.config.trl and vice versa, and both send it to the
    same field (or both say there is none)."""
    seen: set[str] = set()
    for trl_cell, gpufleet_cell in _readme_trl_rows():
        for name in _trl_names(trl_cell):
            seen.add(name)
            if name.endswith("*"):
                assert any(name[:-1].startswith(p) for p in PREFIXES), f"README's {name} is not in PREFIXES"
                continue
            assert name in OPTIONS, f"README's TRL map names {name!r}; add it to gpufleet.config.trl.OPTIONS"
            option = OPTIONS[name]
            fields = _gpufleet_fields(gpufleet_cell, name)
            if option.field is None:
                assert not fields or "not yet" in gpufleet_cell or "derived" in gpufleet_cell, (name, fields)
            else:
                assert option.field in fields, f"{name}: table says {option.field}, README says {fields}"
    missing = set(OPTIONS) - seen
    assert not missing, f"in gpufleet.config.trl but not in the README's TRL map: {sorted(missing)}"
    assert all(any(n.endswith("*") and n[:-1].startswith(p) for n in seen) for p in PREFIXES)


def test_every_target_is_a_job_field():
    paths = set(field_paths())
    for name, option in {**OPTIONS, **PREFIXES}.items():
        assert option.field is None or option.field in paths, (name, option.field)
        assert lookup(name) is option or name in PREFIXES
    assert lookup("vllm_gpu_memory_utilization") is PREFIXES["vllm_"]
    assert lookup("vllm_tensor_parallel_size").field == "rollout.tensor_parallel_size"  # exact before family


TRL_JOB = """\
model:
  path: builtin:tiny-qwen2
train:
  gradient_accumulation_steps: 4
  logging_steps: 5
  bf16: true
  learning_rat: 1.0e-5
reward:
  reward_weights: [1.0]
  multi_objective_aggregation: normalize_then_sum
output:
  save_steps: 10
  save_total_limit: 3
rollout:
  vllm_gpu_memory_utilization: 0.5
  min_p: 0.1
algorithm:
  generation_batch_size: 16
bf16: true
logging_steps: 3
"""


def _blocks(text: str) -> dict[str, str]:
    """check's output: the field of each problem -> its three lines."""
    out, key = {}, None
    for line in text.splitlines():
        if line.startswith(("error: ", "warning: ")):
            key = line.split(": ", 2)[1]
            out[key] = line
        elif key and line.startswith("    "):
            out[key] += "\n" + line
    return out


def test_trl_names_point_at_gpufleet_fields(tmp_path):
    (tmp_path / "job.yaml").write_text(TRL_JOB)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    said = _blocks(p.stdout)
    expect = {
        "train.gradient_accumulation_steps": (
            "gpufleet's is `train.micro_batch`",
            "set train.micro_batch to train.per_device_batch / 4",
        ),
        "train.logging_steps": ("gpufleet's is `train.log_every`", "write `log_every: 5` under `train:`"),
        "train.bf16": ("gpufleet's is `train.precision`", "write `precision: bf16` under `train:`"),
        "reward.reward_weights": ("gpufleet's is `reward.weights`", "write `weights: [1.0]` under `reward:`"),
        "reward.multi_objective_aggregation": (
            "gpufleet's is `reward.aggregation`",
            "write `aggregation: normalize_then_sum` under `reward:`",
        ),
        "output.save_steps": ("gpufleet's is `output.save_every`", "write `save_every: 10` under `output:`"),
        "output.save_total_limit": (
            "gpufleet's is `output.keep_last`",
            "write `keep_last: 3` under `output:`",
        ),
        "bf16": ("gpufleet's is `train.precision`", "write `precision: bf16` under `train:`"),
        "logging_steps": ("gpufleet's is `train.log_every`", "write `log_every: 3` under `train:`"),
    }
    for key, (why, fix) in expect.items():
        block = said[key]
        assert f"`{key}` is TRL's name: {why}" in block and f"fix: {fix}" in block, block
    for key in ("rollout.vllm_gpu_memory_utilization", "rollout.min_p", "algorithm.generation_batch_size"):
        assert "gpufleet has no field for it" in said[key] and "did you mean" not in said[key], said[key]
    # the wrong guesses of before are gone; a typo that is no TRL name keeps its "did you mean"
    for wrong in ("script.gradient_accumulation_steps", "env.reward_weight", "did you mean train.max_steps"):
        assert wrong not in p.stdout, p.stdout
    assert "did you mean train.learning_rate?" in said["train.learning_rat"]


def test_trl_names_from_flags_and_the_environment(tmp_path):
    (tmp_path / "job.yaml").write_text("train:\n  max_steps: 2\n")
    p = run_user(
        "check",
        "job.yaml",
        "--gpus",
        "cpu",
        "--set",
        "bf16=true",
        "--set",
        "train.use_vllm=false",
        "--set",
        "script.per_device_train_batch_size=4",
        "--set",
        "max_steps=3",
        cwd=tmp_path,
        env_extra={"GPUFLEET_OUTPUT__SAVE_STEPS": "7"},
    )
    assert p.returncode == 2, p.stdout + p.stderr
    said = _blocks(p.stdout)
    assert "fix: --set train.precision=bf16 instead" in said["bf16"]
    assert "fix: --set rollout.engine=hf instead" in said["train.use_vllm"]
    assert "fix: GPUFLEET_OUTPUT__SAVE_EVERY=7 instead" in said["output.save_steps"]
    assert "fix: --set train.max_steps=3" in said["max_steps"]  # gpufleet's name too, without its section
    # in script: (gpufleet launch's recipe) TRL's name points at the script's own field
    assert "gpufleet's is `script.per_device_batch`" in said["script.per_device_train_batch_size"]


def test_fields_without_effect_are_warned_about(tmp_path):
    job = "train:\n  max_steps: 2\nenv:\n  reward_weight: 0.5\nscript:\n  per_device_batch: 4\n"
    (tmp_path / "job.yaml").write_text(job)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr  # warnings, not errors
    said = _blocks(p.stdout)
    env = said["env.reward_weight"]
    assert env.startswith("warning: env.reward_weight: env.reward_weight = 0.5 (job.yaml:4)"), env
    assert "has no effect in this job" in env and "env.name is unset" in env and "reward.weights" in env
    script = said["script.per_device_batch"]
    assert script.startswith("warning: ") and "has no effect in this job" in script
    assert "gpufleet launch JOB -- CMD" in script and "train.per_device_batch" in script
    assert p.stdout.strip().endswith("0 errors, 2 warnings.")
    # with an env, env.reward_weight counts; the quickstart sets neither section: no warning
    (tmp_path / "agent.yaml").write_text("env:\n  name: builtin:keys\n  reward_weight: 0.5\n")
    p = run_user("check", "agent.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert "env.reward_weight" not in p.stdout, p.stdout
    p = run_user("check", str(ROOT / "examples" / "quickstart.yaml"), "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0 and "no effect" not in p.stdout, p.stdout
