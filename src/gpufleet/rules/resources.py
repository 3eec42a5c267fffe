"""Rules about things outside the job file: model folders, reward modules, data files, run directories.

Reward modules are imported, as train will import them (an import error can only be found that way;
see `gpufleet.usercode`); data files are parsed by `gpufleet.datafile` (bounded, as the loader does);
model folders are read file by file, never loaded (no torch). Registered with `gpufleet.rules.registry.rule`.
"""

from __future__ import annotations

from pathlib import Path

from gpufleet import datafile, datapath, usercode
from gpufleet.config.schema import field_paths
from gpufleet.errors import UserError
from gpufleet.models import info as modelinfo
from gpufleet.models.info import looks_like_hub_id
from gpufleet.paths import user_path
from gpufleet.rules.registry import Context, err, rule, warn
from gpufleet.text import plural

DATA_EXTENSIONS = datafile.FORMATS


@rule
def model_path_exists(ctx: Context):
    from gpufleet.models.known import lookup_config

    yield from _model_source(ctx, "model.path", ctx.job.model.path)
    path = ctx.job.reward.model
    if path is None:
        return
    found = lookup_config(path, ctx.env)  # the folder's, the cache's or the table's config.json
    bad = modelinfo.reward_head_problem(found[0], path) if found else None
    if bad:  # what train's AutoModelForSequenceClassification would refuse after loading it all
        yield err([ctx.ref("reward.model")], *bad)
    for p in _model_source(ctx, "reward.model", path):
        if p.severity == "error" or not bad:  # not "download it" for a model that cannot be one
            yield p


def _model_source(ctx: Context, field: str, path: str):
    """A built-in name, a usable local folder, or a hub id: cached (weights too), or at least sized."""
    from gpufleet.models import builtin as builtin_models
    from gpufleet.models.known import lookup_config

    if builtin_models.is_builtin(path):
        name = builtin_models.builtin_name(path)
        if name not in builtin_models.BUILTIN_MODELS:
            known = ", ".join(f"builtin:{n}" for n in builtin_models.BUILTIN_MODELS)
            yield err([ctx.ref(field)], f"there is no built-in model {name!r}.", f"use one of {known}")
        return
    local = user_path(path)
    cached = modelinfo.find_config_json(path, ctx.env) if not local.exists() else None
    if local.exists():
        problems = modelinfo.folder_problems(local)
        for why, fix in problems:
            yield err([ctx.ref(field)], why, fix)
        broken = None if problems else _broken_weights(local)
        if broken:
            yield err([ctx.ref(field)], *broken)
        note = None if problems or broken else modelinfo.file_round_trip_note(local)
        if note:
            yield warn(
                [ctx.ref(field)],
                note + " Training goes on.",
                "fine if your rewards do not depend on the lost text; otherwise use a tokenizer that keeps it",
            )
    elif not looks_like_hub_id(path):
        yield err(
            [ctx.ref(field)],
            f"{path!r} is neither a local folder nor a hub id (org/name).",
            "fix the path, or use a hub id like Qwen/Qwen2.5-0.5B-Instruct",
        )
    elif cached is not None:
        if not modelinfo.has_weights(cached.parent):  # `hf download ID config.json`: sized, not loadable
            yield warn(
                [ctx.ref(field)],
                f"only the config.json of {path} is in the local Hugging Face cache: its shape is known, but "
                "train downloads its weights first, which needs network access.",
                f"download it now (hf download {path}), or point {field} at a local folder",
            )
    elif field == "model.path" and ctx.model is None:
        yield warn(
            [ctx.ref(field)],
            f"{path} is not in the local Hugging Face cache, so the rules that need "
            "its config.json (heads, context length) were skipped.",
            f"download it once (hf download {path}) to check it fully",
        )
    elif lookup_config(path, ctx.env) is None:  # reward.model: no config.json anywhere here
        yield warn(
            [ctx.ref(field)],
            f"{path} is not in the local Hugging Face cache and its shape is not known to gpufleet: its memory is "
            "not counted (here and in gpufleet plan), whether it is a sequence classifier cannot be checked, and "
            "train downloads it first, which needs network access.",
            f"hf download {path} (or its config.json alone, hf download {path} config.json, to count and check "
            f"it), or point {field} at a local folder",
        )
    else:  # known shape, nothing here
        yield warn(
            [ctx.ref(field)],
            f"{path} is not in the local Hugging Face cache: its shape is known to gpufleet, but train "
            "downloads its weights first, which needs network access.",
            f"download it now (hf download {path}), or point {field} at a local folder",
        )


def _broken_weights(folder: Path) -> tuple[str, str] | None:
    """(why, fix) for weights train's from_pretrained cannot read: a shard the index names that is missing,
    or a .safetensors file whose header is unreadable or whose tensors run past its end (a copy cut short;
    safetensors' "invalid header length" after check had passed). Reads the headers only."""
    import json
    import struct

    index, names = folder / "model.safetensors.index.json", {"model.safetensors"}
    if not (folder / "model.safetensors").is_file():  # transformers reads it first, else the index's shards
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # no index (other weight files), or not ours to judge
    missing = sorted(n for n in names if not (folder / n).is_file())
    if missing:
        return (f"{index} names {missing[0]}, which is not in {folder}.", "copy every shard the index names")
    for f in sorted(folder / n for n in names):
        try:
            size = f.stat().st_size
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8).ljust(8, b"\xff"))
                if 8 + n > size:
                    raise ValueError(f"a header of {n} bytes in {size}")
                meta = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
            if 8 + n + end > size:
                raise ValueError(f"its tensors need {8 + n + end} bytes, the file has {size}")
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            return (
                f"{f} is not a readable safetensors file ({e}): a copy cut short, or another format.",
                "copy the file again, or save the model with save_pretrained",
            )
    return None


@rule
def rewards_resolvable(ctx: Context):
    from gpufleet import tasks

    rw, data = ctx.job.reward, ctx.job.data
    names = list(rw.functions)
    env_job = bool(ctx.job.env.name)  # the env's reward, then these; the data set is not read
    builtin_task = data.path.startswith("builtin:") and not env_job
    if not names and rw.model is None and not builtin_task and not env_job:
        yield err(
            [ctx.ref("reward.functions"), ctx.ref("reward.model"), ctx.ref("data.path")],
            "no reward: no reward functions, no reward model, and the dataset is not a built-in task.",
            "--set reward.functions=my_rewards:accuracy (a module:function on your PYTHONPATH)",
        )
    known = tasks.reward_names()
    # a user's function, or a built-in one given other data than its task's: bound to the data's columns
    foreign = [
        n
        for n in names
        if ":" in n or (n in known and (env_job or data.path != f"builtin:{n.split('/')[0]}"))
    ]
    columns = ([] if env_job and not _trl_data(ctx) else _reward_columns(ctx)) if foreign else None
    for name in names:
        if ":" in name:
            try:
                from gpufleet.rules.trlenv import reward_passes

                roots = usercode.roots(ctx.r.job_path)
                usercode.import_function(name, columns, roots, rw.timeout, passes=reward_passes(ctx))
            except usercode.RewardImportError as e:
                yield err([ctx.ref("reward.functions")], e.why, e.fix)
        elif name in known:
            if name in foreign and columns is not None:
                yield from _builtin_on_other_data(ctx, name, columns, env_job)
        else:
            import difflib

            close = difflib.get_close_matches(name, known, n=1)
            tasks_named = {k.split("/")[0] for k in known}  # built-in rewards are task/name
            model = user_path(name).is_dir() or (
                looks_like_hub_id(name) and name.split("/")[0] not in tasks_named
            )
            yield err(
                [ctx.ref("reward.functions")],
                f"{name!r} is neither module:function nor a built-in reward"
                + (" (a reward model is reward.model)." if model else "."),
                f"--set reward.model={name} (and remove it from reward.functions)"
                if model
                else f"did you mean {close[0]!r}?"
                if close
                else f"built-in rewards: {', '.join(known)}",
            )
    count = len(names) + (1 if rw.model else 0) or (
        len(tasks.get_task(data.path[8:]).default_rewards)
        if builtin_task and data.path[8:] in tasks.TASKS
        else 0
    )
    if rw.weights is not None and count and len(rw.weights) != count:
        yield err(
            [ctx.ref("reward.weights"), ctx.ref("reward.functions"), ctx.ref("reward.model")],
            f"{plural(len(rw.weights), 'weight')} for {plural(count, 'reward')}.",
            f"give {plural(count, 'weight')} (one per function, then the model"
            + ("; the env's is env.reward_weight" if env_job else "")
            + "), e.g. --set reward.weights="
            + ",".join(["1.0"] * count),
        )


def _builtin_on_other_data(ctx: Context, name: str, columns: list[str], env_job: bool = False):
    """A built-in reward (``task/fn``) on data that is not its task's, or in an env job (whose episodes
    bring no data columns but a TRL environment's data set's): called once on one empty sample with those
    columns, it must find the columns it reads (tasks.base.column)."""
    from gpufleet import tasks
    from gpufleet.tasks.base import MissingColumn

    task = name.split("/")[0]
    try:
        usercode.call_reward(tasks.builtin_reward(name), [""], [""], [[]], {c: [""] for c in columns})
    except MissingColumn as e:
        if env_job:
            yield err(
                [ctx.ref("reward.functions"), ctx.ref("env.name")],
                f"built-in reward {name!r} cannot score this env job's episodes: {e}",
                "a reward function of your own (module:function, scored on the transcript), or no "
                "reward.functions: the environment's reward alone (env.reward_weight)",
            )
            return
        yield err(
            [ctx.ref("reward.functions"), ctx.ref("data.path")],
            f"built-in reward {name!r} cannot score this data: {e}",
            f"give data with the columns {name} reads (as builtin:{task} has), or a reward of your own "
            "(module:function)",
        )
    except Exception:  # any other failure on an empty sample says nothing about the data
        return


def _reward_columns(ctx: Context) -> list[str] | None:
    """The dataset columns a reward function receives by keyword (`usercode.reward_columns`, as the
    trainer binds them); None when they cannot be read (the data rule reports why, and the signature
    check then refuses nothing a column might fill)."""
    from gpufleet import tasks

    data = ctx.job.data
    if data.path.startswith("builtin:"):
        task = tasks.TASKS.get(data.path[len("builtin:") :])
        if task is None:
            return None
        names, field = list(task.make_example(0, ctx.job.train.seed)), "prompt"
    else:
        try:
            names = datafile.scan(data.path, data.prompt_field, max_rows=100).columns
        except UserError:  # the data rule reports it
            return None
        field = data.prompt_field
    return usercode.reward_columns(names, field)


# ------------------------------------------------------------------------------------------- data


def _trl_data(ctx: Context) -> bool:
    """Whether an env job reads data.path: a TRL environment class's rows (rl/trlenv.py)."""
    from gpufleet.rules.trlenv import trl_envs

    return not ctx.job.data.path.startswith("builtin:") and trl_envs(ctx) is not None


@rule
def data_available(ctx: Context):
    from gpufleet import tasks

    data = ctx.job.data
    if ctx.job.env.name and not _trl_data(ctx):  # the environments give the prompts
        return
    if data.path.startswith("builtin:"):
        name = data.path[len("builtin:") :]
        if name not in tasks.TASKS:
            yield err(
                [ctx.ref("data.path")],
                f"there is no built-in task {name!r}.",
                "use one of " + ", ".join(f"builtin:{n}" for n in tasks.TASKS),
            )
        return
    p = user_path(data.path)
    if not p.exists() and not p.is_symlink():  # a dangling link or a loop: `scan` says which
        if looks_like_hub_id(data.path) and datapath.suffixes(p)[0] not in DATA_EXTENSIONS:
            yield warn(
                [ctx.ref("data.path")],
                "a hub dataset id: it is loaded with datasets.load_dataset at train time.",
                "for offline runs, save it as a local .jsonl/.parquet file",
            )
        else:
            yield err(
                [ctx.ref("data.path")],
                f"{data.path} does not exist.",
                "fix the path (a .jsonl, .json, .parquet or .csv file)",
            )
        return
    try:
        found = datafile.scan(p, data.prompt_field, max_rows=datafile.check_limit(p))
    except datafile.DataFileError as e:
        refs = [ctx.ref(e.field)] + ([ctx.ref("data.path")] if e.field != "data.path" else [])
        yield err(refs, e.why, e.fix)
        return
    if not ctx.job.env.name and not ctx.job.rollout.tools:  # chat episodes' template: chat.py's rule
        yield from _chat_needs_template(ctx, found.first_chat)
        from gpufleet.rules.chat import chat_data_frame_fits

        yield from chat_data_frame_fits(ctx, found.first_chat)
        if found.first_chat is None and "rollout.chat_template_kwargs" in ctx.r.set_fields("rollout"):
            yield warn(
                [ctx.ref("rollout.chat_template_kwargs")],
                f"rollout.chat_template_kwargs is only read for chat-format prompts and in chat episodes; the "
                f"prompts of {p.name} are text.",
                "",
            )
    if not found.complete:
        yield warn(
            [ctx.ref("data.path")],
            f"{p.name} is over {datafile.FULL_CHECK_BYTES >> 20} MiB: check parsed its first {found.count} "
            "rows; the rest is checked the same way when train loads it.",
        )


def _chat_needs_template(ctx: Context, first_chat: str | None):
    """Chat-format prompts are rendered with the tokenizer's chat template: the model must have one."""
    if first_chat is None:
        return
    from gpufleet.models.builtin import is_builtin

    path = ctx.job.model.path
    cfg = None if is_builtin(path) else modelinfo.find_config_json(path, ctx.env)
    has = cfg is not None and modelinfo.has_chat_template(cfg.parent)  # built-ins: models/chat.py's
    if not has and cfg is not None:  # None: a built-in, or a hub model not in the cache (unknown here)
        yield err(
            [ctx.ref("data.path"), ctx.ref("model.path")],
            f"the prompts are chat messages (first at {first_chat}), but the tokenizer of {ctx.job.model.path} "
            "has no chat template to turn them into text.",
            "use plain-text prompts (a string per row), or a model whose tokenizer has a chat template "
            "(an -Instruct / -Chat model)",
        )


# ---------------------------------------------------------------------------------------- output


def holds_run(d: Path) -> bool:
    return d.is_dir() and any((d / n).exists() for n in ("checkpoints", "metrics.jsonl", "job.yaml"))


@rule
def output_dir(ctx: Context):
    o = ctx.job.output
    d = user_path(o.dir)
    if d.exists() and not d.is_dir():
        yield err(
            [ctx.ref("output.dir")], f"{o.dir} exists and is a file.", "--set output.dir=<a new folder>"
        )
        return
    if o.resume == "never" and holds_run(d):
        from gpufleet import continuity

        yield err(
            [ctx.ref("output.dir"), ctx.ref("output.resume")],
            f"{o.dir} already holds a run and resume is never, so it would be overwritten.",
            f"continue it with --set output.resume=auto, or start fresh with {continuity.new_run(o)}",
        )
    elif o.resume not in ("auto", "never") and not user_path(o.resume).exists():
        yield err(
            [ctx.ref("output.resume")],
            f"checkpoint {o.resume} does not exist.",
            "--set output.resume=auto (newest checkpoint in output.dir) or the path of a checkpoints/step-N folder",
        )


@rule
def resume_continues(ctx: Context):
    """The checkpoint train would start from (output.resume): one it cannot use, or a job changed in a way
    that breaks its run, is refused by train before anything starts (rl/resume.py); check says it first."""
    from gpufleet import ckptindex, continuity

    o = ctx.job.output
    try:
        ckpt = ckptindex.resolve_resume(user_path(o.dir), o.resume)
    except UserError as e:
        if user_path(o.resume).exists():  # a missing path: output_dir's error
            yield err([ctx.ref("output.resume")], e.message, e.fix)
        return
    if ckpt is None:
        return
    gb = ctx.job.train.per_device_batch * ctx.topo.policy_ranks
    breaking, _ = continuity.against(ckpt, ctx.job, gb, usercode.roots(ctx.r.job_path))
    if breaking:
        named = [b.split(":")[0] for b in breaking if b.split(":")[0] in field_paths()]
        named += ["train.per_device_batch"] if any(b.startswith("global batch") for b in breaking) else []
        yield err(
            [ctx.ref("output.resume"), ctx.ref("output.dir"), *map(ctx.ref, named)],
            f"train would resume {ckpt}, and this job changed in a way that breaks its run ({'; '.join(breaking)}).",
            f"undo the change, or start a new run: {continuity.new_run(o)}",
        )
