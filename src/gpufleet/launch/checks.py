"""What `gpufleet launch` (and `gpufleet check` of a launch job) checks before anything starts, all at
once: the script and command exist, enough GPUs, a free port, CPU cores and /dev/shm for the ranks, and
on the GPUs here (NVML): free memory for `script.memory_per_device`, other processes already on them.
Each finding is (level, one line naming the field, the value and the fix). No torch import.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gpufleet import preflight
from gpufleet.config.load import Resolved
from gpufleet.config.problems import Problem
from gpufleet.hardware import GiB, Hardware, parse_size
from gpufleet.launch import recipe
from gpufleet.text import plural

Finding = tuple[str, str]


def findings(
    argv: list[str], per_node: int, hw: Hardware, r: Resolved, dry_run: bool = False
) -> list[Finding]:
    """(level, line) for everything that would stop or slow the run, all at once: what `gpufleet launch`,
    its --dry-run and `gpufleet check` of a launch job all say, with the same verdict (`dry_run` changes
    nothing here). A missing script or command is an error on the hardware here, a warning for a what-if
    --gpus spec (a plan for another machine, where it is installed)."""
    jb = r.job
    out = command_findings(argv, r, "error" if hw.is_detected or hw.is_cpu else "warning")
    if not hw.is_cpu and per_node > len(hw.devices):
        out.append(
            (
                "error",
                f"launch.nproc_per_node: {per_node} processes but {plural(len(hw.devices), 'GPU')} here. "
                f"Fix: --nproc {len(hw.devices)}",
            )
        )
    la = jb.launch
    if la.master_port != "auto" and la.nnodes == 1 and not _port_free(la.master_addr, la.master_port):
        out.append(
            (
                "error",
                f"launch.master_port: {la.master_port} is in use on {la.master_addr}. "
                "Fix: --set launch.master_port=auto",
            )
        )
    if per_node > hw.cpu_count:
        out.append(
            (
                "warning",
                f"{per_node} processes share {plural(hw.cpu_count, 'core')}: expect no speed-up on the CPU side",
            )
        )
    shm = _shm_bytes()
    if shm is not None and not hw.is_cpu and shm < per_node * GiB:
        out.append(
            (
                "warning",
                f"/dev/shm is {shm / GiB:.1f} GiB for {per_node} ranks: DataLoader workers may die. "
                "Fix: docker --shm-size=8g, or num_workers=0",
            )
        )
    said = [p for p in r.problems if p.severity == "warning"]  # e.g. a Slurm allocation used outside srun
    return out + [(p.severity, _line(p)) for p in said + _devices(per_node, hw, r) + no_effect(r)]


TRAINER_SECTIONS = ("model", "data", "reward", "algorithm", "rollout", "env", "train", "placement")
"""The sections only `gpufleet train` reads; a launch job reads script:, launch:, output.dir and monitor:."""
_IN_SCRIPT = {"train.micro_batch": "script.gradient_accumulation_steps"}


def no_effect(r: Resolved) -> list[Problem]:
    """A warning for each field a launch job sets that `gpufleet launch` never reads (`train.learning_rate`:
    the script's is script.learning_rate), naming the script's counterpart where there is one."""
    from gpufleet.config.schema import SECTIONS

    paths = [p for s in TRAINER_SECTIONS for p in r.set_fields(s)]
    paths += [p for p in r.set_fields("output") if p != "output.dir"]
    out = []
    for path in paths:
        section, name = path.split(".", 1)
        twin = _IN_SCRIPT.get(path) or (
            f"script.{name}" if section == "train" and name in SECTIONS["script"].model_fields else None
        )
        why = (
            f"{path} has no effect in a launch job: gpufleet launch runs script.command and reads only script:, "
            f"launch:, output.dir and monitor: ({section}: is gpufleet train's)"
        )
        why += f"; the script's counterpart is {twin}." if twin else "."
        fix = f"remove it and set {twin}" if twin else "remove it (your script has its own setting for it)"
        out.append(Problem("warning", [r.ref(path)], why, fix))
    return out


def _devices(per_node: int, hw: Hardware, r: Resolved) -> list[Problem]:
    """The GPUs this node's ranks take (LOCAL_RANK 0..n-1 after CUDA_VISIBLE_DEVICES): busy, or short of
    `script.memory_per_device`."""
    if hw.is_cpu:
        return []
    ids = range(min(per_node, len(hw.devices)))
    out = preflight.busy(hw, ids, [])
    size = r.job.script.memory_per_device
    need = parse_size(size) if size else None
    if need:
        out += preflight.short_of_memory(
            hw,
            {i: need for i in ids},
            [r.ref("script.memory_per_device")],
            _memory_fix(per_node, hw, r, need),
        )
    return out


def _memory_fix(per_node: int, hw: Hardware, r: Resolved, need: int) -> str:
    """GPUs with room (CUDA_VISIBLE_DEVICES), fewer processes, or a smaller per-device batch."""
    options = []
    there = preflight.room_elsewhere(hw, per_node, need)
    if there:
        options.append(f"run on GPUs with room: {there} gpufleet launch ...")
    roomy = len(preflight.with_room(hw, need))
    if 0 < roomy < per_node:
        options.append(f"fewer processes on the GPUs with room: --nproc {roomy} (with CUDA_VISIBLE_DEVICES)")
    now = recipe.scaled(r.job.script, per_node * r.job.launch.nnodes)
    smaller = recipe.halved(recipe.reference(r.job.script), now)
    if smaller:
        options.append(f"a smaller per-device batch: {smaller} (then lower script.memory_per_device)")
    return "; or ".join(options) or "free memory on those GPUs, or a smaller batch in the script"


def _line(p: Problem) -> str:
    """A Problem in launch's one-line style: field (value, source): why Fix: fix."""
    head = f"{p.refs[0]}: " if p.refs else ""
    return f"{head}{p.why}" + (f" Fix: {p.fix}" if p.fix else "")


def command_findings(argv: list[str], r: Resolved, level: str) -> list[Finding]:
    """The one rule for the command's script and program, for `launch` and `check` alike: the command runs
    in the working directory, as in a shell, so a relative script path (`python train.py`) is the working
    directory's, like every other path on the command line, unlike the job file's own paths (model.path,
    data.path, ...), which are its folder's. A missing one is `level`, naming the folder it was looked for
    in and, when the script is beside the job file, the command that finds it."""
    script, here = script_file(argv), Path.cwd()
    if script is not None and not (here / script).is_file():
        where = f"{here}, the working directory" if not script.is_absolute() else "that path"
        fix = "give the script's path as seen from the working directory, or run gpufleet where the script is"
        beside = r.job_path.resolve().parent / script if r.job_path is not None else None
        if not script.is_absolute() and beside is not None and beside.is_file():
            rel = os.path.relpath(beside, here)
            fix = f"it is beside the job file: run from there (cd {beside.parent}), or write its path from here ({rel})"
        why = (
            f"{script} does not exist in {where} (a relative path in the command is the working directory's, "
            "where the command runs; the job file's other paths are its folder's)."
        )
        return [(level, f"script.command: {why} Fix: {fix}")]
    bare = os.sep not in argv[0] and not argv[0].startswith(
        "python"
    )  # a bare python: gpufleet's own, if need be
    if script is None and bare and shutil.which(argv[0]) is None:
        return [
            (level, f"script.command: {argv[0]!r} is not a command on PATH. Fix: install it or give its path")
        ]
    if script is None and os.sep in argv[0] and not Path(argv[0]).is_file():
        return [
            (level, f"script.command: {argv[0]} does not exist (from {here}). Fix: give the program's path")
        ]
    return []


def script_file(argv: list[str]) -> Path | None:
    """The .py file a `python x.py ...` / `x.py ...` command runs (None for `python -m` and other commands)."""
    args = argv[1:] if Path(argv[0]).name.startswith("python") else argv
    first = next((a for a in args if not a.startswith("-")), None) if args else None
    if args and args[0] == "-m":
        return None
    return Path(first) if first and first.endswith(".py") else None


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bsize * st.f_blocks
