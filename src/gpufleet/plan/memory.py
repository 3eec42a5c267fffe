"""Bytes of one policy rank's training state and of one training micro-batch: pure arithmetic, no torch.

Everything here is a function of the architecture numbers in config.json (`shape.Arch`), the dtypes the
trainer uses (`Precision`) and the sizes of one step (micro-batch, prompt and completion tokens). The
numbers describe what gpufleet's own trainer allocates (src/gpufleet/rl), and tests/test_plan_measure.py
holds them against tensors counted on the CPU. Rollout and scoring (no-grad forwards): `inference.py`.

Training state per policy rank (`train_state_bytes`)
    What our trainer does (`gpufleet.rl.precision.model_dtype`): `model.dtype: auto` loads float32 weights and
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
      for the completion positions only, and no logits: for the families in `FUSED_LOGPROB_FAMILIES`
      `sequence_logprobs` applies the head chunk by chunk (`engine/loghead.py`), each chunk of about 2**24
      logits recomputed in backward, so logits exist for one chunk at a time (in the compute dtype, its
      fp32 temporaries, Gemma2's soft-capped copy). Other families (GPT-2) get the completion's logits
      whole (`logits_to_keep = T + 1`): (b, T + 1, vocab) in the compute dtype kept for the checkpointed
      per-chunk log-softmax, plus their gradient in backward.
    * Under autocast with fp32 weights, each Linear keeps the bf16 copy of its weight for backward:
      2 bytes x every matmul weight (including the LM head), alive from forward to backward.
    * The backward's working set includes the LM head weight's gradient summed over the log-prob
      chunks (vocab x hidden, compute dtype; none with a LoRA adapter's frozen head): one buffer beside
      a chunk's working set without autocast (`engine/loghead.py`'s `_SummedHead`); under autocast each
      chunk's gradient meets autograd's running sum and the first sum is made out of place, so three
      exist at once (one with a single chunk). Before the buffer an H200 measured the three in fp32:
      Qwen2.5-0.5B's train phase 1.62 GiB, planned 1.62.
    * Gradient checkpointing (`activation_checkpointing_enable`): each layer keeps only its input
      (h values per token in the residual dtype), the boolean mask is kept once, and backward recomputes
      one layer at a time (Korthikanti's full recomputation: 2sbhL + one layer).

    The padded length is used throughout: s = max_prompt_length + max_completion_length, the worst
    case of a batch (the trainer pads prompts on the left and completions on the right).

Not modelled: the `step` counters of AdamW, allocator fragmentation (the planner asks for 10% free
instead), CUDA graphs, and memory other processes hold on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gpufleet.plan.shape import Arch, ParamCount

GiB = 1024**3


DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

LOGPROB_CHUNK_ELEMENTS = 1 << 24
"""Mirror of `gpufleet.engine.logprobs._CHUNK_ELEMENTS` (a test keeps them equal): logits per log-prob chunk."""

FUSED_LOGPROB_FAMILIES = frozenset({"llama", "gemma", "gemma2"})
"""Families whose classes are in `gpufleet.engine.loghead.FUSED_CLASSES` (a test keeps them in step): their
log-probs never hold the whole batch's logits."""


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
    """The policy's dtypes as our trainer sets them up (`gpufleet.rl.precision.model_dtype` and `autocast_for`).

    `model_dtype`: config/precision.py `weights_dtype` (auto -> float32 master weights; a LoRA base in the
    compute dtype); `train.precision: bf16|fp16` -> autocast.
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
    adapter: int | None = None,
) -> dict[str, int]:
    """Weights, gradients and AdamW states of one policy rank (see the module docstring).

    `shards`: the FSDP degree (1 for DDP / one process). `ddp_buckets`: DDP's gradient buckets.
    `fused_adamw`: `rl/optim.py` uses the fused AdamW kernel (in place, no temporary) for plain
    parameters; FSDP2's DTensors take the foreach path, whose step allocates one shard-sized temporary.
    `adapter`: a LoRA run's adapter parameters (models/lora.py): the base weights are frozen, so
    gradients, AdamW states and DDP's buckets exist for the adapter alone (weights: base + adapter); the
    adapter is float32 whatever the base's dtype (peft's autocast_adapter_dtype).
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    local = math.ceil(params.total / shards)
    b = precision.weight_bytes
    if adapter is None:
        trained, t, buckets = local, b, params.total
    else:  # peft keeps the adapter in float32 (autocast_adapter_dtype) beside a bf16/fp16 base
        trained, t, buckets = math.ceil(adapter / shards), DTYPE_BYTES["float32"], adapter
    return {
        "weights": local * b + (0 if adapter is None else trained * t),
        "grads": trained * t,
        "optimizer": 2 * trained * t,
        "ddp_buckets": buckets * t if ddp_buckets and shards == 1 else 0,
        "optimizer_step": 0 if fused_adamw else trained * t,
    }


def with_adapter(
    acts: Activations, adapter: int, adapted_width: int, tokens: int, p: Precision
) -> Activations:
    """A LoRA policy's activations (measured in tests/test_plan_measure_modes.py): under autocast the
    float32 adapter's weights get compute-dtype copies kept for backward (`adapter` parameters), and each
    adapted projection keeps its r-wide A output per token (`adapted_width` = r x adapted projections,
    summed over layers). In fp32 no extra is counted: a frozen base keeps fewer inputs for weight
    gradients, which measured about as much as the A outputs (within 7% of the full model's count)."""
    if p.compute_bytes >= DTYPE_BYTES["float32"]:
        return acts
    copies = adapter * p.compute_bytes
    saved = 0 if acts.checkpointing else tokens * adapted_width * p.compute_bytes
    return replace(acts, layers=acts.layers + saved, weight_copies=acts.weight_copies + copies)


def _norm_bytes(
    width: int, in_bytes: int, consumers: int, compute_bytes: int, gemma: bool, fused: bool = False
) -> int:
    """Bytes per row an RMSNorm keeps for backward, plus what its consumers keep of its output.

    Llama/Qwen RMSNorm: fp32 x (or its fp32 copy), rsqrt, the normalised x in the input dtype; `fused`
    (engine/fusedlayers.py): x and rsqrt only. Gemma RMSNorm: the normalised x stays fp32 (scaled by 1 +
    weight in fp32). The output is kept once when the consumers use it as is, or once per consumer when
    autocast casts it (a Linear under autocast keeps its own low-precision copy).
    """
    saved = 4 * width + 4 + (0 if fused else (4 if gemma else in_bytes) * width)
    if consumers:
        saved += width * in_bytes if in_bytes == compute_bytes else consumers * width * compute_bytes
    return saved


def _layer_bytes_per_token(arch: Arch, p: Precision, seq: int, fused: bool = False) -> int:
    """Bytes one decoder layer keeps for backward, per token, at padded length `seq` (no checkpointing);
    `fused`: with the CPU's fused norms and SwiGLU (see `train_activations`)."""
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
    total = _norm_bytes(h, r, 3, a, gemma, fused)  # input norm -> q, k, v
    if arch.qk_norm:  # Qwen3: RMSNorm over each head of q and k (input: projection output, dtype a)
        total += _norm_bytes(q, a, 0, a, False, fused) + 4 * (n - 1)
        total += _norm_bytes(arch.kv_dim, a, 0, a, False, fused) + 4 * (arch.num_kv_heads - 1)
    # q, k and v (expanded to all heads by repeat_kv; a single KV head expands as a view; fused: SDPA
    # takes the key/value heads as they are), the output (= o_proj input).
    kv = arch.kv_dim if arch.num_kv_heads == 1 or fused else q
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
        total += _norm_bytes(h, r, 2, a, gemma, fused)  # post-attention norm -> gate, up
    # gate out, act(gate) (not when fused), up out, product (= down_proj input)
    total += (3 if fused else 4) * inter * a
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
    """(b, T+1, vocab) logits kept for the checkpointed log-softmax chunks (x2 with soft-capping); 0 where
    the head runs chunk by chunk (`FUSED_LOGPROB_FAMILIES`)."""
    weight_copies: int
    """Low-precision copies of the decoder layers' matmul weights made by autocast (saved for backward;
    with gradient checkpointing only cached until the end of the forward)."""
    head_weight_copy: int
    """Autocast's copy of the LM head weight (saved for backward, checkpointing or not)."""
    loss: int
    """Per-token log-probs, entropies and loss terms (fp32, b x T)."""
    backward: int
    """Extra working memory during backward: logits' gradient and one log-softmax chunk (or, chunk by
    chunk, one chunk's recomputed logits and their gradient), the LM head weight's gradients being summed
    over the chunks, or the recomputed layer and the layer gradients, whichever is larger."""
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


def chunk_elements(batch: int, positions: int, vocab: int) -> int:
    """Logits in one log-softmax chunk of `sequence_logprobs`."""
    chunk = max(1, LOGPROB_CHUNK_ELEMENTS // max(1, batch * vocab))
    return batch * min(chunk, positions) * vocab


def logits_bytes(
    arch: Arch, compute_bytes: int, batch: int, completion_tokens: int, fused: bool = True
) -> tuple[int, int]:
    """(kept, chunk): the logits `sequence_logprobs` holds whole for the batch (0 where the head runs
    chunk by chunk) and those of one chunk in the compute dtype (x2 with Gemma2's soft-capping).
    `fused`: False with `GPUFLEET_FUSED_LOGPROBS=0`, which gives every family the whole logits."""
    copies = 2 if arch.final_logit_softcap else 1
    chunk = chunk_elements(batch, completion_tokens, arch.vocab_size) * compute_bytes * copies
    if fused and arch.family in FUSED_LOGPROB_FAMILIES:
        return 0, chunk
    return batch * (completion_tokens + 1) * arch.vocab_size * compute_bytes * copies, chunk


def inference_layer_bytes_per_token(arch: Arch, p: Precision, seq: int) -> int:
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
    fused_cpu: bool = False,
    head_trained: bool = True,
    fused_logprobs: bool = True,
) -> Activations:
    """Activations of one training micro-batch of `batch` sequences (see the module docstring).
    `fused_cpu`: on a CPU, where a Llama-family model computing in fp32 without checkpointing runs its
    norms, SwiGLU and attention fused (engine/fusedlayers.py), which keep less. Counted at full length: its
    rows packed (engine/packing.py) keep only their tokens', no more than this. `head_trained`: the LM head's
    weight gets a gradient (not with a LoRA adapter's frozen base). `fused_logprobs`: False with
    `GPUFLEET_FUSED_LOGPROBS=0` (`logits_bytes`)."""
    if batch < 1 or prompt_tokens < 1 or completion_tokens < 1:
        raise ValueError(
            f"batch, prompt_tokens and completion_tokens must be >= 1, got {batch}, {prompt_tokens}, {completion_tokens}"
        )
    b, s, c = batch, prompt_tokens + completion_tokens, completion_tokens + 1
    h, v, a, r = arch.hidden_size, arch.vocab_size, p.compute_bytes, p.weight_bytes
    fused = fused_cpu and arch.family == "llama" and p.compute == "float32" and not checkpointing
    layer = _layer_bytes_per_token(arch, p, s, fused) * b * s
    tokens = b * s
    if arch.family == "gpt2":
        shared = tokens * 16 + (tokens * h * r if arch.embd_dropout else 0)  # ids, positions, dropout
        head = tokens * (r * h + 8) + b * c * h * a
        mask = b * s * s  # the boolean mask kept by checkpointing
    else:
        shared = tokens * 8 + 2 * tokens * arch.head_dim * r  # token ids; rotary cos and sin
        gemma = arch.family in ("gemma", "gemma2")
        head = tokens * _norm_bytes(h, r, 0, a, gemma, fused) + b * c * h * a
        # The mask checkpointing keeps: SDPA's boolean one; Gemma2's eager float masks (full + sliding).
        mask = b * s * s * (2 * r if arch.family == "gemma2" else 1)
    if checkpointing:  # each layer keeps its input; the mask, rotary tables, position ids are kept once
        layers = arch.num_layers * tokens * h * r
        shared += mask + (0 if arch.family == "gpt2" else tokens * 8)
    else:
        layers = arch.num_layers * layer
    logits, chunk_logits = logits_bytes(arch, a, b, completion_tokens, fused_logprobs)
    weight_copies = (params.matmul - params.head_matmul) * a if p.autocast else 0
    head_weight_copy = params.head_matmul * a if p.autocast else 0
    loss = 12 * b * completion_tokens * 4
    chunk = chunk_elements(b, completion_tokens, v)
    # whole logits: their gradient and the recomputed chunk; chunk by chunk: one chunk's logits, their
    # gradient and the head input's gradient (b, T + 1, h)
    whole = 2 * logits + 4 * chunk * 4 if logits else 2 * chunk_logits + 4 * chunk * 4 + b * c * h * a
    layer_grad = tokens * (2 * h * r + 3 * arch.intermediate_size * a) + (layer if checkpointing else 0)
    # The head weight's gradient (vocab x hidden) over the chunks: without autocast summed in one buffer
    # (engine/loghead.py's _SummedHead), beside each chunk's working set; under autocast each chunk's meets
    # autograd's running sum, the first sum made out of place: three at once (measured on an H200 before
    # the buffer, fp32: 1.52 GiB of a 1.62 GiB backward for Qwen2.5-0.5B; bf16 autocast as planned).
    weight_grad = params.head_matmul * a if head_trained and not logits else 0
    chunks = 1 if logits else math.ceil(completion_tokens / max(1, chunk // max(1, b * v)))
    summed = weight_grad if not p.autocast else 0
    logits_grad = whole + summed
    head_grad = (3 if chunks > 1 else 1) * (weight_grad - summed) + b * c * h * a
    return Activations(
        layers=layers,
        shared=shared,
        head=head,
        logits=logits,
        weight_copies=weight_copies,
        head_weight_copy=head_weight_copy,
        loss=loss,
        backward=max(logits_grad, layer_grad, head_grad),
        checkpointing=checkpointing,
    )


def gib(n: int | float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GiB:.2f}"
