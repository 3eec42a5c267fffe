"""Plans, fixes and the fit rule: the note-001 layouts, a 7B model refused on one 24 GB GPU with
fixes that work when re-planned, auto vs explicit placements, largest-that-fits, and the check rule."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import yaml

from gpufleet.config.load import load_job
from gpufleet.hardware import GiB, parse_gpu_spec
from gpufleet.plan.change import Change, apply, changes, merge
from gpufleet.plan.fit_rule import fit_problems
from gpufleet.plan.fixes import find_fixes
from gpufleet.plan.largest import largest_that_fits
from gpufleet.plan.loads import HEADROOM, Plan, PlanError
from gpufleet.plan.search import make_plan
from gpufleet.plan.shape import load_models
from gpufleet.rules import run_checks
from gpufleet.verbs.plan import plan_command

ROOT = Path(__file__).resolve().parents[1]
GSPO = str(ROOT / "examples" / "gspo-3gpu.yaml")
QUICK = str(ROOT / "examples" / "quickstart.yaml")


def run_plan(capsys, job: str, gpus: str, *sets: str, fmt: str = "table") -> tuple[int, str]:
    code = plan_command(job, list(sets), gpus, fmt, {})
    out = capsys.readouterr()
    return code, out.out + out.err


def split_command(command: str) -> tuple[str, list[str]]:
    """`--gpus 11x24GB --set a=1 --set b=2` -> ("11x24GB", ["a=1", "b=2"])."""
    words, gpus, sets = shlex.split(command), None, []
    for flag_, value in zip(words[::2], words[1::2], strict=True):
        if flag_ == "--gpus":
            gpus = value
        else:
            assert flag_ == "--set", command
            sets.append(value)
    return gpus, sets


def write_job(tmp_path, **sections) -> str:
    base = {
        "data": {"path": "builtin:repeat"},
        "algorithm": {"num_generations": 8},
        "rollout": {"max_prompt_length": 512, "max_completion_length": 512},
        "train": {"per_device_batch": 8},
    }
    for name, body in sections.items():
        base.setdefault(name, {}).update(body)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(base))
    return str(path)


# ------------------------------------------------------------------------------- note 001 layouts


def test_note001_three_gpu_layout(capsys):
    code, out = run_plan(capsys, GSPO, "3x16GB")
    assert code == 0, out
    lines = {line.split()[0]: line for line in out.splitlines() if line[:1].isdigit()}
    assert "policy rank 0" in lines["0"] and "policy rank 1" in lines["1"]
    assert "scorer: reference" in lines["2"] and "policy" not in lines["2"]
    assert "DDP over 2 policy ranks" in out and "reference on dedicated scorer device 2" in out
    assert "fits: every device keeps >= 10% free" in out
    assert "largest that fits" in out and "train.per_device_batch" in out


def test_note001_three_gpu_json(capsys):
    code, out = run_plan(capsys, GSPO, "3x16GB", fmt="json")
    data = json.loads(out)
    assert code == 0 and data["exit_code"] == 0
    devices = {d["device"]: d for d in data["plan"]["devices"]}
    assert set(devices) == {"0", "1", "2"}
    for d in devices.values():
        assert d["total_bytes"] <= (1 - HEADROOM) * d["capacity_bytes"]
        assert sum(p["total_bytes"] for p in d["processes"]) == d["total_bytes"]
    # The policy GPUs hold the 0.5B policy's fp32 weights, grads (+ DDP buckets) and AdamW: 16 + 4 B/param
    n = data["plan"]["model"]["parameters"]
    c = devices["0"]["components_bytes"]
    assert c["weights"] == 4 * n and c["grads"] == 8 * n and c["optimizer"] == 8 * n
    assert (
        devices["2"]["components_bytes"]["weights"] == 2 * n
    )  # the frozen reference in the compute dtype (bf16)


def test_note001_two_gpu_layout_refused_then_fixed(capsys):
    """On 2 GPUs the file's device 2 does not exist: plan lists layouts that fit; each re-plans clean."""
    code, out = run_plan(capsys, GSPO, "2x16GB")
    assert code == 2
    assert "device 2 does not exist" in out and "layouts that fit this hardware" in out
    commands = [line.split(": ", 1)[1] for line in out.splitlines() if line.strip()[:2] in ("1.", "2.", "3.")]
    shared = [
        c for c in commands if "--set placement.reference=1 --set placement.allow_shared_devices=true" in c
    ]
    assert len(commands) == 3 and len(shared) == 1
    # fastest expected first: colocate (~1x) before sharing device 1 (~1.1x) before one policy GPU (~2x)
    costs = [float(x) for x in re.findall(r"~([\d.]+)x the time per completion", out)]
    assert costs == sorted(costs) and len(costs) == 3, out
    for command in commands:
        gpus, sets = split_command(command)
        code, again = run_plan(capsys, GSPO, gpus or "2x16GB", *sets)
        assert code == 0, again
    # The note's 2-GPU layout: GPU 1 holds policy rank 1 and the reference scorer.
    _, sets = split_command(shared[0])
    code, out = run_plan(capsys, GSPO, "2x16GB", *sets, fmt="json")
    devices = {d["device"]: d for d in json.loads(out)["plan"]["devices"]}
    assert devices["1"]["roles"] == ["policy rank 1", "scorer: reference"]
    assert devices["1"]["total_bytes"] > devices["0"]["total_bytes"]


def test_note001_two_gpu_layout_with_ddp_is_tight(capsys):
    """The note's own 2-GPU layout keeps DDP: GPU 1 (policy rank 1 + the reference, bf16 since the
    reference is loaded in the compute dtype) fits with too little headroom, and plan says what helps;
    on 12 GB cards it does not fit."""
    sets = ("placement.reference=1", "placement.allow_shared_devices=true")
    code, out = run_plan(capsys, GSPO, "2x16GB", *sets)
    assert code == 0 and "fits, but tight: device 1 keeps only" in out
    assert "FSDP over the same GPUs: --set placement.strategy=fsdp" in out
    code, out = run_plan(capsys, GSPO, "2x12GB", *sets)
    assert code == 2 and "does not fit: device 0 needs" in out


def test_check_accepts_the_example():
    r = load_job(GSPO, [], {})
    problems, ctx = run_checks(r, parse_gpu_spec("3x16GB"), {})
    assert not [p for p in problems if p.severity == "error"], [p.render() for p in problems]
    assert fit_problems(ctx) == []


# ------------------------------------------------------------------------------- 7B on one 24 GB


def test_7b_full_adamw_refused_on_one_24gb_gpu_with_fixes_that_work(tmp_path, capsys):
    job = write_job(tmp_path, model={"path": "Qwen/Qwen2.5-7B-Instruct"})
    code, out = run_plan(capsys, job, "1x24GB")
    assert code == 2, out
    assert "does not fit: device 0 needs" in out
    fixes = [line.split(": ", 1)[1] for line in out.splitlines() if line.strip()[:2].rstrip(".").isdigit()]
    assert any("--gpus" in f and "placement.strategy=fsdp" in f for f in fixes), out
    for command in fixes:
        gpus, sets = split_command(command)
        code, again = run_plan(capsys, job, gpus or "1x24GB", *sets)
        assert code == 0, (command, again)
        assert "fits: every device keeps >= 10% free" in again


def test_7b_json_fix_counts_gpus(tmp_path, capsys):
    job = write_job(tmp_path, model={"path": "Qwen/Qwen2.5-7B-Instruct"})
    code, out = run_plan(capsys, job, "1x24GB", fmt="json")
    data = json.loads(out)
    assert code == 2 and data["plan"]["fits"] is False
    (fsdp,) = [f for f in data["fixes"] if f["gpus"]]
    n = int(fsdp["gpus"].split("x")[0])
    # 7.6B params x 16 bytes = 114 GiB of state alone: more than 5 GPUs of 24 GiB, fewer than 64.
    assert 5 < n < 64
    assert all(d["headroom"] >= HEADROOM for d in fsdp["devices"])


def test_check_rule_refuses_7b(tmp_path):
    job = write_job(tmp_path, model={"path": "Qwen/Qwen2.5-7B-Instruct"})
    r = load_job(job, [], {})
    problems, ctx = run_checks(r, parse_gpu_spec("1x24GB"), {})
    (p,) = [p for p in fit_problems(ctx) if p.severity == "error"]
    assert p.field == "placement.strategy"
    assert p.extra.get("rule") == "fit"  # what `train --force` looks for to let it run anyway
    assert (
        "needs" in p.why and "24.00 GiB" in p.why and "--gpus" in p.fix and "placement.strategy=fsdp" in p.fix
    )


# ------------------------------------------------------------------------------------- choices


def test_explicit_colocate_is_checked_not_overridden(tmp_path):
    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-1.5B-Instruct"},
        algorithm={"beta": 0.04},
        placement={"reference": "colocate"},
        train={"per_device_batch": 8, "micro_batch": 1},
    )
    r = load_job(job, [], {})
    hw = parse_gpu_spec("3x24GB")
    plan, _ = make_plan(r, hw, {})
    assert plan.reference == "colocate" and plan.changes == ()
    assert all("reference" in d.roles[0] for d in plan.devices)


def test_auto_reference_moves_to_a_dedicated_device_only_when_colocated_is_tight(tmp_path):
    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-1.5B-Instruct"},
        algorithm={"beta": 0.04},
        train={"per_device_batch": 8, "micro_batch": 1},
        rollout={"max_prompt_length": 256, "max_completion_length": 256},
    )
    r = load_job(job, [], {})
    models = load_models(r, {})
    roomy, _ = make_plan(r, parse_gpu_spec("4x80GB"), {}, models)
    assert roomy.reference == "colocate" and roomy.comfortable and not roomy.changes
    assert any("auto -> colocated" in w for w in roomy.why)
    hw = parse_gpu_spec("4x40GB")
    colocated, _ = make_plan(r, hw, {}, models, choose=False)
    assert not colocated.comfortable
    chosen, _ = make_plan(r, hw, {}, models)
    assert chosen.reference == "dedicated" and chosen.comfortable
    assert chosen.changes == (Change("placement.reference", [3]),)
    assert [c.flag() for c in chosen.changes] == ["--set placement.reference=3"]
    assert any("auto -> dedicated scorer device 3" in w for w in chosen.why)
    # The printed choice reproduces the plan when given explicitly.
    explicit, _ = make_plan(apply(r, [Change("placement.reference", [3])]), hw, {}, models)
    assert [d.total for d in explicit.devices] == [d.total for d in chosen.devices]


def test_fsdp_shards_by_policy_ranks(tmp_path):
    job = write_job(
        tmp_path, model={"path": "meta-llama/Llama-3.1-8B-Instruct"}, placement={"strategy": "fsdp"}
    )
    r = load_job(job, [], {})
    models = load_models(r, {})
    n = models.policy.params.total
    for gpus in (2, 4, 8):
        plan, _ = make_plan(r, parse_gpu_spec(f"{gpus}x80GB"), {}, models)
        assert plan.shards == gpus == plan.topo.policy_ranks
        assert plan.devices[0].optimizer == 8 * -(-n // gpus)


def test_plan_checks_itself(tmp_path):
    r = load_job(GSPO, [], {})
    plan, _ = make_plan(r, parse_gpu_spec("3x16GB"), {})
    fields = {f: getattr(plan, f) for f in Plan.__dataclass_fields__}
    with pytest.raises(PlanError, match="fsdp shards 3 != policy ranks 2"):
        Plan(**{**fields, "strategy": "fsdp", "shards": 3})
    with pytest.raises(PlanError, match="reference is colocate but scorer"):
        Plan(**{**fields, "reference": "colocate"})
    with pytest.raises(PlanError, match="micro_batch 32 not in 1..per_device_batch 16"):
        Plan(**{**fields, "micro_batch": 32})


def test_every_fix_re_plans_comfortably(tmp_path):
    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        algorithm={"beta": 0.04},
        train={"per_device_batch": 16},
        rollout={"max_prompt_length": 512, "max_completion_length": 1024},
    )
    r = load_job(job, [], {})
    hw = parse_gpu_spec("2x24GB")
    models = load_models(r, {})
    plan, _ = make_plan(r, hw, {}, models)
    assert not plan.fits
    fixes = find_fixes(r, hw, {}, models)
    kinds = [f.kind.split(" (")[0] for f in fixes]
    assert {
        "smaller micro-batch",
        "gradient checkpointing",
        "dedicated scorer device",
        "FSDP over the same GPUs",
    } <= set(kinds), kinds
    # listed by group (the same training, LoRA, other GPUs or less data), fastest expected first in each
    assert [(f.group, f.cost) for f in fixes] == sorted((f.group, f.cost) for f in fixes)
    assert kinds.index("smaller micro-batch") < kinds.index("gradient checkpointing")  # 1.2x < 1.3x
    for f in fixes:
        gpus, sets = split_command(f.command())
        r2 = load_job(job, sets, {})
        again, _ = make_plan(r2, parse_gpu_spec(gpus) if gpus else hw, {}, models)
        assert again.comfortable, f.command()


def test_largest_that_fits_is_the_edge(tmp_path):
    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        train={"per_device_batch": 8},
        rollout={"max_prompt_length": 128, "max_completion_length": 128},
    )
    r = load_job(job, [], {})
    hw = parse_gpu_spec("1x24GB")
    models = load_models(r, {})
    by_field = {x.field: x for x in largest_that_fits(r, hw, {}, models)}
    b = by_field["train.per_device_batch"].largest
    t = by_field["rollout.max_completion_length"].largest
    assert b and t

    def comfortable(**fields):
        plan, _ = make_plan(apply(r, changes(fields)), hw, {}, models)
        return plan.comfortable

    assert comfortable(**{"train.per_device_batch": b}) and not comfortable(
        **{"train.per_device_batch": b + 1}
    )
    assert comfortable(**{"rollout.max_completion_length": t})
    assert not comfortable(**{"rollout.max_completion_length": t + 1})
    assert by_field["algorithm.num_generations"].largest == 8  # divides 8 x 1 rank x 1 step
    assert "does not depend on G" in by_field["algorithm.num_generations"].note


# ----------------------------------------------------------------------------- small and errors


def test_quickstart_on_cpu_fits(capsys):
    code, out = run_plan(capsys, QUICK, "cpu")
    assert code == 0, out
    assert out.count("\ncpu ") == 1 and "policy rank 0" in out


def test_check_rule_quiet_when_it_fits_and_warns_when_tight(tmp_path):
    r = load_job(QUICK, [], {})
    _, ctx = run_checks(r, parse_gpu_spec("1x24GB"), {})
    assert fit_problems(ctx) == []
    job = write_job(tmp_path, model={"path": "Qwen/Qwen2.5-0.5B-Instruct"}, train={"per_device_batch": 8})
    r = load_job(job, [], {})
    models = load_models(r, {})
    plan, _ = make_plan(r, parse_gpu_spec("1x80GB"), {}, models)
    need = plan.devices[0].total
    spec = f"1x{need / 0.95 / GiB:.3f}GB"  # 5% free: fits, but tight
    _, ctx = run_checks(r, parse_gpu_spec(spec), {})
    (p,) = fit_problems(ctx)
    assert p.severity == "warning" and "keep only" in p.why and "--set" in p.fix


def test_unknown_model_is_one_clear_error(tmp_path, capsys):
    job = write_job(tmp_path, model={"path": "nobody/unknown-model"})
    code, out = run_plan(capsys, job, "1x24GB")
    assert code == 2
    assert "model.path = nobody/unknown-model" in out and "Fix:" in out and "Traceback" not in out


def test_reward_model_is_sized_where_it_is_placed(tmp_path, capsys):
    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        reward={"model": "Qwen/Qwen2.5-0.5B-Instruct"},
        placement={"policy": [0, 1], "reward": [2]},
        train={"micro_batch": 2},
    )
    code, out = run_plan(capsys, job, "3x24GB", fmt="json")
    devices = {d["device"]: d for d in json.loads(out)["plan"]["devices"]}
    assert code == 0
    assert devices["2"]["roles"] == ["scorer: reward model"]
    # in the compute dtype (an fp32 run: 4 bytes per parameter, whatever the checkpoint's bf16);
    # a one-label score head (896 weights) instead of the tied LM head
    assert devices["2"]["components_bytes"]["weights"] == 4 * (494_032_768 + 896)


def test_colocated_reward_model_is_sharded_in_the_compute_dtype(tmp_path, capsys):
    """FSDP over 4 ranks, bf16: the colocated reward model costs 1/4 of its bf16 weights per rank,
    plus its root unit and two layers gathered while it scores (as the reference)."""
    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        reward={"model": "Qwen/Qwen2.5-0.5B-Instruct"},
        placement={"strategy": "fsdp", "reward": "colocate"},
        train={"micro_batch": 2, "precision": "bf16"},
    )
    code, out = run_plan(capsys, job, "4x24GB", fmt="json")
    d = json.loads(out)["plan"]["devices"][0]["processes"][0]
    assert code == 0 and "reward model" in d["role"]
    n = 494_032_768 + 896  # 24 layers; root: embeddings 151936 x 896, final norm, score head
    root = 151936 * 896 + 896 + 896
    layer = (n - root) // 24
    assert d["detail"]["reward_model_weights"] == 2 * math.ceil(n / 4)
    assert d["detail"]["reward_model_gathered"] == 2 * (root + 2 * layer)


def test_bad_format_and_overhead_setting(capsys):
    code = plan_command(GSPO, [], "3x16GB", "table", {"GPUFLEET_PLAN_OVERHEAD": "lots"})
    out = capsys.readouterr()
    assert code == 2 and "GPUFLEET_PLAN_OVERHEAD='lots' is not a size" in out.err and "Fix:" in out.err
    assert len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err
    assert plan_command(GSPO, [], "3x16GB", "table", {"GPUFLEET_PLAN_OVERHEAD": "0.5GB"}) == 0


def test_train_applies_the_auto_choice(tmp_path):
    """`gpufleet train` turns the planner's auto choice into the placement it launches (before launch)."""
    from gpufleet.verbs.train import _auto_placement

    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-1.5B-Instruct"},
        algorithm={"beta": 0.04},
        train={"per_device_batch": 8, "micro_batch": 1},
        rollout={"max_prompt_length": 256, "max_completion_length": 256},
    )
    r = load_job(job, [], {})
    auto = _auto_placement(r, parse_gpu_spec("4x40GB"), {})
    assert auto == (Change("placement.reference", [3]),)
    assert _auto_placement(r, parse_gpu_spec("4x80GB"), {}) == ()
    assert _auto_placement(r, parse_gpu_spec("cpu"), {}) == ()
    # applying the change is the same as giving its flag on the command line
    by_flag = load_job(job, [auto[0].flag().removeprefix("--set ")], {})
    applied = apply(r, auto)
    assert applied.job == by_flag.job and applied.sources == by_flag.sources


def test_change_flags_and_merge():
    assert Change("model.gradient_checkpointing", True).flag() == "--set model.gradient_checkpointing=true"
    assert Change("placement.policy", [0, 1]).flag() == "--set placement.policy=0,1"
    assert Change("placement.policy", [0, 1]) == Change("placement.policy", (0, 1))
    a = changes({"placement.strategy": "fsdp", "train.micro_batch": 4})
    merged = merge(a, [Change("train.micro_batch", 2)], [Change("model.gradient_checkpointing", True)])
    assert [c.flag() for c in merged] == [
        "--set placement.strategy=fsdp",
        "--set train.micro_batch=2",
        "--set model.gradient_checkpointing=true",
    ]


def test_overhead_setting_is_named_by_check(capsys):
    r = load_job(GSPO, [], {})
    env = {"GPUFLEET_PLAN_OVERHEAD": "banana"}
    problems, _ = run_checks(r, parse_gpu_spec("3x16GB"), env)
    (p,) = [p for p in problems if p.extra.get("rule") == "fit"]
    assert p.severity == "error" and p.field == "GPUFLEET_PLAN_OVERHEAD"
    assert "'banana' is not a size" in p.why and "GPUFLEET_PLAN_OVERHEAD=1.5GB" in p.fix


def test_an_env_jobs_largest_length_is_its_episode_budget(tmp_path):
    """An env job trains prompt + episode tokens: its length row is env.max_episode_tokens (the field that
    moves the plan), at the edge as the others; rollout.max_completion_length is not read there."""
    job = write_job(
        tmp_path,
        model={"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        env={"name": "builtin:keys", "max_episode_tokens": 64},
        train={"per_device_batch": 8},
        rollout={"max_prompt_length": 128},
    )
    r = load_job(job, [], {})
    hw = parse_gpu_spec("1x24GB")
    models = load_models(r, {})
    by_field = {x.field: x for x in largest_that_fits(r, hw, {}, models)}
    assert "rollout.max_completion_length" not in by_field
    row = by_field["env.max_episode_tokens"]
    assert row.current == 64 and row.largest

    def comfortable(value):
        plan, _ = make_plan(apply(r, changes({"env.max_episode_tokens": value})), hw, {}, models)
        return plan.comfortable

    assert comfortable(row.largest) and not comfortable(row.largest + 1)
