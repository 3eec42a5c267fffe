"""Rules about the job's numbers: batch arithmetic, rollout engine, sequence length, precision, nodes and
ports, unused roles, algorithm and schedule sanity."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import socket

from gpufleet.launch.torchrun import free_port
from gpufleet.rules.registry import Context, err, rule, warn


def _listing(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


# -------------------------------------------------------------------------------- batch arithmetic


@rule
def num_generations_at_least_two(ctx: Context):
    g = ctx.job.algorithm.num_generations
    if g < 2:
        yield err(
            [ctx.ref("algorithm.num_generations")],
            f"a group of {g} completion has no spread: its advantage is always 0, so nothing is learned.",
            "--set algorithm.num_generations=8 (any value >= 2; 4-16 is usual)",
        )


def generation_batch(ctx: Context) -> int:
    t = ctx.job.train
    return t.per_device_batch * ctx.topo.policy_ranks * t.steps_per_generation


@rule
def generation_batch_divisible(ctx: Context):
    t, g = ctx.job.train, ctx.job.algorithm.num_generations
    ranks = ctx.topo.policy_ranks
    if g < 2 or ranks == 0:
        return
    total = generation_batch(ctx)
    if total % g == 0:
        return
    valid = [d for d in range(2, total + 1) if total % d == 0]
    rest = ranks * t.steps_per_generation
    step = g // math.gcd(g, rest)
    below = (t.per_device_batch // step) * step
    above = below + step
    pdb = [b for b in (below, above) if b >= 1]
    nearest_g = min(valid, key=lambda d: (abs(d - g), -d)) if valid else None
    fix = []
    if nearest_g:
        fix.append(f"--set algorithm.num_generations={nearest_g} (valid for {total}: {_listing(valid)})")
    fix.append(
        f"or keep {g} generations with --set train.per_device_batch={pdb[0]}"
        + (f" (or {pdb[1]})" if len(pdb) > 1 else "")
        + f": per_device_batch must be a multiple of {step} here"
    )
    yield err(
        [
            ctx.ref("algorithm.num_generations"),
            ctx.ref("train.per_device_batch"),
            ctx.ref("launch.nproc_per_node"),
            ctx.ref("train.steps_per_generation"),
        ],
        f"the generation batch {t.per_device_batch} per device x {ranks} policy ranks x {t.steps_per_generation} "
        f"steps_per_generation = {total} completions is not divisible by num_generations {g}: "
        "a group of completions of one prompt would be cut.",
        "; ".join(fix),
    )


@rule
def micro_batch_divides(ctx: Context):
    t = ctx.job.train
    mb, b = t.micro_batch, t.per_device_batch
    if mb is None:
        return
    refs = [ctx.ref("train.micro_batch"), ctx.ref("train.per_device_batch")]
    if mb > b:
        yield err(
            refs, f"micro_batch {mb} is larger than per_device_batch {b}.", f"--set train.micro_batch={b}"
        )
    elif b % mb:
        divisors = [d for d in range(1, b + 1) if b % d == 0]
        near = max(d for d in divisors if d <= mb)
        yield err(
            refs,
            f"per_device_batch {b} is not a whole number of micro-batches of {mb} "
            f"({b}/{mb} = {b / mb:.2f} gradient-accumulation steps).",
            f"--set train.micro_batch={near} ({b // near} accumulation steps; divisors of {b}: {_listing(divisors)})",
        )


# ---------------------------------------------------------------------------- rollout and model


@rule
def rollout_engine(ctx: Context):
    ro = ctx.job.rollout
    if ro.engine == "vllm":
        yield err(
            [ctx.ref("rollout.engine")],
            "the vllm rollout engine is not available in this version of gpufleet.",
            "--set rollout.engine=hf (the built-in batched sampler with a KV cache)",
        )
    tp = ro.tensor_parallel_size
    if tp == 1:
        return
    if ro.engine == "hf":
        yield err(
            [ctx.ref("rollout.tensor_parallel_size"), ctx.ref("rollout.engine")],
            f"tensor_parallel_size {tp} needs a tensor-parallel engine; the hf engine generates on each policy rank.",
            "--set rollout.tensor_parallel_size=1",
        )
    per_node = len(ctx.topo.policy_devices)
    if per_node and per_node % tp:
        ok = [d for d in range(1, per_node + 1) if per_node % d == 0]
        yield err(
            [ctx.ref("rollout.tensor_parallel_size"), ctx.ref("placement.policy")],
            f"tensor_parallel_size {tp} does not divide the {per_node} rollout ranks per node.",
            f"use one of {_listing(ok)} (--set rollout.tensor_parallel_size={max(ok)})",
        )
    m = ctx.model
    if m and m.num_attention_heads:
        for name, heads in (("attention heads", m.num_attention_heads), ("KV heads", m.num_key_value_heads)):
            if heads and heads % tp:
                ok = [d for d in range(1, heads + 1) if heads % d == 0 and m.num_attention_heads % d == 0]
                yield err(
                    [ctx.ref("rollout.tensor_parallel_size"), ctx.ref("model.path")],
                    f"tensor_parallel_size {tp} does not divide the model's {heads} {name} (config.json).",
                    f"use one of {_listing(ok)}",
                )


@rule
def sequence_fits_model(ctx: Context):
    m, ro = ctx.model, ctx.job.rollout
    if not m or not m.max_position_embeddings or ctx.job.env.name:  # an env job: rules/env.py
        return
    total = ro.max_prompt_length + ro.max_completion_length
    limit = m.max_position_embeddings
    if total > limit:
        yield err(
            [
                ctx.ref("rollout.max_prompt_length"),
                ctx.ref("rollout.max_completion_length"),
                ctx.ref("model.path"),
            ],
            f"prompt {ro.max_prompt_length} + completion {ro.max_completion_length} = {total} tokens exceeds the "
            f"model's max_position_embeddings {limit}.",
            f"--set rollout.max_completion_length={max(limit - ro.max_prompt_length, 1)}"
            if limit > ro.max_prompt_length
            else f"--set rollout.max_prompt_length={limit - ro.max_completion_length}"
            if limit > ro.max_completion_length
            else f"--set rollout.max_prompt_length={limit // 2} --set rollout.max_completion_length={limit - limit // 2}",
        )


@rule
def min_completion_below_max(ctx: Context):
    ro = ctx.job.rollout
    if ro.min_completion_length and ctx.job.env.name:
        yield err(
            [ctx.ref("rollout.min_completion_length"), ctx.ref("env.name")],
            "min_completion_length applies to single-turn completions; an env job's actions are scored "
            "inside whole episodes, where it is not implemented.",
            "--set rollout.min_completion_length=0",
        )
    elif 0 < ro.min_completion_length >= ro.max_completion_length:
        yield err(
            [ctx.ref("rollout.min_completion_length"), ctx.ref("rollout.max_completion_length")],
            f"min_completion_length {ro.min_completion_length} >= max_completion_length "
            f"{ro.max_completion_length}: EOS could never be sampled, so no completion could stop.",
            f"--set rollout.min_completion_length={ro.max_completion_length - 1} (or 0, off)",
        )


@rule
def precision_supported(ctx: Context):
    t, m = ctx.job.train, ctx.job.model
    wants_bf16 = t.precision == "bf16" or m.dtype == "bfloat16"
    if wants_bf16 and not ctx.hw.is_cpu:
        lacking = [
            d
            for d in ctx.hw.devices
            if d.bf16 is False
            and d.index in set(ctx.topo.policy_devices) | {s for s, _ in ctx.topo.scorer_devices}
        ]
        if lacking:
            d = lacking[0]
            field = "train.precision" if t.precision == "bf16" else "model.dtype"
            yield err(
                [ctx.ref(field)],
                f"device {d.index} ({d.name}, compute capability {d.compute_capability}) has no bfloat16 support (needs >= 8.0).",
                "--set train.precision=fp16 --set model.dtype=float16 (with loss scaling), or fp32",
            )
    if t.precision == "fp16" and ctx.hw.is_cpu:
        yield warn(
            [ctx.ref("train.precision")],
            "fp16 autocast on the CPU is slow and gains no memory here.",
            "--set train.precision=bf16 (CPU bf16 works) or fp32",
        )


@rule
def torch_compile_toolchain(ctx: Context):
    """train.torch_compile: TorchInductor builds C++ for a CPU ($CXX, else g++, as torch looks it up) and
    Triton kernels for a GPU (Triton builds its launcher with a C compiler). Checked for this machine's
    own devices or its CPU only: a GPU what-if spec (--gpus 4x24GB) says nothing about the machine that
    will run it."""
    if not ctx.job.train.torch_compile or not (ctx.hw.is_detected or ctx.hw.is_cpu):
        return
    if ctx.hw.is_cpu:
        cxx = os.environ.get("CXX", "g++")
        missing = (
            None if shutil.which(cxx) else f"a C++ compiler ({cxx}, from $CXX or g++) to build CPU kernels"
        )
    elif importlib.util.find_spec("triton") is None:
        missing = "the triton package to build GPU kernels"
    else:
        cc = os.environ.get("CC")
        found = shutil.which(cc) if cc else any(shutil.which(c) for c in ("cc", "gcc", "clang"))
        missing = None if found else "a C compiler (cc, gcc or clang, or $CC) for Triton's kernel launcher"
    if missing:
        yield err(
            [ctx.ref("train.torch_compile")],
            f"torch.compile needs {missing}; none found on this machine.",
            "install it (Debian/Ubuntu: apt install g++; GPU: pip install triton) or --set train.torch_compile=false",
        )


# ----------------------------------------------------------------------------------------- launch


@rule
def launch_nodes(ctx: Context):
    la = ctx.job.launch
    if la.node_rank >= la.nnodes:
        yield err(
            [ctx.ref("launch.node_rank"), ctx.ref("launch.nnodes")],
            f"node_rank {la.node_rank} does not exist in a {la.nnodes}-node job (ranks 0..{la.nnodes - 1}).",
            f"--set launch.node_rank={la.nnodes - 1} or raise launch.nnodes",
        )
    if la.nnodes > 1 and not la.rdzv_endpoint:
        yield err(
            [ctx.ref("launch.rdzv_endpoint"), ctx.ref("launch.nnodes")],
            f"a {la.nnodes}-node job needs a rendezvous address that every node can reach.",
            "--set launch.rdzv_endpoint=<node0-host>:29400 (inside an srun step gpufleet derives it from Slurm)",
        )
    if la.rdzv_endpoint:
        host, _, port = la.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            yield err(
                [ctx.ref("launch.rdzv_endpoint")],
                f"{la.rdzv_endpoint!r} is not host:port.",
                "--set launch.rdzv_endpoint=node0:29400",
            )


@rule
def master_port(ctx: Context):
    la = ctx.job.launch
    port = la.master_port
    if port == "auto":
        return
    if port < 1024:
        yield warn(
            [ctx.ref("launch.master_port")],
            f"port {port} is privileged (< 1024); binding it needs root.",
            "--set launch.master_port=auto",
        )
    # Only the machine that will launch rank 0 can tell whether the port is free.
    if not ctx.hw.is_detected or la.node_rank != 0 or la.nnodes > 1 or ctx.topo.world_size <= 1:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((la.master_addr if la.master_addr != "localhost" else "127.0.0.1", port))
        except OSError as e:
            yield err(
                [ctx.ref("launch.master_port"), ctx.ref("launch.master_addr")],
                f"port {port} on {la.master_addr} is not free ({e.strerror or e}).",
                f"--set launch.master_port=auto (or a free one, e.g. {free_port()})",
            )


# ------------------------------------------------------------------------------------------ roles


@rule
def unused_roles(ctx: Context):
    pl, algo = ctx.job.placement, ctx.job.algorithm
    if algo.beta == 0 and pl.reference not in ("auto", "colocate"):
        yield warn(
            [ctx.ref("placement.reference"), ctx.ref("algorithm.beta")],
            "beta is 0, so no reference model is loaded and this placement is not used.",
            "remove placement.reference, or set algorithm.beta (e.g. 0.04) to use a KL penalty",
        )
    if ctx.job.reward.model is None and pl.reward not in ("auto", "colocate"):
        yield warn(
            [ctx.ref("placement.reward"), ctx.ref("reward.model")],
            "no reward.model is set, so there is nothing to place there (reward functions run on the policy ranks).",
            "remove placement.reward, or set reward.model",
        )
    if pl.strategy == "fsdp" and ctx.topo.policy_ranks == 1:
        yield warn(
            [ctx.ref("placement.strategy")],
            "fsdp with one policy rank shards nothing.",
            "--set placement.strategy=ddp",
        )


# ------------------------------------------------------------------------------------ algorithm


@rule
def algorithm_sanity(ctx: Context):
    a, ro = ctx.job.algorithm, ctx.job.rollout
    if a.epsilon is not None and a.epsilon_high is not None and a.epsilon_high < a.epsilon:
        yield warn(
            [ctx.ref("algorithm.epsilon_high"), ctx.ref("algorithm.epsilon")],
            "epsilon_high below epsilon clips improvements harder than regressions (DAPO's clip-higher is the opposite).",
            f"--set algorithm.epsilon_high={a.epsilon}",
        )
    if ro.temperature == 0 and a.num_generations > 1:
        yield err(
            [ctx.ref("rollout.temperature"), ctx.ref("algorithm.num_generations")],
            "temperature 0 is greedy: all completions of a prompt are identical, every advantage is 0.",
            "--set rollout.temperature=1.0",
        )


@rule
def schedule_sanity(ctx: Context):
    t = ctx.job.train
    if t.warmup_steps >= t.max_steps:
        yield warn(
            [ctx.ref("train.warmup_steps"), ctx.ref("train.max_steps")],
            f"warm-up {t.warmup_steps} steps >= max_steps {t.max_steps}: the peak learning rate is never reached.",
            f"--set train.warmup_steps={t.max_steps // 10}",
        )
    # save_every > max_steps is not warned about: "only the final checkpoint" is what a short run wants.
