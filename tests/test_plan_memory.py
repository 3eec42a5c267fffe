"""The memory model's arithmetic: parameter counts equal the real transformers models (meta device),
known hub models match their published totals, and the byte formulas say what the docstring says."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from gpufleet.errors import UserError
from gpufleet.models.known import KNOWN_CONFIGS, known_config, lookup_config
from gpufleet.plan.inference import kv_cache_bytes
from gpufleet.plan.memory import (
    LOGPROB_CHUNK_ELEMENTS,
    GiB,
    train_activations,
    train_state_bytes,
    training_precision,
)
from gpufleet.plan.overhead import DEFAULT_GPU_OVERHEAD, overhead_bytes
from gpufleet.plan.shape import UnsupportedModel, arch_from_config, count_parameters

# Small configs covering every branch of the parameter formulas.
ARCHS: dict[str, dict] = {
    "qwen2-tied-gqa-bias": dict(
        model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "llama-untied-all-biases": dict(
        model_type="llama", vocab_size=128, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False, attention_bias=True,
        mlp_bias=True,
    ),
    "qwen3-qknorm-headdim": dict(
        model_type="qwen3", vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    ),
    "mistral-gqa": dict(
        model_type="mistral", vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2,
    ),
    "gemma-mqa": dict(
        model_type="gemma", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
    ),
    "gemma2-four-norms": dict(
        model_type="gemma2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
    "gpt2-conv1d-positions": dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "gpt2-n-inner": dict(model_type="gpt2", vocab_size=100, n_embd=48, n_layer=1, n_head=3, n_positions=64, n_inner=80),
}  # fmt: skip


def meta_count(raw: dict, head: str = "causal_lm") -> int:
    cfg = AutoConfig.for_model(**raw)
    cls = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = cls.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def meta_tensors(raw: dict) -> int:
    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return len(list(model.parameters()))


@pytest.mark.parametrize("name", ARCHS)
def test_parameter_count_equals_transformers(name):
    raw = ARCHS[name]
    counted = count_parameters(arch_from_config(AutoConfig.for_model(**raw).to_dict()))
    assert counted.total == meta_count(raw)
    assert counted.tensors == meta_tensors(raw)


@pytest.mark.parametrize("name", ["qwen2-tied-gqa-bias", "llama-untied-all-biases", "gemma2-four-norms"])
def test_reward_model_head_counts(name):
    raw = {**ARCHS[name], "num_labels": 1}
    counted = count_parameters(arch_from_config(AutoConfig.for_model(**raw).to_dict()), head="classifier")
    assert counted.total == meta_count(raw, head="classifier")


# Published totals (model cards / safetensors metadata) of the known hub models.
PUBLISHED = {
    "Qwen/Qwen2.5-0.5B-Instruct": 0.494e9,
    "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9,
    "Qwen/Qwen2.5-3B-Instruct": 3.09e9,
    "Qwen/Qwen2.5-7B-Instruct": 7.62e9,
    "Qwen/Qwen3-0.6B": 0.596e9,
    "Qwen/Qwen3-1.7B": 1.72e9,
    "meta-llama/Llama-3.2-1B-Instruct": 1.24e9,
    "meta-llama/Llama-3.1-8B-Instruct": 8.03e9,
    "mistralai/Mistral-7B-v0.1": 7.24e9,
    "mistralai/Mistral-7B-Instruct-v0.3": 7.25e9,
    "google/gemma-2-2b-it": 2.61e9,
}


@pytest.mark.parametrize("hub_id", sorted(KNOWN_CONFIGS))
def test_known_models_equal_transformers(hub_id):
    raw = KNOWN_CONFIGS[hub_id]
    assert count_parameters(arch_from_config(raw)).total == meta_count(raw)


@pytest.mark.parametrize("hub_id", sorted(PUBLISHED))
def test_known_models_match_published_totals(hub_id):
    total = count_parameters(arch_from_config(known_config(hub_id))).total
    assert abs(total / PUBLISHED[hub_id] - 1) < 0.005, total


def test_exact_totals_pinned():
    exact = {
        "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
        "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
        "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
        "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
        "mistralai/Mistral-7B-v0.1": 7_241_732_096,
        "google/gemma-2-2b-it": 2_614_341_888,
    }
    for hub_id, n in exact.items():
        assert count_parameters(arch_from_config(known_config(hub_id))).total == n


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model_type=st.sampled_from(["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2"]),
    heads=st.sampled_from([1, 2, 4, 8]),
    kv_div=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16]),
    hidden=st.sampled_from([32, 48, 64]),
    inter=st.integers(8, 200),
    layers=st.integers(1, 3),
    vocab=st.integers(10, 300),
    tie=st.booleans(),
)
def test_parameter_count_property(model_type, heads, kv_div, head_dim, hidden, inter, layers, vocab, tie):
    """Any config of the supported families, including head_dim != hidden / heads."""
    kv = max(heads // kv_div, 1)
    raw = dict(
        model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        tie_word_embeddings=tie,
    )  # fmt: skip
    assert count_parameters(arch_from_config(AutoConfig.for_model(**raw).to_dict())).total == meta_count(raw)


def test_config_defaults_follow_transformers():
    """Keys a config.json leaves out take the config class's defaults (Qwen3 head_dim 128, Gemma ties)."""
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"):
        raw = dict(
            model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1,
        )  # fmt: skip
        assert count_parameters(arch_from_config(raw)).total == meta_count(raw), model_type


def test_unsupported_model_names_the_field():
    with pytest.raises(UnsupportedModel, match="model_type 'mamba'"):
        arch_from_config({"model_type": "mamba"})
    with pytest.raises(UnsupportedModel, match="intermediate_size"):
        arch_from_config(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_attention_heads": 4,
                "vocab_size": 9,
                "num_hidden_layers": 1,
            }
        )


def test_vision_language_configs_read_text_config():
    raw = {"model_type": "llava", "text_config": dict(ARCHS["qwen2-tied-gqa-bias"])}
    assert arch_from_config(raw).hidden_size == 64


def test_lookup_prefers_builtin_then_table(tmp_path):
    raw, source = lookup_config("builtin:tiny-qwen2", {})
    assert raw["hidden_size"] == 64 and source == "builtin:tiny-qwen2"
    raw, source = lookup_config("qwen/qwen2.5-7b-instruct", {"HF_HUB_CACHE": str(tmp_path)})
    assert raw["hidden_size"] == 3584 and "known models" in source
    assert lookup_config("nobody/nothing", {"HF_HUB_CACHE": str(tmp_path)}) is None


# ------------------------------------------------------------------------------------- bytes


def test_state_bytes_per_parameter():
    params = count_parameters(arch_from_config(known_config("Qwen/Qwen2.5-7B-Instruct")))
    p32 = training_precision("auto", "bf16")  # fp32 master weights + bf16 autocast
    assert (p32.weights, p32.compute, p32.autocast) == ("float32", "bfloat16", True)
    s = train_state_bytes(params, p32)
    assert s["weights"] + s["grads"] + s["optimizer"] == 16 * params.total
    p16 = training_precision("bfloat16", "bf16")  # bf16 weights, no master copy
    assert not p16.autocast
    s16 = train_state_bytes(params, p16)
    assert s16["weights"] + s16["grads"] + s16["optimizer"] == 8 * params.total
    sharded = train_state_bytes(params, p32, shards=4)
    assert sharded["optimizer"] == 2 * 4 * -(-params.total // 4)
    assert train_state_bytes(params, p32, ddp_buckets=True)["ddp_buckets"] == 4 * params.total
    assert training_precision("bfloat16", "fp32").compute == "bfloat16"


def test_kv_cache_formula():
    arch = arch_from_config(known_config("meta-llama/Llama-3.1-8B-Instruct"))
    # 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token
    assert kv_cache_bytes(arch, dtype_bytes=2, tokens=1, sequences=1) == 128 * 1024
    assert kv_cache_bytes(arch, dtype_bytes=2, tokens=1024, sequences=8) == GiB  # 8192 tokens


def test_checkpointing_keeps_one_hidden_state_per_layer():
    arch = arch_from_config(known_config("Qwen/Qwen2.5-1.5B-Instruct"))
    params = count_parameters(arch)
    p = training_precision("auto", "fp32")
    kw = dict(batch=4, prompt_tokens=256, completion_tokens=256)
    off = train_activations(arch, params, p, checkpointing=False, **kw)
    on = train_activations(arch, params, p, checkpointing=True, **kw)
    assert on.layers == arch.num_layers * 4 * 512 * arch.hidden_size * 4
    assert on.saved < off.saved / 5
    assert on.logits == off.logits == 0  # the head runs chunk by chunk (engine/loghead.py)
    gpt2 = arch_from_config(
        dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=1024)
    )
    whole = train_activations(gpt2, count_parameters(gpt2), p, checkpointing=True, **kw)
    assert whole.logits == 4 * 257 * gpt2.vocab_size * 4


def test_chunk_size_mirrors_the_trainer():
    from gpufleet.engine import logprobs

    assert LOGPROB_CHUNK_ELEMENTS == logprobs._CHUNK_ELEMENTS


def test_fused_families_mirror_the_trainer():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from gpufleet.engine.loghead import FUSED_CLASSES
    from gpufleet.plan.memory import FUSED_LOGPROB_FAMILIES
    from gpufleet.plan.shape import SUPPORTED_TYPES

    for model_type, family in SUPPORTED_TYPES.items():
        fused = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] in FUSED_CLASSES
        assert fused == (family in FUSED_LOGPROB_FAMILIES), model_type


def test_overhead_setting():
    assert overhead_bytes({}, gpu=True) == DEFAULT_GPU_OVERHEAD
    assert overhead_bytes({"GPUFLEET_PLAN_OVERHEAD": "1.5GB"}, gpu=True) == int(1.5 * GiB)
    assert overhead_bytes({"GPUFLEET_PLAN_OVERHEAD": "512MB"}, gpu=False) == 512 * 1024**2
    with pytest.raises(UserError, match="GPUFLEET_PLAN_OVERHEAD='lots' is not a size.*Fix: set it to"):
        overhead_bytes({"GPUFLEET_PLAN_OVERHEAD": "lots"}, gpu=True)


def test_plan_modules_import_no_torch():
    code = (
        "import sys\n"
        "import gpufleet.verbs.plan, gpufleet.plan.search, gpufleet.plan.fit_rule, gpufleet.plan.memory\n"
        "from gpufleet.verbs.plan import plan_command\n"
        "code = plan_command('examples/gspo-3gpu.yaml', [], '3x16GB', 'json', {})\n"
        "assert code == 0, code\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_gradients_are_held_in_train_and_optimizer_step_only():
    """By hand: a process of weights 10, grads 4 (+ DDP buckets 4), AdamW 8, other 1. Rollout and scoring run
    without the gradients (the trainer frees them after each optimizer step), the buckets stay; train
    holds them whole after gradient accumulation, and with one micro-batch on a GPU (`single`) only what
    the backward's end holds beyond its start: max(activations 6 + working set 2, grads 4 + 2)."""
    from gpufleet.plan.build import _grads_freed
    from gpufleet.plan.loads import ProcessLoad
    from gpufleet.plan.memory import Activations

    acts = Activations(
        layers=5,
        shared=0,
        head=1,
        logits=0,
        weight_copies=0,
        head_weight_copy=0,
        loss=0,
        backward=2,
        checkpointing=False,
    )
    assert acts.peak == 8
    phases = {"train": acts.peak, "rollout": 9, "scoring": 3, "optimizer step": 1}

    def load(single: bool) -> ProcessLoad:
        return ProcessLoad("policy rank 0", 10, 4 + 4, 8, 1, phases, freed=_grads_freed(4, acts, single))

    accumulated, single = load(False), load(True)
    assert _grads_freed(4, acts, single=False) == {"rollout": 4, "scoring": 4}
    assert _grads_freed(4, acts, single=True) == {"rollout": 4, "scoring": 4, "train": 4}
    assert [accumulated.held(k) for k in phases] == [8 + 8, 9 + 4, 3 + 4, 1 + 8]
    assert [single.held(k) for k in phases] == [8 + 4, 9 + 4, 3 + 4, 1 + 8]
    assert accumulated.peak_phase == "train" and accumulated.total == 10 + 8 + 1 + 16
    assert single.peak_phase == "rollout" and single.total == 10 + 8 + 1 + 13
    # Gradients larger than the activations: the backward's end is the peak, grads + working set.
    assert _grads_freed(20, acts, single=True)["train"] == acts.peak - acts.backward == 6
    # A process without phases or gradients' schedule (a scorer) holds what it has throughout.
    assert ProcessLoad("scorer", 3, 0, 0, 1, {"scoring": 2}).total == 3 + 1 + 2


def test_plan_frees_gradients_in_rollout_and_counts_one_micro_batch_by_its_larger_end(tmp_path):
    """A real plan (Qwen2.5-0.5B's shapes on a 24 GB GPU): the rollout runs without the gradients; one
    micro-batch per step holds the larger of its two ends, several hold their sum; on a CPU the trainer
    may cut a micro-batch by length, so there the gradients stay whole in train."""
    from gpufleet.config.load import load_job
    from gpufleet.hardware import parse_gpu_spec
    from gpufleet.plan.search import make_plan

    def process(micro: int, gpus: str = "1x24GB"):
        sets = [
            "model.path=Qwen/Qwen2.5-0.5B-Instruct",
            "data.path=builtin:repeat",
            "rollout.max_prompt_length=64",
            "rollout.max_completion_length=256",
            "train.per_device_batch=16",
            f"train.micro_batch={micro}",
            f"output.dir={tmp_path}/run",
        ]
        plan, _ = make_plan(load_job(None, sets, env={}), parse_gpu_spec(gpus), {}, choose=False)
        return plan.devices[0].processes[0]

    one, four = process(16), process(4)
    grads = one.grads
    assert grads == 4 * 494_032_768  # fp32 gradients, no DDP buckets on one GPU
    for p in (one, four):
        assert p.held("rollout") == p.phases["rollout"] and p.held("scoring") == p.phases["scoring"]
        assert p.held("optimizer step") == p.phases["optimizer step"] + grads
    assert four.held("train") == four.phases["train"] + grads
    saved = one.detail["saved_activations"]
    backward = one.detail["backward_working_set"]
    assert one.held("train") == max(one.phases["train"], grads + backward)
    assert one.phases["train"] - backward >= saved  # the loss terms too
    assert one.total == one.weights + one.optimizer + one.other + max(map(one.held, one.phases))
    cpu = process(16, "cpu")
    assert cpu.held("train") == cpu.phases["train"] + cpu.grads


def test_plan_follows_the_fused_logprobs_switch(tmp_path):
    """`GPUFLEET_FUSED_LOGPROBS=0` gives the trainer the whole logits (engine/logprobs.py); the plan counts
    them then, in training and in the reference's scoring."""
    from gpufleet.config.load import load_job
    from gpufleet.hardware import parse_gpu_spec
    from gpufleet.plan.search import make_plan

    sets = ["model.path=Qwen/Qwen2.5-0.5B-Instruct", "data.path=builtin:repeat", "algorithm.beta=0.04"]
    sets += ["rollout.max_completion_length=512", f"output.dir={tmp_path}/run"]
    r = load_job(None, sets, env={})

    def process(env):
        plan, _ = make_plan(r, parse_gpu_spec("1x80GB"), env, choose=False)
        return plan.devices[0].processes[0]

    fused, whole = process({}), process({"GPUFLEET_FUSED_LOGPROBS": "0"})
    assert fused.detail["logits"] == 0
    t = r.job.train
    rows = min(t.micro_batch or t.per_device_batch, t.per_device_batch)
    assert whole.detail["logits"] == rows * 513 * 151936 * 4  # fp32 logits of T + 1 positions
    assert whole.phases["train"] > fused.phases["train"] and whole.phases["scoring"] > fused.phases["scoring"]
