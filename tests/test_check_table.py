"""A table of bad jobs: each must exit 2, name the field, and give the fix (no traceback)."""

from __future__ import annotations

import json
import socket
import textwrap

import pytest

from helpers import run_cli

BASE = """
model:
  path: builtin:tiny-qwen2
data:
  path: builtin:repeat
rollout:
  max_prompt_length: 16
  max_completion_length: 16
train:
  per_device_batch: 8
algorithm:
  num_generations: 4
output:
  dir: out
"""


def job(extra: str = "") -> str:
    """BASE with `extra` merged in (later keys of the same section win)."""
    import yaml

    data = yaml.safe_load(BASE)
    for section, body in (yaml.safe_load(textwrap.dedent(extra)) or {}).items():
        if isinstance(body, dict) and isinstance(data.get(section), dict):
            data[section].update(body)
        else:
            data[section] = body
    return yaml.safe_dump(data)


# (id, file text, env, flags, --gpus, field that must be named, fix text that must appear)
CASES = [
    (
        "generations-1",
        job(),
        {},
        ["algorithm.num_generations=1"],
        "cpu",
        "algorithm.num_generations",
        "num_generations=8",
    ),
    (
        "issue-example",
        job(),
        {},
        ["train.per_device_batch=4", "algorithm.num_generations=3", "launch.nproc_per_node=4"],
        "4x24GB",
        "algorithm.num_generations",
        "valid for 16: 2, 4, 8, 16",
    ),
    (
        "batch-by-generations-pdb",
        job(),
        {},
        ["train.per_device_batch=4", "algorithm.num_generations=3", "launch.nproc_per_node=4"],
        "4x24GB",
        "train.per_device_batch",
        "per_device_batch=3 (or 6)",
    ),
    (
        "steps-per-generation",
        job("train: {per_device_batch: 2, steps_per_generation: 3}"),
        {},
        [],
        "cpu",
        "train.steps_per_generation",
        "valid for 6: 2, 3, 6",
    ),
    (
        "micro-not-divisor",
        job("train: {per_device_batch: 8, micro_batch: 3}"),
        {},
        [],
        "cpu",
        "train.micro_batch",
        "micro_batch=2 (4 accumulation steps",
    ),
    (
        "micro-too-big",
        job("train: {per_device_batch: 8, micro_batch: 16}"),
        {},
        [],
        "cpu",
        "train.micro_batch",
        "micro_batch=8",
    ),
    (
        "min-completion-at-max",
        job("rollout: {min_completion_length: 16}"),
        {},
        [],
        "cpu",
        "rollout.min_completion_length",
        "min_completion_length=15 (or 0, off)",
    ),
    (
        "min-completion-with-env",
        job("env: {name: 'builtin:keys'}\nrollout: {min_completion_length: 2}"),
        {},
        [],
        "cpu",
        "rollout.min_completion_length",
        "min_completion_length=0",
    ),
    (
        "typo-file-key",
        job("algorithm: {num_generation: 8}"),
        {},
        [],
        "cpu",
        "algorithm.num_generation",
        "did you mean algorithm.num_generations",
    ),
    (
        "typo-wrong-section",
        job("train: {num_generations: 8}"),
        {},
        [],
        "cpu",
        "train.num_generations",
        "did you mean algorithm.num_generations",
    ),
    (
        "typo-env-key",
        job(),
        {"GPUFLEET_TRAIN__PER_DEVICE_BATCHH": "4"},
        [],
        "cpu",
        "train.per_device_batchh",
        "GPUFLEET_TRAIN__PER_DEVICE_BATCH",
    ),
    (
        "typo-flag-key",
        job(),
        {},
        ["train.learning_rat=1e-5"],
        "cpu",
        "train.learning_rat",
        "did you mean train.learning_rate",
    ),
    ("typo-section", job() + "trian:\n  max_steps: 3\n", {}, [], "cpu", "trian", "did you mean train"),
    ("typo-env-section", job(), {"GPUFLEET_ALGO__BETA": "0.1"}, [], "cpu", "algo", "did you mean algorithm"),
    (
        "env-not-int",
        job(),
        {"GPUFLEET_TRAIN__PER_DEVICE_BATCH": "four"},
        [],
        "cpu",
        "train.per_device_batch",
        "GPUFLEET_TRAIN__PER_DEVICE_BATCH=8",
    ),
    ("flag-bad-literal", job(), {}, ["algorithm.name=gpso"], "cpu", "algorithm.name", "did you mean 'gspo'"),
    (
        "file-bad-literal",
        job("train: {precision: bf61}"),
        {},
        [],
        "cpu",
        "train.precision",
        "did you mean 'bf16'",
    ),
    (
        "negative-lr",
        job("train: {learning_rate: -0.001}"),
        {},
        [],
        "cpu",
        "train.learning_rate",
        "greater than 0",
    ),
    ("top-p-range", job(), {}, ["rollout.top_p=1.5"], "cpu", "rollout.top_p", "less than or equal to 1"),
    (
        "nproc-zero",
        job(),
        {},
        ["launch.nproc_per_node=0"],
        "cpu",
        "launch.nproc_per_node",
        "greater than or equal to 1",
    ),
    ("port-range", job(), {}, ["launch.master_port=70000"], "cpu", "launch.master_port", "master_port=auto"),
    (
        "too-many-ranks",
        job(),
        {},
        ["launch.nproc_per_node=5"],
        "4x24GB",
        "launch.nproc_per_node",
        "at most 4 devices",
    ),
    (
        "device-missing",
        job("placement: {policy: [0, 1, 5]}"),
        {},
        [],
        "4x24GB",
        "placement.policy",
        "use ids from [0, 1, 2, 3]",
    ),
    (
        "devices-list-missing",
        job("placement: {devices: [0, 1, 9]}"),
        {},
        [],
        "4x24GB",
        "placement.devices",
        "use ids from",
    ),
    (
        "device-twice",
        job("placement: {policy: '0,0'}"),
        {},
        [],
        "4x24GB",
        "placement.policy",
        "placement.policy=0",
    ),
    (
        "shared-undeclared",
        job("placement: {policy: [0, 1], reference: 1}\nalgorithm: {beta: 0.04}"),
        {},
        [],
        "3x16GB",
        "placement.policy",
        "allow_shared_devices=true",
    ),
    (
        "nproc-vs-placement",
        job(
            "placement: {policy: [0, 1], reference: 2}\nalgorithm: {beta: 0.04}\nlaunch: {nproc_per_node: 2}"
        ),
        {},
        [],
        "3x16GB",
        "launch.nproc_per_node",
        "launch.nproc_per_node=3",
    ),
    (
        "tp-with-hf",
        job(),
        {},
        ["rollout.tensor_parallel_size=2"],
        "2x24GB",
        "rollout.tensor_parallel_size",
        "tensor_parallel_size=1",
    ),
    (
        "tp-not-dividing-ranks",
        job("rollout: {engine: vllm, tensor_parallel_size: 3}"),
        {},
        ["launch.nproc_per_node=4"],
        "4x24GB",
        "rollout.tensor_parallel_size",
        "use one of 1, 2, 4",
    ),
    (
        "tp-not-dividing-kv-heads",
        job("rollout: {engine: vllm, tensor_parallel_size: 4}"),
        {},
        [],
        "4x24GB",
        "rollout.tensor_parallel_size",
        "2 KV heads",
    ),
    ("vllm-not-yet", job("rollout: {engine: vllm}"), {}, [], "cpu", "rollout.engine", "rollout.engine=hf"),
    (
        "too-long",
        job("rollout: {max_prompt_length: 1000, max_completion_length: 100}"),
        {},
        [],
        "cpu",
        "rollout.max_completion_length",
        "max_completion_length=24",
    ),
    (
        "bf16-v100",
        job("train: {precision: bf16}"),
        {},
        [],
        "2xV100-32GB",
        "train.precision",
        "precision=fp16",
    ),
    ("bf16-dtype-t4", job("model: {dtype: bfloat16}"), {}, [], "1xT4", "model.dtype", "fp16"),
    (
        "bf16-mixed-hw",
        job("train: {precision: bf16, per_device_batch: 4}"),
        {},
        [],
        "0:A100-40GB,1:T4",
        "train.precision",
        "precision=fp16",
    ),
    # ------------------------------------------------------------------ env jobs (multi-turn agent RL)
    (
        "env-builtin-typo",
        job("env: {name: 'builtin:key'}"),
        {},
        [],
        "cpu",
        "env.name",
        "did you mean builtin:keys?",
    ),
    (
        "env-gymnasium-typo",
        job("env: {name: 'gymnasium:FrozenLak-v1'}"),
        {},
        [],
        "cpu",
        "env.name",
        "did you mean gymnasium:FrozenLake-v1?",
    ),
    (
        "env-module-missing",
        job("env: {name: 'nosuch_envs_xyz:Sokoban'}"),
        {},
        [],
        "cpu",
        "env.name",
        "module:Class",
    ),
    (
        "env-kwargs-wrong",
        job("env: {name: 'builtin:keys', kwargs: {door: 3}}"),
        {},
        [],
        "cpu",
        "env.kwargs",
        "constructor takes",
    ),
    (
        "env-kwargs-gymnasium-wrong",
        job("env: {name: 'gymnasium:FrozenLake-v1', kwargs: {map_name: 5x5}}"),
        {},
        [],
        "cpu",
        "env.kwargs",
        "check env.kwargs",
    ),
    (
        "env-episode-too-long",
        job("env: {name: 'builtin:keys', max_turns: 40, max_observation_tokens: 64, max_action_tokens: 16}"),
        {},
        [],
        "cpu",
        "env.max_episode_tokens",
        "--set env.max_episode_tokens=1008",
    ),
    (
        "env-budget-below-one-action",
        job("env: {name: 'builtin:keys', max_episode_tokens: 4, max_action_tokens: 8}"),
        {},
        [],
        "cpu",
        "env.max_action_tokens",
        "--set env.max_action_tokens=4",
    ),
    (
        "env-address-without-token",
        job("env: {name: 'builtin:keys', address: ['127.0.0.1:8400']}"),
        {},
        [],
        "cpu",
        "env.token_file",
        "--set env.token_file=PATH",
    ),
    (
        "env-address-malformed",
        job("env: {name: 'builtin:keys', address: ['localhost'], token_file: prompts.txt}"),
        {},
        [],
        "cpu",
        "env.address",
        "host:port",
    ),
    (
        "env-kwargs-not-mapping",
        job("env: {name: 'builtin:keys'}"),
        {},
        ["env.kwargs=[1, 2]"],
        "cpu",
        "env.kwargs",
        "a mapping such as",
    ),
    (
        "reward-import-missing",
        job("reward: {functions: ['nosuch_module_xyz:acc']}"),
        {},
        [],
        "cpu",
        "reward.functions",
        "module:function",
    ),
    (
        "reward-malformed",
        job("reward: {functions: ['json:']}"),
        {},
        [],
        "cpu",
        "reward.functions",
        "module:function",
    ),
    (
        "reward-attr-missing",
        job("reward: {functions: ['json:no_such_fn']}"),
        {},
        [],
        "cpu",
        "reward.functions",
        "module:function",
    ),
    (
        "reward-builtin-typo",
        job("reward: {functions: ['repeat/char']}"),
        {},
        [],
        "cpu",
        "reward.functions",
        "did you mean",
    ),
    (
        "reward-weights",
        job("reward: {functions: ['json:loads', 'json:dumps'], weights: [1.0]}"),
        {},
        [],
        "cpu",
        "reward.weights",
        "reward.weights=1.0,1.0",
    ),
    (
        "model-missing-local",
        job("model: {path: ./no/such/model}"),
        {},
        [],
        "cpu",
        "model.path",
        "fix the path",
    ),
    ("model-not-folder-of-model", job("model: {path: .}"), {}, [], "cpu", "model.path", "save_pretrained"),
    (
        "model-builtin-unknown",
        job("model: {path: 'builtin:tiny-gpt5'}"),
        {},
        [],
        "cpu",
        "model.path",
        "builtin:tiny-qwen2",
    ),
    (
        "reward-model-missing",
        job("reward: {model: /no/such/rm}"),
        {},
        [],
        "cpu",
        "reward.model",
        "fix the path",
    ),
    ("data-missing", job("data: {path: data/train.jsonl}"), {}, [], "cpu", "data.path", "fix the path"),
    ("data-format", job("data: {path: prompts.txt}"), {}, [], "cpu", "data.path", ".jsonl"),
    (
        "data-field",
        job("data: {path: prompts.jsonl}"),
        {},
        [],
        "cpu",
        "data.prompt_field",
        "data.prompt_field=question",
    ),
    (
        "data-builtin-unknown",
        job("data: {path: 'builtin:nope'}"),
        {},
        [],
        "cpu",
        "data.path",
        "builtin:repeat",
    ),
    (
        "no-reward",
        job("data: {path: prompts.jsonl, prompt_field: question}"),
        {},
        [],
        "cpu",
        "reward.functions",
        "reward.functions=",
    ),
    (
        "resume-never",
        job("output: {dir: oldrun, resume: never}"),
        {},
        [],
        "cpu",
        "output.resume",
        "output.resume=auto",
    ),
    (
        "resume-never-other-way",
        job("output: {dir: oldrun, resume: never}"),
        {},
        [],
        "cpu",
        "output.dir",
        "output.dir=oldrun-2",
    ),
    (
        "resume-path-missing",
        job("output: {resume: runs/x/checkpoints/step-9}"),
        {},
        [],
        "cpu",
        "output.resume",
        "resume=auto",
    ),
    (
        "nnodes-no-rdzv",
        job("launch: {nnodes: 2}"),
        {},
        [],
        "4x24GB",
        "launch.rdzv_endpoint",
        "rdzv_endpoint=",
    ),
    (
        "node-rank",
        job("launch: {nnodes: 2, node_rank: 3, rdzv_endpoint: 'n0:29400'}"),
        {},
        [],
        "4x24GB",
        "launch.node_rank",
        "node_rank=1",
    ),
    (
        "rdzv-malformed",
        job("launch: {rdzv_endpoint: node0}"),
        {},
        [],
        "cpu",
        "launch.rdzv_endpoint",
        "node0:29400",
    ),
    (
        "greedy-groups",
        job("rollout: {temperature: 0}"),
        {},
        [],
        "cpu",
        "rollout.temperature",
        "temperature=1.0",
    ),
    (
        "set-syntax",
        job(),
        {},
        ["train.per_device_batch"],
        "cpu",
        "train.per_device_batch",
        "section.field=value",
    ),
    ("section-not-mapping", job("train: 5"), {}, [], "cpu", "train", "indented under 'train:'"),
    (
        "env-list-garbage",
        job(),
        {"GPUFLEET_PLACEMENT__POLICY": "a,b"},
        [],
        "cpu",
        "placement.policy",
        "list such as 0,1,2",
    ),
    (
        "env-bool-garbage",
        job(),
        {"GPUFLEET_MODEL__GRADIENT_CHECKPOINTING": "maybe"},
        [],
        "cpu",
        "model.gradient_checkpointing",
        "true or false",
    ),
]


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    (tmp_path / "prompts.txt").write_text("hello\n")
    (tmp_path / "oldrun").mkdir()
    (tmp_path / "oldrun" / "metrics.jsonl").write_text("{}\n")
    return tmp_path


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_job(case, workdir, capsys):
    _, text, env, flags, gpus, field, fix = case
    (workdir / "job.yaml").write_text(text)
    argv = ["check", "job.yaml", "--gpus", gpus]
    for f in flags:
        argv += ["--set", f]
    code, out = run_cli(capsys, argv, env)
    assert code == 2, out
    assert "Traceback" not in out
    assert field in out, out
    assert fix in out, out


def test_table_is_large_enough():
    assert len(CASES) >= 40


def test_all_problems_reported_at_once(workdir, capsys):
    (workdir / "job.yaml").write_text(
        job("algorithm: {num_generation: 8}\ntrain: {micro_batch: 3, precision: bf61}")
    )
    code, out = run_cli(
        capsys,
        [
            "check",
            "job.yaml",
            "--gpus",
            "cpu",
            "--set",
            "algorithm.num_generations=1",
            "--set",
            "rollout.top_p=2",
        ],
        {"GPUFLEET_TRAIN__LEARNING_RATE": "-1"},
    )
    assert code == 2
    for field in (
        "algorithm.num_generation ",
        "train.micro_batch",
        "train.precision",
        "algorithm.num_generations",
        "rollout.top_p",
        "train.learning_rate",
    ):
        assert field in out, field
    assert out.count("\nerror: ") + out.startswith("error: ") >= 6


def test_master_port_busy(workdir, capsys):
    (workdir / "job.yaml").write_text(job())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out = run_cli(
            capsys,
            [
                "check",
                "job.yaml",
                "--gpus",
                "auto",
                "--set",
                f"launch.master_port={port}",
                "--set",
                "launch.nproc_per_node=2",
                "--set",
                "train.per_device_batch=4",
            ],
        )
    assert code == 2, out
    assert "launch.master_port" in out and "not free" in out and "master_port=auto" in out


@pytest.mark.parametrize(
    "argv_tail, text, needle",
    [
        ([], "train: [1, 2\n", "not valid YAML"),
        ([], "- a\n- b\n", "mapping of sections"),
        (["--gpus", "4xfoo"], BASE, "unknown device 'foo'"),
        (["--gpus", "0:24GB,2:24GB"], BASE, "ids must be 0..1"),
        (["--gpus", "many"], BASE, "not a hardware spec"),
    ],
)
def test_unusable_input_is_one_line(argv_tail, text, needle, workdir, capsys):
    (workdir / "job.yaml").write_text(text)
    code, out = run_cli(capsys, ["check", "job.yaml", *argv_tail])
    assert code == 2
    assert needle in out and "Fix:" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_missing_job_file(workdir, capsys):
    code, out = run_cli(capsys, ["check", "nope.yaml"])
    assert code == 2 and "nope.yaml" in out and "does not exist" in out


def test_warning_only_exits_zero(workdir, capsys):
    (workdir / "job.yaml").write_text(job("placement: {reference: [1]}"))
    code, out = run_cli(
        capsys, ["check", "job.yaml", "--gpus", "2x24GB", "--set", "train.per_device_batch=4"]
    )
    assert code == 0, out
    assert "warning: placement.reference" in out and "beta is 0" in out


def test_good_multi_gpu_layout(workdir, capsys):
    (workdir / "job.yaml").write_text(
        job("placement: {policy: [0, 1], reference: 2}\nalgorithm: {beta: 0.04}")
    )
    code, out = run_cli(capsys, ["check", "job.yaml", "--gpus", "3x16GB"])
    assert code == 0, out
    assert "reference on scorer device 2" in out and "3 processes" in out


def test_shared_device_declared(workdir, capsys):
    (workdir / "job.yaml").write_text(
        job("placement: {policy: [0, 1], reference: 1, allow_shared_devices: true}\nalgorithm: {beta: 0.04}")
    )
    code, out = run_cli(capsys, ["check", "job.yaml", "--gpus", "2x24GB"])
    assert code == 0, out


def test_reward_attr_missing_in_user_module(workdir, capsys, monkeypatch):
    (workdir / "myrewards.py").write_text(
        "def accuracy(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n"
    )
    monkeypatch.syspath_prepend(str(workdir))
    (workdir / "job.yaml").write_text(job("reward: {functions: ['myrewards:accuracy']}"))
    assert run_cli(capsys, ["check", "job.yaml", "--gpus", "cpu"])[0] == 0
    (workdir / "job.yaml").write_text(job("reward: {functions: ['myrewards:accuracyy']}"))
    code, out = run_cli(capsys, ["check", "job.yaml", "--gpus", "cpu"])
    assert code == 2 and "defines no 'accuracyy'" in out


def test_torch_compile_needs_a_compiler(workdir, capsys, monkeypatch):
    """train.torch_compile on this CPU: refused when $CXX names no compiler, fine with g++ (CI has it)."""
    (workdir / "job.yaml").write_text(job("train: {torch_compile: true}"))
    monkeypatch.setenv("CXX", str(workdir / "no-such-g++"))
    code, out = run_cli(capsys, ["check", "job.yaml", "--gpus", "cpu"])
    assert code == 2 and "Traceback" not in out, out
    assert (
        "train.torch_compile" in out and "no-such-g++" in out and "--set train.torch_compile=false" in out
    ), out
    monkeypatch.delenv("CXX")
    code, out = run_cli(capsys, ["check", "job.yaml", "--gpus", "cpu"])
    assert code == 0, out
    # a what-if spec describes another machine: its compilers are not this one's
    monkeypatch.setenv("CXX", str(workdir / "no-such-g++"))
    code, out = run_cli(capsys, ["check", "job.yaml", "--gpus", "4x24GB"])
    assert "torch_compile" not in out, out
