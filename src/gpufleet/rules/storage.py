"""Rules about where a run writes: `output.dir` and the built-in model cache (GPUFLEET_CACHE) must be
folders this user can write in, on a file system that is not read-only; and the disk under
`output.dir` should hold the checkpoints the job plans (a warning with the numbers when it cannot).
Nothing is written to find out: the nearest existing folder of each path is looked at. No torch here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gpufleet.config.problems import FieldRef, Source
from gpufleet.paths import user_path
from gpufleet.rules.registry import Context, err, rule, warn

CACHE_ENV = "GPUFLEET_CACHE"


def nearest_existing(path: Path) -> Path:
    """`path` itself when it exists, else its nearest existing parent (what creating it would write in)."""
    p = Path(os.path.abspath(user_path(path)))
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    return p


def not_writable(path: Path) -> str | None:
    """Why this process cannot create or write the folder `path` (None when it can)."""
    base = nearest_existing(path)
    if not base.is_dir():
        what = "a file" if base.is_file() else "a broken link" if not base.exists() else "not a folder"
        return f"{base} is {what}" + (", not a folder" if what != "not a folder" else "")
    try:
        if shutil.disk_usage(base).total == 0:  # /proc, /sys: writable bits, but no room for files
            return f"{base} is on a virtual file system (like /proc), not a disk"
    except OSError:
        pass
    if os.access(base, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(base).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return f"{base} is on a read-only file system"
    return f"this user ({_user()}) may not write in {base}"


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return f"uid {os.getuid()}"


@rule
def output_writable(ctx: Context):
    d = user_path(ctx.job.output.dir)
    if d.exists() and not d.is_dir():  # resources.output_dir says so
        return
    why = not_writable(d)
    if why is not None:
        yield err(
            [ctx.ref("output.dir")],
            f"the run could not write its checkpoints: {why}.",
            "--set output.dir=<a folder you can write, on a writable disk>",
        )


@rule
def cache_writable(ctx: Context):
    """Built-in models are written into the cache the first time they are used."""
    from gpufleet.models import builtin

    paths = [ctx.job.model.path, ctx.job.reward.model or ""]
    names = [builtin.builtin_name(p) for p in paths if builtin.is_builtin(p)]
    names = [n for n in names if n in builtin.BUILTIN_MODELS]
    raw = ctx.env.get(CACHE_ENV)
    root = user_path(raw) if raw else Path.home() / ".cache" / "gpufleet"
    if not names or all(builtin.is_materialized(n, root) for n in names):
        return
    why = not_writable(root / "models")
    if why is not None:
        ref = FieldRef(CACHE_ENV, raw, Source("env", CACHE_ENV)) if raw else ctx.ref("model.path")
        yield err(
            [ref],
            f"built-in models are created in {root / 'models'}, but {why}.",
            f"export {CACHE_ENV}=<a folder you can write> (it holds the built-in models, a few MB)",
        )


def checkpoint_bytes(ctx: Context) -> tuple[int, int] | None:
    """(bytes of one checkpoint, bytes of the final model) estimated from the model's parameter count:
    the weights in their dtype plus AdamW's two moments per trainable weight. None when unknown."""
    from gpufleet.plan.shape import adapter_parameters, arch_from_config, count_parameters

    if ctx.model is None:
        return None
    try:
        arch = arch_from_config(ctx.model.raw)
        total = count_parameters(arch).total
        adapter = adapter_parameters(ctx.job, arch)
    except (KeyError, ValueError, TypeError):  # an architecture the planner cannot count
        return None
    width = 2 if ctx.job.model.dtype in ("bfloat16", "float16") else 4
    saved = adapter if adapter is not None else total
    return saved * width * 3, saved * width


@rule
def disk_space(ctx: Context):
    o, t = ctx.job.output, ctx.job.train
    sizes = checkpoint_bytes(ctx)
    if sizes is None or not_writable(Path(o.dir)) is not None:
        return
    one, final = sizes
    saves = t.max_steps // o.save_every + 1 if o.save_every else 1
    held = min(saves, o.keep_last + 1)  # a new checkpoint is written before the oldest goes
    need = held * one + final
    base = nearest_existing(Path(o.dir))
    free = shutil.disk_usage(base).free
    if free < need:
        yield warn(
            [ctx.ref("output.dir"), ctx.ref("output.keep_last"), ctx.ref("output.save_every")],
            f"{base} has {_mib(free)} free; the planned checkpoints and the final model need about "
            f"{_mib(need)} ({held} checkpoint{'s' if held > 1 else ''} of ~{_mib(one)} at once). "
            "Training stops with a message when the disk fills; finished checkpoints are kept.",
            "free space there, lower output.keep_last, or --set output.dir=<a disk with more room>",
        )


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
