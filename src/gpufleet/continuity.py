"""Whether a checkpoint's run can go on under this job: the fields whose change breaks it, and the same
file written two ways (a relative flag vs an export's absolute path, a module vs its file), which is
no change. Used by rl/resume.py before any process starts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpufleet.paths import user_path

# Fields whose change breaks continuity of a run (the rest are reported and allowed).
BREAKING = (
    "model.path",
    "data.path",
    "data.prompt_field",
    "algorithm.num_generations",
    "train.seed",
    "train.steps_per_generation",
    "algorithm.num_iterations",
    "reward.functions",
    "reward.model",
    "model.use_peft",  # the checkpoint holds an adapter, or the whole model
    "model.lora_r",  # lora_*: the adapter comes back as saved (its adapter_config.json), so a change
    "model.lora_alpha",  # would be said and not applied; breaking only with model.use_peft
    "model.lora_dropout",
    "model.lora_target_modules",
    "env.name",
    "env.kwargs",
)


def continuity(
    saved_yaml: str, saved_layout: dict, job, layout: dict, roots: Sequence[str] = ()
) -> tuple[list[str], list[str]]:
    """(breaking changes, harmless changes) between the checkpoint's job and this one, every field compared
    with the value the saved run used: set there, or its default or derived value (written as a '#   '
    line), or the schema default when the saved job does not name it. A path written
    two ways for the same file (relative from a flag, absolute in a `config --format yaml` export; a
    module `rewards:fn` and its file `/abs/rewards.py:fn`, found in ``roots`` as the trainer finds it)
    is no change."""
    import yaml

    saved = _with_defaults(saved_yaml) or yaml.safe_load(saved_yaml) or {}
    default = _resolved_defaults(saved)
    new = job.model_dump(mode="json")
    breaking, harmless = [], []
    for section, fields in new.items():
        for name, value in fields.items():
            # a field the saved job does not name had its default (a job saved without its '#   ' lines)
            before = (saved.get(section) or {}).get(name, default[section].get(name))
            if before != value and not _same_place(f"{section}.{name}", before, value, roots):
                text = f"{section}.{name}: {before!r} -> {value!r}"
                (breaking if _breaks(f"{section}.{name}", new) else harmless).append(text)
    if saved_layout.get("global_batch") != layout.get("global_batch"):
        breaking.append(
            f"global batch (per_device_batch x policy ranks): {saved_layout.get('global_batch')} -> "
            f"{layout.get('global_batch')}"
        )
    return breaking, harmless


def _resolved_defaults(saved: dict) -> dict:
    """The saved job's values as train resolved them: the schema defaults, then its algorithm's preset and
    the derived micro_batch (a field the saved job does not name had these, not the bare schema's None)."""
    from pydantic import ValidationError

    from gpufleet.config.load import Resolved, _apply_presets
    from gpufleet.config.schema import SECTIONS, Job

    try:
        job = Job.model_validate({k: v for k, v in saved.items() if k in SECTIONS and isinstance(v, dict)})
    except ValidationError:  # a job an older gpufleet wrote: the schema's defaults
        job = Job()
    _apply_presets(Resolved(job=job, sources={}, problems=[], job_path=None))
    return job.model_dump(mode="json")


def new_run(output) -> str:
    """The flags that start a new run instead of resuming (the fix of a refused resume): an output.dir
    beside this one that holds nothing yet (`runs/x-2`, else -3, ...; `runs/x-2` itself gives `runs/x-3`),
    and, when output.resume names a checkpoint, output.resume=auto (a named checkpoint is resumed into
    any output.dir; auto in an empty one starts at step 0)."""
    import re

    here = output.dir.rstrip("/") or output.dir
    stem = re.sub(r"-\d+$", "", here) or here
    if stem != here and not user_path(stem).exists():  # runs/2024-11 is its own name, not a -N of ours
        stem = here
    k = 2
    while (d := user_path(f"{stem}-{k}")).exists() and (not d.is_dir() or any(d.iterdir())):
        k += 1
    auto = " --set output.resume=auto" if output.resume not in ("auto", "never") else ""
    return f"--set output.dir={stem}-{k}{auto}"


def _breaks(field: str, new: dict) -> bool:
    """Whether a change of `field` breaks the run (a LoRA setting only when the policy is an adapter)."""
    return field in BREAKING and (not field.startswith("model.lora_") or bool(new["model"]["use_peft"]))


def against(ckpt: Path, job, global_batch: int, roots: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """`continuity` between the job saved in checkpoint `ckpt` and this one (torch-free: `gpufleet check`
    and the trainer both ask it)."""
    from gpufleet.ckptindex import load_state

    saved_yaml = (ckpt / "job.yaml").read_text(encoding="utf-8")
    return continuity(saved_yaml, load_state(ckpt).layout, job, {"global_batch": global_batch}, roots)


def _with_defaults(saved_yaml: str) -> dict:
    """The saved job with its default and derived values read too: `gpufleet config` writes them as
    commented lines (`#   use_peft: false  # default`), which a plain load misses -- a breaking field
    left at its default there and set here (model.use_peft: true) went unseen, and train stopped with a
    traceback instead of this refusal."""
    import re

    import yaml

    try:
        return yaml.safe_load(re.sub(r"(?m)^(\s*)#   (?=\S)", r"\1", saved_yaml)) or {}
    except yaml.YAMLError:
        return {}


_PLACES = ("model.path", "data.path", "reward.model", "env.token_file")
"""Fields holding a local path, a hub id or a builtin: name."""
_REFS = ("reward.functions", "env.name")
"""Fields holding `module:name` / `file.py:name` references (or built-in names)."""


def _same_place(field: str, before, after, roots: Sequence[str]) -> bool:
    """Whether two values of a path field name the same file(s), seen from the working directory."""
    if field in _PLACES and isinstance(before, str) and isinstance(after, str):
        return _place(before) == _place(after)
    if field in _REFS:
        before, after = ([v] if isinstance(v, str) else v for v in (before, after))
        return (
            isinstance(before, list)
            and isinstance(after, list)
            and len(before) == len(after)
            and all(_ref_place(a, roots) == _ref_place(b, roots) for a, b in zip(before, after, strict=True))
        )
    return False


def _place(value: str) -> str:
    """A local path, resolved from the working directory (where a flag's relative path starts); a
    builtin: name or a hub id as it is."""
    path = user_path(value)
    return str(path.resolve()) if not value.startswith("builtin:") and path.exists() else value


def _ref_place(ref: str, roots: Sequence[str]) -> str:
    """The file and name a `where:name` reference points at (a module looked for in ``roots``)."""
    from gpufleet import usercode

    where, name = usercode.split(ref)
    if not where or ref.startswith(("builtin:", "gymnasium:")):
        return ref
    if usercode.is_file(where):
        return f"{_place(where)}:{name}"
    for root in roots:
        file = Path(root) / f"{where.replace('.', '/')}.py"
        if file.is_file():
            return f"{file.resolve()}:{name}"
    return ref
