"""Every rule a job must satisfy, checked before anything loads. Rules -> list of Problems.

Each rule is a small function `rule(ctx) -> iterable of Problem`, registered with `@rule`. A rule
names every field it looked at (with value and source), says why the combination is wrong, and
computes a fix from the numbers. No torch import here: model facts come from config.json.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufleet.config.load import Resolved
from gpufleet.config.problems import FieldRef, Problem
from gpufleet.hardware import Hardware
from gpufleet.launch.torchrun import free_port
from gpufleet.modelinfo import ModelInfo, looks_like_hub_id
from gpufleet.topology import Topology, resolve_topology

DATA_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class Context:
    r: Resolved
    hw: Hardware
    topo: Topology
    model: ModelInfo | None
    env: Mapping[str, str]

    @property
    def job(self):
        return self.r.job

    def ref(self, path: str) -> FieldRef:
        return self.r.ref(path)


RULES: list[Callable[[Context], Iterable[Problem]]] = []


def rule(fn: Callable[[Context], Iterable[Problem]]):
    RULES.append(fn)
    return fn


def run_checks(
    r: Resolved, hw: Hardware, env: Mapping[str, str] | None = None
) -> tuple[list[Problem], Context]:
    """All problems of a resolved job on this hardware: value problems first, then every rule."""
    env = os.environ if env is None else env
    from gpufleet.modelinfo import from_config
    from gpufleet.plan.known_models import lookup_config

    topo, topo_problems = resolve_topology(r, hw)
    found = lookup_config(r.job.model.path, env)  # local config.json, else the table of known hub models
    ctx = Context(r, hw, topo, from_config(*found) if found else None, env)
    problems = list(r.problems) + topo_problems
    for fn in RULES:
        problems.extend(fn(ctx))
    return problems, ctx


def _err(refs, why, fix) -> Problem:
    return Problem("error", refs, why, fix)


def _warn(refs, why, fix="") -> Problem:
    return Problem("warning", refs, why, fix)


def _listing(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


# -------------------------------------------------------------------------------- batch arithmetic


@rule
def num_generations_at_least_two(ctx: Context):
    g = ctx.job.algorithm.num_generations
    if g < 2:
        yield _err(
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
    yield _err(
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
        yield _err(
            refs, f"micro_batch {mb} is larger than per_device_batch {b}.", f"--set train.micro_batch={b}"
        )
    elif b % mb:
        divisors = [d for d in range(1, b + 1) if b % d == 0]
        near = max(d for d in divisors if d <= mb)
        yield _err(
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
        yield _err(
            [ctx.ref("rollout.engine")],
            "the vllm rollout engine is not available in this version of gpufleet.",
            "--set rollout.engine=hf (the built-in batched sampler with a KV cache)",
        )
    tp = ro.tensor_parallel_size
    if tp == 1:
        return
    if ro.engine == "hf":
        yield _err(
            [ctx.ref("rollout.tensor_parallel_size"), ctx.ref("rollout.engine")],
            f"tensor_parallel_size {tp} needs a tensor-parallel engine; the hf engine generates on each policy rank.",
            "--set rollout.tensor_parallel_size=1",
        )
    per_node = len(ctx.topo.policy_devices)
    if per_node and per_node % tp:
        ok = [d for d in range(1, per_node + 1) if per_node % d == 0]
        yield _err(
            [ctx.ref("rollout.tensor_parallel_size"), ctx.ref("placement.policy")],
            f"tensor_parallel_size {tp} does not divide the {per_node} rollout ranks per node.",
            f"use one of {_listing(ok)} (--set rollout.tensor_parallel_size={max(ok)})",
        )
    m = ctx.model
    if m and m.num_attention_heads:
        for name, heads in (("attention heads", m.num_attention_heads), ("KV heads", m.num_key_value_heads)):
            if heads and heads % tp:
                ok = [d for d in range(1, heads + 1) if heads % d == 0 and m.num_attention_heads % d == 0]
                yield _err(
                    [ctx.ref("rollout.tensor_parallel_size"), ctx.ref("model.path")],
                    f"tensor_parallel_size {tp} does not divide the model's {heads} {name} (config.json).",
                    f"use one of {_listing(ok)}",
                )


@rule
def sequence_fits_model(ctx: Context):
    m, ro = ctx.model, ctx.job.rollout
    if not m or not m.max_position_embeddings:
        return
    total = ro.max_prompt_length + ro.max_completion_length
    limit = m.max_position_embeddings
    if total > limit:
        yield _err(
            [
                ctx.ref("rollout.max_prompt_length"),
                ctx.ref("rollout.max_completion_length"),
                ctx.ref("model.path"),
            ],
            f"prompt {ro.max_prompt_length} + completion {ro.max_completion_length} = {total} tokens exceeds the "
            f"model's max_position_embeddings {limit}.",
            f"--set rollout.max_completion_length={max(limit - ro.max_prompt_length, 1)}"
            if limit > ro.max_prompt_length
            else f"--set rollout.max_prompt_length={limit // 2} --set rollout.max_completion_length={limit - limit // 2}",
        )


@rule
def model_path_exists(ctx: Context):
    from gpufleet import builtin_models

    for field in ("model.path", "reward.model"):
        path = ctx.r.value(field)
        if path is None:
            continue
        if builtin_models.is_builtin(path):
            name = builtin_models.builtin_name(path)
            if name not in builtin_models.BUILTIN_MODELS:
                known = ", ".join(f"builtin:{n}" for n in builtin_models.BUILTIN_MODELS)
                yield _err([ctx.ref(field)], f"there is no built-in model {name!r}.", f"use one of {known}")
            continue
        local = Path(path).expanduser()
        if local.exists():
            if not (local / "config.json").is_file():
                yield _err(
                    [ctx.ref(field)],
                    f"{path} is not a model folder (no config.json in it).",
                    "point it at the folder save_pretrained wrote, or at a hub id like Qwen/Qwen2.5-0.5B-Instruct",
                )
        elif not looks_like_hub_id(path):
            yield _err(
                [ctx.ref(field)],
                f"{path!r} is neither a local folder nor a hub id (org/name).",
                "fix the path, or use a hub id like Qwen/Qwen2.5-0.5B-Instruct",
            )
        elif field == "model.path" and ctx.model is None:
            yield _warn(
                [ctx.ref(field)],
                f"{path} is not in the local Hugging Face cache, so the rules that need "
                "its config.json (heads, context length) were skipped.",
                f"download it once (huggingface-cli download {path}) to check it fully",
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
            yield _err(
                [ctx.ref(field)],
                f"device {d.index} ({d.name}, compute capability {d.compute_capability}) has no bfloat16 support (needs >= 8.0).",
                "--set train.precision=fp16 --set model.dtype=float16 (with loss scaling), or fp32",
            )
    if t.precision == "fp16" and ctx.hw.is_cpu:
        yield _warn(
            [ctx.ref("train.precision")],
            "fp16 autocast on the CPU is slow and gains no memory here.",
            "--set train.precision=bf16 (CPU bf16 works) or fp32",
        )


# ----------------------------------------------------------------------------------------- launch


@rule
def launch_nodes(ctx: Context):
    la = ctx.job.launch
    if la.node_rank >= la.nnodes:
        yield _err(
            [ctx.ref("launch.node_rank"), ctx.ref("launch.nnodes")],
            f"node_rank {la.node_rank} does not exist in a {la.nnodes}-node job (ranks 0..{la.nnodes - 1}).",
            f"--set launch.node_rank={la.nnodes - 1} or raise launch.nnodes",
        )
    if la.nnodes > 1 and not la.rdzv_endpoint:
        yield _err(
            [ctx.ref("launch.rdzv_endpoint"), ctx.ref("launch.nnodes")],
            f"a {la.nnodes}-node job needs a rendezvous address that every node can reach.",
            "--set launch.rdzv_endpoint=<node0-host>:29400 (Slurm: the first host of $SLURM_JOB_NODELIST)",
        )
    if la.rdzv_endpoint:
        host, _, port = la.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            yield _err(
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
        yield _warn(
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
            yield _err(
                [ctx.ref("launch.master_port"), ctx.ref("launch.master_addr")],
                f"port {port} on {la.master_addr} is not free ({e.strerror or e}).",
                f"--set launch.master_port=auto (or a free one, e.g. {free_port()})",
            )


# ------------------------------------------------------------------------------------------ roles


@rule
def unused_roles(ctx: Context):
    pl, algo = ctx.job.placement, ctx.job.algorithm
    if algo.beta == 0 and pl.reference not in ("auto", "colocate"):
        yield _warn(
            [ctx.ref("placement.reference"), ctx.ref("algorithm.beta")],
            "beta is 0, so no reference model is loaded and this placement is not used.",
            "remove placement.reference, or set algorithm.beta (e.g. 0.04) to use a KL penalty",
        )
    if ctx.job.reward.model is None and pl.reward not in ("auto", "colocate"):
        yield _warn(
            [ctx.ref("placement.reward"), ctx.ref("reward.model")],
            "no reward.model is set, so there is nothing to place there (reward functions run on the policy ranks).",
            "remove placement.reward, or set reward.model",
        )
    if pl.strategy == "fsdp" and ctx.topo.policy_ranks == 1:
        yield _warn(
            [ctx.ref("placement.strategy")],
            "fsdp with one policy rank shards nothing.",
            "--set placement.strategy=ddp",
        )


@rule
def rewards_resolvable(ctx: Context):
    from gpufleet import tasks

    rw, data = ctx.job.reward, ctx.job.data
    names = list(rw.functions)
    builtin_task = data.path.startswith("builtin:")
    if not names and rw.model is None and not builtin_task:
        yield _err(
            [ctx.ref("reward.functions"), ctx.ref("reward.model"), ctx.ref("data.path")],
            "no reward: no reward functions, no reward model, and the dataset is not a built-in task.",
            "--set reward.functions=my_rewards:accuracy (a module:function on your PYTHONPATH)",
        )
    known = tasks.reward_names()
    for name in names:
        if ":" in name:
            why = _import_path_problem(name)
            if why:
                yield _err(
                    [ctx.ref("reward.functions")],
                    f"reward function {name!r}: {why}.",
                    "give module:function where module is importable (run from its folder or set PYTHONPATH)",
                )
        elif name not in known:
            import difflib

            close = difflib.get_close_matches(name, known, n=1)
            yield _err(
                [ctx.ref("reward.functions")],
                f"{name!r} is neither module:function nor a built-in reward.",
                f"did you mean {close[0]!r}?" if close else f"built-in rewards: {', '.join(known)}",
            )
    count = len(names) + (1 if rw.model else 0) or (
        len(tasks.get_task(data.path[8:]).default_rewards)
        if builtin_task and data.path[8:] in tasks.TASKS
        else 0
    )
    if rw.weights is not None and count and len(rw.weights) != count:
        yield _err(
            [ctx.ref("reward.weights"), ctx.ref("reward.functions"), ctx.ref("reward.model")],
            f"{len(rw.weights)} weights for {count} rewards.",
            f"give {count} weights (one per function, then the model), e.g. --set reward.weights="
            + ",".join(["1.0"] * count),
        )


def _import_path_problem(path: str) -> str | None:
    """Why `module:function` cannot be resolved, without running the module when its source is readable."""
    module, _, attr = path.partition(":")
    if not module or not attr or not attr.isidentifier():
        return "write it as module:function"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        return f"module {module!r} cannot be found ({e})"
    if spec is None:
        return f"module {module!r} is not importable from here"
    origin = spec.origin
    if origin and origin.endswith(".py") and os.path.isfile(origin):
        try:
            tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
        except (SyntaxError, OSError, UnicodeDecodeError) as e:
            return f"{origin} cannot be parsed ({e})"
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        if attr not in names:
            return f"{origin} defines no {attr!r}"
    return None


# ------------------------------------------------------------------------------------------- data


@rule
def data_available(ctx: Context):
    from gpufleet import tasks

    data = ctx.job.data
    if data.path.startswith("builtin:"):
        name = data.path[len("builtin:") :]
        if name not in tasks.TASKS:
            yield _err(
                [ctx.ref("data.path")],
                f"there is no built-in task {name!r}.",
                "use one of " + ", ".join(f"builtin:{n}" for n in tasks.TASKS),
            )
        return
    p = Path(data.path).expanduser()
    if not p.exists():
        if looks_like_hub_id(data.path) and p.suffix.lower() not in DATA_EXTENSIONS:
            yield _warn(
                [ctx.ref("data.path")],
                "a hub dataset id: it is loaded with datasets.load_dataset at train time.",
                "for offline runs, save it as a local .jsonl/.parquet file",
            )
        else:
            yield _err(
                [ctx.ref("data.path")],
                f"{data.path} does not exist.",
                "fix the path (a .jsonl, .json, .parquet or .csv file)",
            )
        return
    if p.is_file() and p.suffix.lower() not in DATA_EXTENSIONS:
        yield _err(
            [ctx.ref("data.path")],
            f"{p.suffix or 'no extension'} is not a data format gpufleet reads.",
            "convert it to .jsonl, .json, .parquet or .csv",
        )
        return
    columns = _columns(p)
    if columns is not None and data.prompt_field not in columns:
        import difflib

        likely = [
            c
            for c in ("prompt", "question", "query", "problem", "instruction", "input", "text")
            if c in columns
        ]
        close = difflib.get_close_matches(data.prompt_field, columns, n=1) or likely or columns[:1]
        hint = f"--set data.prompt_field={close[0]}" if close else "add a prompt column to the file"
        yield _err(
            [ctx.ref("data.prompt_field"), ctx.ref("data.path")],
            f"{p.name} has no column {data.prompt_field!r} (columns: {', '.join(columns[:10])}).",
            hint,
        )


def _columns(p: Path) -> list[str] | None:
    """Column names from the first record/header (None when they cannot be read cheaply)."""
    try:
        if p.suffix == ".jsonl":
            with p.open(encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        return list(rec) if isinstance(rec, dict) else []
            return []
        if p.suffix == ".csv":
            import csv

            with p.open(encoding="utf-8", newline="") as f:
                return next(csv.reader(f), [])
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return None


# ------------------------------------------------------------------------------------ algorithm


@rule
def algorithm_sanity(ctx: Context):
    a, ro = ctx.job.algorithm, ctx.job.rollout
    if a.epsilon is not None and a.epsilon_high is not None and a.epsilon_high < a.epsilon:
        yield _warn(
            [ctx.ref("algorithm.epsilon_high"), ctx.ref("algorithm.epsilon")],
            "epsilon_high below epsilon clips improvements harder than regressions (DAPO's clip-higher is the opposite).",
            f"--set algorithm.epsilon_high={a.epsilon}",
        )
    if ro.temperature == 0 and a.num_generations > 1:
        yield _err(
            [ctx.ref("rollout.temperature"), ctx.ref("algorithm.num_generations")],
            "temperature 0 is greedy: all completions of a prompt are identical, every advantage is 0.",
            "--set rollout.temperature=1.0",
        )


@rule
def schedule_sanity(ctx: Context):
    t, o = ctx.job.train, ctx.job.output
    if t.warmup_steps >= t.max_steps:
        yield _warn(
            [ctx.ref("train.warmup_steps"), ctx.ref("train.max_steps")],
            f"warm-up {t.warmup_steps} steps >= max_steps {t.max_steps}: the peak learning rate is never reached.",
            f"--set train.warmup_steps={t.max_steps // 10}",
        )
    if o.save_every > t.max_steps:
        yield _warn(
            [ctx.ref("output.save_every"), ctx.ref("train.max_steps")],
            f"save_every {o.save_every} > max_steps {t.max_steps}: only the final checkpoint is written.",
            f"--set output.save_every={max(t.max_steps // 4, 1)}",
        )


# ---------------------------------------------------------------------------------------- output


def holds_run(d: Path) -> bool:
    return d.is_dir() and any((d / n).exists() for n in ("checkpoints", "metrics.jsonl", "job.yaml"))


@rule
def output_dir(ctx: Context):
    o = ctx.job.output
    d = Path(o.dir).expanduser()
    if d.exists() and not d.is_dir():
        yield _err(
            [ctx.ref("output.dir")], f"{o.dir} exists and is a file.", "--set output.dir=<a new folder>"
        )
        return
    if o.resume == "never" and holds_run(d):
        yield _err(
            [ctx.ref("output.dir"), ctx.ref("output.resume")],
            f"{o.dir} already holds a run and resume is never, so it would be overwritten.",
            f"continue it with --set output.resume=auto, or start fresh with --set output.dir={o.dir.rstrip('/')}-2",
        )
    elif o.resume not in ("auto", "never") and not Path(o.resume).expanduser().exists():
        yield _err(
            [ctx.ref("output.resume")],
            f"checkpoint {o.resume} does not exist.",
            "--set output.resume=auto (newest checkpoint in output.dir) or the path of a checkpoints/step-N folder",
        )


def _fit(ctx: Context):
    """Memory: every device must hold what the plan puts on it (see gpufleet.plan)."""
    from gpufleet.plan.fixes import fit_problems

    return fit_problems(ctx)


rule(_fit)
