"""Bytes of the no-grad forwards of one RL step: the rollout (KV cache, prefill, sampler, fast decoder)
and scoring (reference log-probs, reward model). Pure arithmetic, no torch import.

KV cache of the rollout (`rollout_bytes`)
    2 (k and v) x layers x kv_heads x head_dim x bytes x tokens x sequences, with tokens = prompt +
    completion and sequences = per_device_batch x steps_per_generation (a rank generates its whole
    generation batch at once). `generate` runs outside autocast, so bytes = the weights' dtype. Plus the
    prefill's working set (one layer over all prompts), the sampler's float temporaries over the
    vocabulary, and the fast decoder's weight copies (at most 1 GiB; engine/fastdecode.py).

Reference / reward models (`logprob_scoring_bytes`, `reward_model_bytes`)
    Inference weights (both frozen, in the compute dtype: config/precision.py `reference_dtype`,
    `reward_model_dtype`; under FSDP sharded over the policy ranks, plan/build.py) plus one forward's
    working set: the largest layer's temporaries for a micro-batch, or the logits (whole, or one chunk
    of them where the head runs chunk by chunk: `memory.logits_bytes`) and one log-softmax chunk,
    whichever is larger.
"""

from __future__ import annotations

from gpufleet.plan.memory import Precision, chunk_elements, inference_layer_bytes_per_token, logits_bytes
from gpufleet.plan.shape import Arch, ParamCount

REWARD_MODEL_BATCH = 16
"""Texts per reward-model forward (`gpufleet.rl.rewards.RewardModel` batch_size)."""

WEIGHT_BUCKET_BYTES = 64 * 2**20
"""A weight push to a rollout rank travels in flat buckets of at most this many bytes (rl/rollouts.py)."""


def logprob_scoring_bytes(
    arch: Arch,
    params: ParamCount,
    p: Precision,
    *,
    batch: int,
    prompt_tokens: int,
    completion_tokens: int,
    cached_weight_copies: bool,
    fused_logprobs: bool = True,
) -> int:
    """Working memory of a no-grad `sequence_logprobs` call (reference or old log-probs) of `batch` rows.

    `cached_weight_copies`: the model's parameters require grad (the policy), so autocast caches a
    low-precision copy of every matmul weight until the autocast block ends; for the frozen reference
    it casts one weight at a time. `fused_logprobs`: False with `GPUFLEET_FUSED_LOGPROBS=0` (the whole
    logits, `memory.logits_bytes`).
    """
    b, s = batch, prompt_tokens + completion_tokens
    a = p.compute_bytes
    layer = inference_layer_bytes_per_token(arch, p, s) * b * s + b * s * s
    kept, chunk_logits = logits_bytes(arch, a, b, completion_tokens, fused_logprobs)
    logits = kept or chunk_logits
    # one chunk's float32 logits and logsumexp's exponentials (no entropy in these passes: no softmax or
    # product; 56 MiB less at the peak of a 16-row Qwen2.5-0.5B pass on an H200, one chunk)
    chunk = 2 * chunk_elements(b, completion_tokens, arch.vocab_size) * 4
    if p.autocast:
        copies = params.matmul * a if cached_weight_copies else params.largest_matmul * a
    else:
        copies = 0
    return max(layer, logits + chunk) + copies + 3 * b * completion_tokens * 4


def reward_model_bytes(arch: Arch, p: Precision, *, batch: int, tokens: int) -> int:
    """Working memory of one reward-model forward (sequence classification: no vocabulary logits)."""
    return inference_layer_bytes_per_token(arch, p, tokens) * batch * tokens + batch * tokens * tokens


def kv_cache_bytes(arch: Arch, *, dtype_bytes: int, tokens: int, sequences: int) -> int:
    """2 (k, v) x layers x kv_heads x head_dim x bytes x tokens x sequences."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes * tokens * sequences


COPY_LIMIT_BYTES = 1 << 30
"""Mirror of `gpufleet.engine.fastdecode._COPY_LIMIT_BYTES`: the most the fast decoder's weight copies take."""

FAST_DECODE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
FAST_DECODE_DTYPES = ("float32", "bfloat16", "float16")
"""The weights' dtypes the fast decoder takes (engine/fastdecode_check.py)."""
"""model_type values `gpufleet.engine.fastdecode.FastDecoder` runs (plain float32 models only)."""


def fast_decode_copies(
    arch: Arch, p: Precision, *, wrapped: bool, cpu: bool = False, panels: bool = True
) -> int:
    """Bytes of the weight copies the fast decoder builds for one `generate` call, as `FastDecoder`
    makes them. On a GPU with float32 weights and a lower compute dtype (`decode_dtype`): every
    projection, the embedding and the head (once if tied) in the compute dtype. Otherwise as
    `FastDecoder._layout_that_fits` picks them, in the weights' dtype: on CPU every projection, its biases
    and the head if they fit in `COPY_LIMIT_BYTES` (``panels``, float32 only: packed for the CPU kernel,
    `gpufleet.engine.cpu_kernels`, each weight's outputs padded to a multiple of 16; else as they are);
    else the fused q/k/v and gate/up if those fit; else none. 0 where it does not run (other families,
    other dtypes, an FSDP-wrapped policy)."""
    if wrapped or arch.model_type not in FAST_DECODE_TYPES or p.weights not in FAST_DECODE_DTYPES:
        return 0
    h, inter = arch.hidden_size, arch.intermediate_size
    # (outputs, inputs, has a bias) of the fused q/k/v, o, fused gate/up and down projections
    qkv, gate_up = (arch.q_dim + 2 * arch.kv_dim, h, arch.qkv_bias), (2 * inter, h, arch.mlp_bias)
    rest = [(h, arch.q_dim, arch.o_bias), (h, inter, arch.mlp_bias)]
    item = p.weight_bytes

    def size(weights: list[tuple[int, int, bool]], pad: int = 1) -> int:
        return sum(-(-out // pad) * pad * (inputs + bias) for out, inputs, bias in weights) * item

    if not cpu and p.weights == "float32" and p.compute != "float32":  # rl/precision.py decode_dtype
        item = p.compute_bytes
        tables = arch.vocab_size * h * item * (1 if arch.tie_word_embeddings else 2)
        return size([qkv, gate_up, *rest]) * arch.num_layers + tables
    fused = size([qkv, gate_up]) * arch.num_layers
    if cpu:
        dense = fused + size(rest) * arch.num_layers + arch.vocab_size * h * item
        if dense <= COPY_LIMIT_BYTES:
            if not panels or p.weights != "float32":
                return dense
            return size([qkv, gate_up, *rest], pad=16) * arch.num_layers + size([(arch.vocab_size, h, 0)], 16)
    return fused if fused <= COPY_LIMIT_BYTES else 0


def decode_precision(arch: Arch, p: Precision, *, wrapped: bool, cpu: bool) -> Precision:
    """The dtypes a rollout runs in (its KV cache's): where the fast decoder runs on a GPU, the compute
    dtype over float32 weights (rl/precision.py `decode_dtype`); else the weights'."""
    fast = not wrapped and arch.model_type in FAST_DECODE_TYPES
    if fast and not cpu and p.weights == "float32" and p.compute != "float32":
        return Precision(p.compute, p.compute)
    return p


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
        inference_layer_bytes_per_token(arch, infer, prompt_tokens) * sequences * prompt_tokens
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
