"""Bytes per role, predicted from a model's config.json: pure arithmetic, no torch import.

Everything here is a function of the architecture numbers in config.json (`Arch`), the dtypes the
trainer uses (`Precision`) and the sizes of one step (micro-batch, prompt and completion tokens). The
numbers describe what gpufleet's own trainer allocates (src/gpufleet/rl), and tests/test_plan_measure.py
holds them against tensors counted on the CPU.

Parameters (`count_parameters`)
    Exact for the decoder families below, from config.json alone: token embeddings (+ learned
    positions for GPT-2), per layer q/k/v/o projections (GQA: k and v have `num_key_value_heads x
    head_dim` outputs; Qwen2 has q/k/v biases, Llama `attention_bias` puts biases on q/k/v/o, GPT-2 has
    biases everywhere), Qwen3's per-head q/k RMSNorms, the MLP (SwiGLU: gate, up, down of
    `intermediate_size`; GPT-2: fc, proj of `n_inner` or 4h), the norms (RMSNorm: a weight; LayerNorm:
    weight and bias; Gemma2 has four per layer), the final norm, and the LM head unless
    `tie_word_embeddings`. A reward model (sequence classification) has a `num_labels x hidden` score
    head instead of the LM head.

Training state per policy rank (`train_state_bytes`)
    What our trainer does (rl/trainer.py `_dtype`): `model.dtype: auto` loads float32 weights and
    `train.precision: bf16|fp16` runs the forward under `torch.autocast`, so the fp32 weights *are* the
    master weights:  weights 4 + grads 4 + AdamW exp_avg 4 + exp_avg_sq 4 = 16 bytes per parameter.
    `model.dtype: bfloat16` (or float16) stores the weights in bf16 with **no** fp32 master copy (the
    trainer creates none): weights 2 + grads 2 + AdamW states 2 x 2 (torch.optim.AdamW keeps its states
    in the parameter's dtype) = 8 bytes per parameter. FSDP divides all three by the shard degree (the
    number of policy ranks). DDP with more than one rank adds its reducer buckets, a second copy of the
    gradients (`gradient_as_bucket_view=False`, the default). AdamW's `step` counters (4 bytes per
    parameter tensor) are not counted. `rl/optim.py` runs the fused AdamW kernel (in place) on plain
    parameters; on FSDP2's DTensors it falls back to foreach, whose step allocates one shard-sized
    temporary (`_foreach_sqrt(exp_avg_sq)`): the "optimizer step" phase.

Activations of one micro-batch (`train_activations`)
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198, section 4.1) count, per layer, the tensors autograd keeps for backward:
    s*b*h*(34 + 5*a*s/h) bytes in fp16 with dropout (attention 11sbh + 5as^2b, MLP 19sbh, two
    LayerNorms 4sbh), and 2sbh per layer with full recomputation. We keep their accounting (one term per
    saved tensor) and adapt each term to the models we train, in elements per token, times its dtype:

    * RMSNorm (computed in fp32): its input x (4 bytes: the fp32 copy when x is bf16), the normalised x,
      rsqrt (4 bytes), and its output once per consumer under autocast (each Linear casts its own bf16
      copy: 3 for q/k/v, 2 for gate/up), or once when no cast is needed.
    * Attention with a padding mask (SDPA memory-efficient / flash kernels, no s^2 probabilities): q,
      k and v after `repeat_kv` (GQA is expanded to `num_attention_heads` when a mask is given),
      the output (= o_proj's input), the fp32 logsumexp (1 per head), and the additive mask SDPA builds
      from the boolean one in every layer (s per token). Qwen3 adds its q/k norms. Gemma2 (logit
      soft-capping) uses eager attention: tanh(scores) and fp32 softmax, 2 x heads x s per token.
    * MLP (SwiGLU / GeGLU): gate output (for SiLU/GELU backward), its activation, the up output and
      their product (= down_proj's input): 4 x intermediate_size instead of the 19sbh of GeLU with 4h.
    * No dropout (Llama-family configs have attention_dropout 0); GPT-2 adds its dropout masks.
    * Outside the layers: the rotary cos/sin tables, the token ids, the final norm, the LM head's input
      for the completion positions only, and the logits: `sequence_logprobs` asks for the completion's
      logits (`logits_to_keep = T + 1`), shape (b, T + 1, vocab) in the compute dtype, kept alive for
      the checkpointed per-chunk log-softmax (fp32 temporaries over the vocabulary exist for one chunk
      of about 2**24 elements at a time). Gemma2's final soft-capping keeps a second logits-sized
      tensor.
    * Under autocast with fp32 weights, each Linear keeps the bf16 copy of its weight for backward:
      2 bytes x every matmul weight (including the LM head), alive from forward to backward.
    * Gradient checkpointing (`activation_checkpointing_enable`): each layer keeps only its input
      (h values per token in the residual dtype), the boolean mask is kept once, and backward recomputes
      one layer at a time (Korthikanti's full recomputation: 2sbhL + one layer).

    The padded length is used throughout: s = max_prompt_length + max_completion_length, the worst
    case of a batch (the trainer pads prompts on the left and completions on the right).

KV cache of the rollout (`rollout_bytes`)
    2 (k and v) x layers x kv_heads x head_dim x bytes x tokens x sequences, with tokens = prompt +
    completion and sequences = per_device_batch x steps_per_generation (a rank generates its whole
    generation batch at once). `generate` runs outside autocast, so bytes = the weights' dtype. Plus the
    prefill's working set (one layer over all prompts), the sampler's float temporaries over the
    vocabulary, and the fast decoder's fused q/k/v + gate/up weights (at most 1 GiB; rl/fastdecode.py).

Reference / reward models (`logprob_scoring_bytes`, `reward_model_bytes`)
    Inference weights (reference: the policy's dtype, as the trainer loads it; reward model: its
    checkpoint dtype, which is what `from_pretrained` picks in transformers 5) plus one forward's
    working set: the largest layer's temporaries for a micro-batch, or the logits and one log-softmax
    chunk, whichever is larger.

Not modelled: the `step` counters of AdamW, allocator fragmentation (the planner asks for 10% free
instead), CUDA graphs, and memory other processes hold on the device.

Framework overhead
    CUDA context, cuBLAS/NCCL workspaces and allocator slack: `DEFAULT_GPU_OVERHEAD` (1 GiB) per process
    on a GPU, `DEFAULT_CPU_OVERHEAD` per process on the CPU; override with GPUFLEET_PLAN_OVERHEAD=1.5GB.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GiB = 1024**3
MiB = 1024**2

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

LOGPROB_CHUNK_ELEMENTS = 1 << 24
"""Mirror of `gpufleet.rl.rollout._CHUNK_ELEMENTS` (a test keeps them equal): logits per log-prob chunk."""

REWARD_MODEL_BATCH = 16
"""Texts per reward-model forward (`gpufleet.rl.rewards.RewardModel` batch_size)."""

DEFAULT_GPU_OVERHEAD = 1 * GiB
"""Per process on a GPU: CUDA context (~0.5 GiB), cuBLAS and NCCL workspaces, caching-allocator slack."""

DEFAULT_CPU_OVERHEAD = 3 * GiB // 4
"""Per process on the CPU: the Python interpreter with torch and transformers imported."""

OVERHEAD_ENV = "GPUFLEET_PLAN_OVERHEAD"
"""Setting (not a job field) that overrides the per-process overhead, e.g. `1.5GB` or `512MB`."""

SUPPORTED_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gpt2": "gpt2",
}
"""config.json `model_type` -> the family whose formulas apply."""

# transformers' config-class defaults, for keys a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"tie_word_embeddings": False, "num_key_value_heads": 8},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"tie_word_embeddings": False, "attention_bias": False, "head_dim": 128},
    "gemma": {"tie_word_embeddings": True, "attention_bias": False, "head_dim": 256},
    "gemma2": {
        "tie_word_embeddings": True,
        "attention_bias": False,
        "head_dim": 256,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gpt2": {
        "tie_word_embeddings": True,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "activation_function": "gelu_new",
    },
}


class UnsupportedModel(ValueError):
    """The memory model has no formulas for this config.json (the message says which field)."""


# ------------------------------------------------------------------------------------ architecture


@dataclass(frozen=True)
class Arch:
    """The architecture numbers the formulas use, read from config.json."""

    model_type: str
    family: str
    """`llama` (Llama, Mistral, Qwen2, Qwen3), `gemma`, `gemma2` or `gpt2`."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_positions: int | None = None
    checkpoint_dtype: str | None = None
    """`torch_dtype`/`dtype` of the checkpoint (what a reward model loads in)."""
    final_logit_softcap: bool = False
    eager_attention: bool = False
    """Attention with explicit probabilities (Gemma2 soft-capping, GPT-2 attention dropout)."""
    resid_dropout: bool = False
    embd_dropout: bool = False
    gelu_new: bool = False
    num_labels: int = 1

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _int(cfg: Mapping[str, Any], *names: str, default: int | None = None) -> int:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if default is not None:
        return default
    raise UnsupportedModel(f"config.json has no positive integer {' / '.join(names)}")


def arch_from_config(raw: Mapping[str, Any]) -> Arch:
    """The `Arch` of a config.json dict; UnsupportedModel names the field or model_type it cannot read."""
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw
    model_type = str(cfg.get("model_type") or raw.get("model_type") or "")
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type or '(missing)'!r} has no memory formulas "
            f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
        )
    family = SUPPORTED_TYPES[model_type]
    d = {**_DEFAULTS.get(model_type, {}), **{k: v for k, v in cfg.items() if v is not None}}
    dtype = raw.get("dtype") or raw.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = str(dtype).removeprefix("torch.") if dtype else None
    labels = d.get("id2label")
    num_labels = _int(d, "num_labels", default=len(labels) if isinstance(labels, Mapping) and labels else 1)
    if family == "gpt2":
        h = _int(d, "n_embd", "hidden_size")
        heads = _int(d, "n_head", "num_attention_heads")
        return Arch(
            model_type=model_type,
            family=family,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=h,
            num_layers=_int(d, "n_layer", "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=h // heads,
            intermediate_size=_int(d, "n_inner", default=4 * h),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            max_positions=_int(d, "n_positions", "max_position_embeddings"),
            checkpoint_dtype=dtype,
            eager_attention=float(d.get("attn_pdrop") or 0) > 0,
            resid_dropout=float(d.get("resid_pdrop") or 0) > 0,
            embd_dropout=float(d.get("embd_pdrop") or 0) > 0,
            gelu_new=str(d.get("activation_function")) == "gelu_new",
            num_labels=num_labels,
        )
    h = _int(d, "hidden_size")
    heads = _int(d, "num_attention_heads")
    head_dim = _int(d, "head_dim", default=h // heads)
    attention_bias = bool(d.get("attention_bias", False))
    return Arch(
        model_type=model_type,
        family=family,
        vocab_size=_int(d, "vocab_size"),
        hidden_size=h,
        num_layers=_int(d, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int(d, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        intermediate_size=_int(d, "intermediate_size"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(d.get("mlp_bias", False)) and model_type == "llama",
        qk_norm=model_type == "qwen3",
        max_positions=d.get("max_position_embeddings")
        if isinstance(d.get("max_position_embeddings"), int)
        else None,
        checkpoint_dtype=dtype,
        final_logit_softcap=family == "gemma2" and bool(d.get("final_logit_softcapping")),
        eager_attention=family == "gemma2" and bool(d.get("attn_logit_softcapping")),
        num_labels=num_labels,
    )


# -------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model, by part (tied LM heads counted once, in `embedding`)."""

    embedding: int
    """Token embeddings (+ learned position embeddings)."""
    per_layer: int
    num_layers: int
    final_norm: int
    head: int
    """LM head (0 when tied to the embeddings) or a classifier's score head."""
    matmul: int
    """Weights of every matrix multiply, the LM head included (tied or not): what autocast copies."""
    head_matmul: int
    """Weights of the LM head's (or score head's) matmul, tied or not."""
    largest_matmul: int
    """The largest single matmul weight (autocast casts one at a time in no-grad inference)."""
    tensors: int
    """Number of parameter tensors."""

    @property
    def layers(self) -> int:
        return self.per_layer * self.num_layers

    @property
    def root(self) -> int:
        """Parameters outside the decoder layers (FSDP's root unit: embeddings, final norm, head)."""
        return self.embedding + self.final_norm + self.head

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.head


def count_parameters(arch: Arch, head: str = "causal_lm") -> ParamCount:
    """Exact parameter count of `AutoModelForCausalLM` (head="causal_lm") or of
    `AutoModelForSequenceClassification` (head="classifier") built from the config."""
    h, inter, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    if arch.family == "gpt2":
        attn = (h * 3 * h + 3 * h) + (h * h + h)
        mlp = (h * inter + inter) + (inter * h + h)
        norms = 2 * (2 * h)
        per_layer = attn + mlp + norms
        embedding = v * h + (arch.max_positions or 0) * h
        final_norm = 2 * h
        layer_matmul = 3 * h * h + h * h + 2 * h * inter
        largest = max(3 * h * h, h * inter)
        tensors_per_layer = 12
        final_tensors = 2
        emb_tensors = 2
    else:
        q, kv = arch.q_dim, arch.kv_dim
        attn = h * q + 2 * h * kv + q * h
        if arch.qkv_bias:
            attn += q + 2 * kv
        if arch.o_bias:
            attn += h
        if arch.qk_norm:
            attn += 2 * arch.head_dim
        mlp = 3 * h * inter + ((2 * inter + h) if arch.mlp_bias else 0)
        norms_per_layer = 4 if arch.family == "gemma2" else 2
        per_layer = attn + mlp + norms_per_layer * h
        embedding = v * h
        final_norm = h
        layer_matmul = h * q + 2 * h * kv + q * h + 3 * h * inter
        largest = max(h * q, h * inter)
        tensors_per_layer = (
            7
            + norms_per_layer
            + (3 if arch.qkv_bias else 0)
            + (1 if arch.o_bias else 0)
            + (2 if arch.qk_norm else 0)
            + (3 if arch.mlp_bias else 0)
        )
        final_tensors = 1
        emb_tensors = 1
    if head == "classifier":
        head_params = arch.num_labels * h
        head_matmul = head_params
        head_tensors = 1
    elif head == "causal_lm":
        head_params = 0 if arch.tie_word_embeddings else v * h
        head_matmul = v * h
        head_tensors = 0 if arch.tie_word_embeddings else 1
    else:
        raise ValueError(f"head must be 'causal_lm' or 'classifier', got {head!r}")
    return ParamCount(
        embedding=embedding,
        per_layer=per_layer,
        num_layers=arch.num_layers,
        final_norm=final_norm,
        head=head_params,
        matmul=layer_matmul * arch.num_layers + head_matmul,
        head_matmul=head_matmul,
        largest_matmul=max(largest, head_matmul),
        tensors=emb_tensors + tensors_per_layer * arch.num_layers + final_tensors + head_tensors,
    )


# ------------------------------------------------------------------------------------------ dtypes


@dataclass(frozen=True)
class Precision:
    """How a model is stored and computed."""

    weights: str
    """dtype of the parameters (and of their gradients and AdamW states)."""
    compute: str
    """dtype of matmul outputs (activations): the autocast dtype, or the weights' dtype."""

    def __post_init__(self) -> None:
        for name in (self.weights, self.compute):
            if name not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weights]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def autocast(self) -> bool:
        """Autocast to a lower precision than the weights: casts of weights and activations."""
        return self.compute_bytes < self.weight_bytes


def training_precision(model_dtype: str, train_precision: str) -> Precision:
    """The policy's dtypes as our trainer sets them up (rl/trainer.py `_dtype` and `autocast_for`).

    `model.dtype: auto` -> float32 weights (master weights); `train.precision: bf16|fp16` -> autocast.
    """
    weights = "float32" if model_dtype == "auto" else model_dtype
    compute = {"fp32": weights, "bf16": "bfloat16", "fp16": "float16"}.get(train_precision)
    if compute is None:
        raise ValueError(f"train.precision must be fp32, bf16 or fp16, got {train_precision!r}")
    if DTYPE_BYTES[compute] > DTYPE_BYTES[weights]:
        compute = weights  # bf16 weights under "fp32" precision compute in bf16
    return Precision(weights, compute)


# --------------------------------------------------------------------------------- training state


def train_state_bytes(
    params: ParamCount,
    precision: Precision,
    *,
    shards: int = 1,
    ddp_buckets: bool = False,
    fused_adamw: bool = True,
) -> dict[str, int]:
    """Weights, gradients and AdamW states of one policy rank (see the module docstring).

    `shards`: the FSDP degree (1 for DDP / one process). `ddp_buckets`: DDP's gradient buckets.
    `fused_adamw`: `rl/optim.py` uses the fused AdamW kernel (in place, no temporary) for plain
    parameters; FSDP2's DTensors take the foreach path, whose step allocates one shard-sized temporary.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    local = math.ceil(params.total / shards)
    b = precision.weight_bytes
    return {
        "weights": local * b,
        "grads": local * b,
        "optimizer": 2 * local * b,
        "ddp_buckets": params.total * b if ddp_buckets and shards == 1 else 0,
        "optimizer_step": 0 if fused_adamw else local * b,
    }


# ----------------------------------------------------------------------------------- activations


def _norm_bytes(width: int, in_bytes: int, consumers: int, compute_bytes: int, gemma: bool) -> int:
    """Bytes per row an RMSNorm keeps for backward, plus what its consumers keep of its output.

    Llama/Qwen RMSNorm: fp32 x (or its fp32 copy), rsqrt, the normalised x in the input dtype.
    Gemma RMSNorm: the normalised x stays fp32 (scaled by 1 + weight in fp32).
    The output is kept once when the consumers use it as is, or once per consumer when autocast casts
    it (a Linear under autocast keeps its own low-precision copy).
    """
    saved = 4 * width + 4 + (4 if gemma else in_bytes) * width
    if consumers:
        saved += width * in_bytes if in_bytes == compute_bytes else consumers * width * compute_bytes
    return saved


def _layer_bytes_per_token(arch: Arch, p: Precision, seq: int) -> int:
    """Bytes one decoder layer keeps for backward, per token, at padded length `seq` (no checkpointing)."""
    h, inter, n = arch.hidden_size, arch.intermediate_size, arch.num_heads
    q = arch.q_dim
    a, r = p.compute_bytes, p.weight_bytes  # activation dtype; residual stream (embedding) dtype
    if arch.family == "gpt2":
        total = 2 * (r * h + 8)  # two LayerNorms: input, mean, rstd
        total += 2 * h * a  # c_attn and c_fc inputs
        if arch.eager_attention:  # math path: q, k, v copies; softmax, dropout mask, dropped probs
            total += 3 * q * a + 3 * n * seq * a
        else:  # fused qkv output (one storage), out, logsumexp, additive mask
            total += 3 * h * a + q * a + 4 * n + seq * a
        total += q * a  # c_proj input
        total += (5 if arch.gelu_new else 2) * inter * a  # activation saves + mlp c_proj input
        if arch.resid_dropout:
            total += 2 * h * a
        return total
    gemma = arch.family in ("gemma", "gemma2")
    total = _norm_bytes(h, r, 3, a, gemma)  # input norm -> q, k, v
    if arch.qk_norm:  # Qwen3: RMSNorm over each head of q and k (input: projection output, dtype a)
        total += _norm_bytes(q, a, 0, a, False) + 4 * (n - 1)
        total += _norm_bytes(arch.kv_dim, a, 0, a, False) + 4 * (arch.num_kv_heads - 1)
    # q, k and v (expanded to all heads by repeat_kv; a single KV head expands as a view), the output
    # (= o_proj input).
    kv = arch.kv_dim if arch.num_kv_heads == 1 else q
    total += 2 * q * a + 2 * kv * a
    if arch.eager_attention:  # Gemma2: tanh(scores) in a, fp32 softmax, its cast back to a
        total += n * seq * (a + 4 + (a if a != 4 else 0))
    else:  # SDPA: fp32 logsumexp per head, the additive mask SDPA builds in every layer
        total += 4 * n + seq * a
    if arch.family == "gemma2":
        total += _norm_bytes(h, a, 0, a, True)  # post-attention norm (input: o_proj output)
        total += _norm_bytes(h, r, 2, a, True)  # pre-feedforward norm -> gate, up
        total += _norm_bytes(h, a, 0, a, True)  # post-feedforward norm
    else:
        total += _norm_bytes(h, r, 2, a, gemma)  # post-attention norm -> gate, up
    total += 4 * inter * a  # gate out, act(gate), up out, product (= down_proj input)
    return total


@dataclass(frozen=True)
class Activations:
    """Memory of one training micro-batch beyond the weights (bytes)."""

    layers: int
    """Saved by the decoder layers (their inputs only, with gradient checkpointing)."""
    shared: int
    """Saved once per model: rotary tables, token ids, the mask kept by checkpointing, dropout masks."""
    head: int
    """Final norm and the LM head's input (completion positions)."""
    logits: int
    """(b, T+1, vocab) logits kept for the checkpointed log-softmax chunks (x2 with soft-capping)."""
    weight_copies: int
    """Low-precision copies of the decoder layers' matmul weights made by autocast (saved for backward;
    with gradient checkpointing only cached until the end of the forward)."""
    head_weight_copy: int
    """Autocast's copy of the LM head weight (saved for backward, checkpointing or not)."""
    loss: int
    """Per-token log-probs, entropies and loss terms (fp32, b x T)."""
    backward: int
    """Extra working memory during backward: logits' gradient and one log-softmax chunk, or the
    recomputed layer and the layer gradients, whichever is larger."""
    checkpointing: bool

    @property
    def saved(self) -> int:
        """What autograd keeps from forward to backward for the model call (`sequence_logprobs`)."""
        return (
            self.layers
            + self.shared
            + self.head
            + self.logits
            + self.head_weight_copy
            + (0 if self.checkpointing else self.weight_copies)
        )

    @property
    def peak(self) -> int:
        """The training phase's peak above the weights, gradients and optimizer states."""
        return self.saved + (self.weight_copies if self.checkpointing else 0) + self.loss + self.backward


def _chunk_elements(batch: int, positions: int, vocab: int) -> int:
    """Logits in one log-softmax chunk of `sequence_logprobs`."""
    chunk = max(1, LOGPROB_CHUNK_ELEMENTS // max(1, batch * vocab))
    return batch * min(chunk, positions) * vocab


def _inference_layer_bytes_per_token(arch: Arch, p: Precision, seq: int) -> int:
    """Peak temporaries of one layer in a no-grad forward, per token."""
    h, inter, q, n = arch.hidden_size, arch.intermediate_size, arch.q_dim, arch.num_heads
    a, r = p.compute_bytes, p.weight_bytes
    kv = arch.kv_dim if arch.num_kv_heads == 1 else q
    attention = 2 * q * a + 2 * kv * a + (n * seq * (a + 4 + a) if arch.eager_attention else 4 * n + seq * a)
    return 2 * h * r + 4 * h + max(3 * inter * a, attention)


def train_activations(
    arch: Arch,
    params: ParamCount,
    p: Precision,
    *,
    batch: int,
    prompt_tokens: int,
    completion_tokens: int,
    checkpointing: bool,
) -> Activations:
    """Activations of one training micro-batch of `batch` sequences (see the module docstring)."""
    if batch < 1 or prompt_tokens < 1 or completion_tokens < 1:
        raise ValueError(
            f"batch, prompt_tokens and completion_tokens must be >= 1, got {batch}, {prompt_tokens}, {completion_tokens}"
        )
    b, s, c = batch, prompt_tokens + completion_tokens, completion_tokens + 1
    h, v, a, r = arch.hidden_size, arch.vocab_size, p.compute_bytes, p.weight_bytes
    layer = _layer_bytes_per_token(arch, p, s) * b * s
    tokens = b * s
    if arch.family == "gpt2":
        shared = tokens * 16 + (tokens * h * r if arch.embd_dropout else 0)  # ids, positions, dropout
        head = tokens * (r * h + 8) + b * c * h * a
        mask = b * s * s  # the boolean mask kept by checkpointing
    else:
        shared = tokens * 8 + 2 * tokens * arch.head_dim * r  # token ids; rotary cos and sin
        gemma = arch.family in ("gemma", "gemma2")
        head = tokens * _norm_bytes(h, r, 0, a, gemma) + b * c * h * a
        # The mask checkpointing keeps: SDPA's boolean one; Gemma2's eager float masks (full + sliding).
        mask = b * s * s * (2 * r if arch.family == "gemma2" else 1)
    if checkpointing:  # each layer keeps its input; the mask, rotary tables, position ids are kept once
        layers = arch.num_layers * tokens * h * r
        shared += mask + (0 if arch.family == "gpt2" else tokens * 8)
    else:
        layers = arch.num_layers * layer
    logits = b * c * v * a * (2 if arch.final_logit_softcap else 1)
    weight_copies = (params.matmul - params.head_matmul) * a if p.autocast else 0
    head_weight_copy = params.head_matmul * a if p.autocast else 0
    loss = 12 * b * completion_tokens * 4
    chunk = _chunk_elements(b, completion_tokens, v)
    logits_grad = 2 * b * c * v * a + 4 * chunk * 4
    layer_grad = tokens * (2 * h * r + 3 * arch.intermediate_size * a) + (layer if checkpointing else 0)
    return Activations(
        layers=layers,
        shared=shared,
        head=head,
        logits=logits,
        weight_copies=weight_copies,
        head_weight_copy=head_weight_copy,
        loss=loss,
        backward=max(logits_grad, layer_grad),
        checkpointing=checkpointing,
    )


def logprob_scoring_bytes(
    arch: Arch,
    params: ParamCount,
    p: Precision,
    *,
    batch: int,
    prompt_tokens: int,
    completion_tokens: int,
    cached_weight_copies: bool,
) -> int:
    """Working memory of a no-grad `sequence_logprobs` call (reference or old log-probs) of `batch` rows.

    `cached_weight_copies`: the model's parameters require grad (the policy), so autocast caches a
    low-precision copy of every matmul weight until the autocast block ends; for the frozen reference
    it casts one weight at a time.
    """
    b, s, c = batch, prompt_tokens + completion_tokens, completion_tokens + 1
    a = p.compute_bytes
    layer = _inference_layer_bytes_per_token(arch, p, s) * b * s + b * s * s
    logits = b * c * arch.vocab_size * a * (2 if arch.final_logit_softcap else 1)
    chunk = 3 * _chunk_elements(b, completion_tokens, arch.vocab_size) * 4
    if p.autocast:
        copies = params.matmul * a if cached_weight_copies else params.largest_matmul * a
    else:
        copies = 0
    return max(layer, logits + chunk) + copies + 3 * b * completion_tokens * 4


def reward_model_bytes(arch: Arch, p: Precision, *, batch: int, tokens: int) -> int:
    """Working memory of one reward-model forward (sequence classification: no vocabulary logits)."""
    return _inference_layer_bytes_per_token(arch, p, tokens) * batch * tokens + batch * tokens * tokens


# ------------------------------------------------------------------------------------------ rollout


def kv_cache_bytes(arch: Arch, *, dtype_bytes: int, tokens: int, sequences: int) -> int:
    """2 (k, v) x layers x kv_heads x head_dim x bytes x tokens x sequences."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes * tokens * sequences


FUSE_LIMIT_BYTES = 1 << 30
"""Mirror of `gpufleet.rl.fastdecode._FUSE_LIMIT_BYTES`: the fast decoder concatenates q/k/v and
gate/up weights only when the copies take at most this much."""

FAST_DECODE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
"""model_type values `gpufleet.rl.fastdecode.FastDecoder` runs (plain float32 models only)."""


def fast_decode_copies(arch: Arch, p: Precision, *, wrapped: bool) -> int:
    """Bytes of the fused q/k/v and gate/up weights the fast decoder builds for one `generate` call
    (0 where it does not run: other families, non-float32 weights, an FSDP-wrapped policy)."""
    if wrapped or arch.model_type not in FAST_DECODE_TYPES or p.weights != "float32":
        return 0
    h = arch.hidden_size
    per_layer = h * arch.q_dim + 2 * h * arch.kv_dim + 2 * h * arch.intermediate_size
    if arch.qkv_bias:
        per_layer += arch.q_dim + 2 * arch.kv_dim
    copies = per_layer * arch.num_layers * 4
    return copies if copies <= FUSE_LIMIT_BYTES else 0


def rollout_bytes(
    arch: Arch,
    p: Precision,
    *,
    sequences: int,
    prompt_tokens: int,
    completion_tokens: int,
    weight_copies: int = 0,
) -> dict[str, int]:
    """Memory of `generate` on one policy rank: `sequences` rows sampled at once, outside autocast.

    The KV cache is counted at full length for the whole phase (the fast decoder preallocates it;
    the Hugging Face path grows it to the same size, with one layer's concatenation copy on top). Peak:
    the cache + the fast decoder's fused weights (`weight_copies`) + the larger of the prefill's
    working set and the sampler's temporaries.
    """
    w = p.weight_bytes
    full = kv_cache_bytes(arch, dtype_bytes=w, tokens=prompt_tokens + completion_tokens, sequences=sequences)
    infer = Precision(p.weights, p.weights)
    prefill = (
        _inference_layer_bytes_per_token(arch, infer, prompt_tokens) * sequences * prompt_tokens
        + sequences * prompt_tokens * prompt_tokens
    )
    sampling = sequences * arch.vocab_size * 32  # fp32 logits/temperature/probs, fp64 cdf, top-p sort
    cat_copy = full // max(arch.num_layers, 1)
    peak = full + weight_copies + max(prefill, cat_copy + sampling)
    return {
        "kv_cache": full,
        "prefill": prefill,
        "sampling": sampling,
        "decoder_weight_copies": weight_copies,
        "peak": peak,
    }


# --------------------------------------------------------------------------------------- overhead


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(g|gb|gib|m|mb|mib)?\s*$", re.I)


def overhead_bytes(env: Mapping[str, str], *, gpu: bool) -> int:
    """Per-process framework overhead: GPUFLEET_PLAN_OVERHEAD (e.g. 1.5GB, 512MB) or the default.

    Raises ValueError naming the setting when it cannot be read.
    """
    raw = env.get(OVERHEAD_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_GPU_OVERHEAD if gpu else DEFAULT_CPU_OVERHEAD
    m = _SIZE.match(raw)
    if not m:
        raise ValueError(f"{OVERHEAD_ENV}={raw!r} is not a size; write e.g. {OVERHEAD_ENV}=1.5GB or 512MB")
    unit = (m.group(2) or "g")[0].lower()
    return int(float(m.group(1)) * (GiB if unit == "g" else MiB))


def gib(n: int | float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GiB:.2f}"
