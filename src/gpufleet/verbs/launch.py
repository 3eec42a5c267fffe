"""`gpufleet launch`: anyone's training script from 1 device to N, on the same launcher as `train`.

    gpufleet launch [JOB] [--gpus auto|cpu] [--nproc N] [--set ...] [--dry-run] -- python train.py --bs {per_device_batch}

The job's `script:` section holds the recipe that worked on `reference_devices` devices and the rules
that scale it; the scaled values replace the {placeholders} in the command and reach the script as
GPUFLEET_* variables. The command runs as written (a bare `python` is the one on PATH, as in a shell).
Checks first (every problem at once), then torchrun with one `rankexec` per rank (per-rank logs, rank 0's
output and every rank's stderr on the terminal, OUTPUT/launch.json), a watchdog that stops a run whose
ranks stay silent for launch.collective_timeout with every rank's stack, then one paragraph naming the
first failing rank and the fix.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpufleet.config.load import load_job
from gpufleet.errors import EXIT_USER_ERROR, UserError
from gpufleet.hardware import Hardware, hardware_here, resolve_hardware
from gpufleet.launch import recipe
from gpufleet.launch.checks import findings
from gpufleet.launch.scriptrun import program
from gpufleet.paths import user_path
from gpufleet.preflight import p2p_env
from gpufleet.text import plural


def launch_command(
    job: str | None,
    sets: Sequence[str],
    gpus: str,
    env: Mapping[str, str],
    command: Sequence[str],
    *,
    nproc: int | None = None,
    dry_run: bool = False,
    scaling: Sequence[int] = (),
    scaling_seconds: float = 60.0,
) -> int:
    """Check, scale the recipe, run the script on every rank (or only print it with --dry-run; or, with
    --scaling, briefly at each process count to measure the speed-up)."""
    hw = resolve_hardware(gpus, env) if dry_run else hardware_here(gpus, env, verb="launch", job=job)
    r = load_job(job, [*sets, *([f"launch.nproc_per_node={nproc}"] if nproc else [])], env)
    errors = [p for p in r.problems if p.severity == "error"]
    if errors:
        print("\n".join(p.render() for p in errors), file=sys.stderr)
        return EXIT_USER_ERROR
    jb = r.job
    cmd = list(command) or jb.script.command
    if not cmd:
        raise UserError(
            "no command to launch.", field="script.command", fix="gpufleet launch JOB -- python train.py ..."
        )
    per_node = _nproc(jb, hw)
    now = recipe.scaled(jb.script, per_node * jb.launch.nnodes)
    out, out_source = _run_dir(r, env)
    values = recipe.values(now, per_node, str(out))
    argv = recipe.fill(cmd, values)
    problems = findings(argv, per_node, hw, r, dry_run)
    extra, p2p_note = p2p_env(hw, range(per_node) if not hw.is_cpu else (), env)
    prog = program(argv, {**env, **extra})
    _header(argv, per_node, hw, r, now)
    print(prog.note)
    print(f"  run folder: {out} ({out_source})")
    for level, text in problems:
        print(f"{level}: {text}", file=sys.stderr if level == "error" else sys.stdout)
    if any(level == "error" for level, _ in problems):
        print("Nothing was started.", file=sys.stderr)
        return EXIT_USER_ERROR
    if p2p_note:
        print(p2p_note)
    env = {**env, **extra}
    if dry_run:
        shown = [f"{_env_name(k)}={v}" for k, v in values.items()] + [f"{k}={v}" for k, v in extra.items()]
        print(f"  env: {' '.join(shown)}")
        return 0
    if scaling:
        return _scaling(jb, cmd, scaling, scaling_seconds, hw, out, env)
    return _run(jb, prog, per_node, values, out, env, now, cpu=hw.is_cpu)


def _header(argv: list[str], per_node: int, hw: Hardware, r, now: recipe.Recipe) -> None:
    """The command as it will run, the world (and where the nodes meet), and the recipe table."""
    jb = r.job
    print(f"gpufleet launch: {shlex.join(argv)}")
    print(f"  {plural(per_node, 'process')} per node x {plural(jb.launch.nnodes, 'node')}; {hw.describe()}")
    if jb.launch.nnodes > 1:
        la = jb.launch
        print(
            f"  node {la.node_rank} of {la.nnodes}; rendezvous {la.rdzv_endpoint} ({r.source('launch.rdzv_endpoint')})"
        )
    if jb.script.per_device_batch is not None or jb.script.learning_rate is not None:
        print(f"  recipe ({jb.script.batch_rule}, lr {jb.script.lr_rule}):")
        print(recipe.table(recipe.reference(jb.script), now))


def _run_dir(r, env: Mapping[str, str]) -> tuple[Path, str]:
    """output.dir, or, when the job leaves it at its default, a new folder for this launch
    (runs/launch-YYYYmmdd-HHMMSS[-N]): two launches never share their logs. Several nodes need a name they
    all compute alike: runs/launch-slurm-<job>[.<step>] inside Slurm, else output.dir's default. With
    where the folder comes from, for the header."""
    if str(r.source("output.dir")) != "default":
        return user_path(r.job.output.dir), "output.dir"
    parent = Path(r.job.output.dir).parent
    if r.job.launch.nnodes > 1:
        job = env.get("SLURM_JOB_ID")
        if not job:
            return user_path(r.job.output.dir), "output.dir's default"
        step = f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else ""
        return user_path(str(parent / f"launch-slurm-{job}{step}")), "this Slurm step's; output.dir sets it"
    base = user_path(str(parent / time.strftime("launch-%Y%m%d-%H%M%S")))
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out, "new for this launch; output.dir sets it"


def _nproc(jb, hw: Hardware) -> int:
    n = jb.launch.nproc_per_node
    if n != "auto":
        return n
    return 1 if hw.is_cpu else len(hw.devices)


def _env_name(key: str) -> str:
    return f"GPUFLEET_{key.upper()}"


def _run(
    jb,
    prog,
    per_node: int,
    values: dict[str, str],
    out: Path,
    env: Mapping[str, str],
    now: recipe.Recipe,
    *,
    cpu: bool,
) -> int:
    """Run the ranks (beside them the device sampler, monitor.device_interval), then say how it ended."""
    from gpufleet.launch.scriptfail import explain
    from gpufleet.launch.scriptrun import start, write_record
    from gpufleet.launch.torchrun import Interrupted
    from gpufleet.monitor.devices import sampling

    logs, node = out / "logs", jb.launch.node_rank
    labels = {node * per_node + i: ("worker", None if cpu else i) for i in range(per_node)}

    def record(added: dict[str, str]) -> None:
        write_record(out, jb, prog, per_node, now, added)

    try:
        with sampling(jb.monitor.device_interval, out, node, labels, cpu=cpu):
            run = start(jb, prog.argv, per_node, values, out, env, record=record)
    except Interrupted as e:
        print(f"gpufleet: interrupted ({e}); every rank was stopped. Logs: {logs}/", file=sys.stderr)
        return 130
    if run.silence.found is not None:
        print(run.silence.summary(logs), file=sys.stderr)
        return 1
    if run.code == 0:
        print(f"done: {plural(per_node * jb.launch.nnodes, 'rank')} finished; logs: {logs}/")
        return 0
    print(explain(logs, run.code, recipe.reference(jb.script), now, program=prog.path), file=sys.stderr)
    return 1


def _measured(progress: Path, seconds: float):
    """True once `seconds` have passed since the first progress line (start-up is not measured), or after
    seconds + 5 minutes without one."""
    import time

    from gpufleet.launch.scaling import read_points

    started, first = time.time(), []

    def done() -> bool:
        if not first:  # the file is read only until its first line is seen
            first.extend(p.t for p in read_points(progress)[:1])
        since = first[0] if first else started + 300
        return time.time() - since >= seconds

    return done


def _scaling(jb, cmd: list[str], counts: Sequence[int], seconds: float, hw: Hardware, out: Path, env) -> int:
    """Run the script for `seconds` of progress at each process count (one node; the clock starts at the
    first progress line, so start-up is not counted), each in OUT/scaling-<n>; report
    samples/s from rank 0's progress lines, the speed-up and the efficiency."""
    from gpufleet.launch import scaling
    from gpufleet.launch.scriptfail import explain
    from gpufleet.launch.scriptrun import start
    from gpufleet.launch.torchrun import STOPPED, Interrupted

    rows = []
    for n in counts:
        now = recipe.scaled(jb.script, n)
        run_out = out / f"scaling-{n}"
        values = recipe.values(now, n, str(run_out))
        argv = recipe.fill(cmd, values)
        print(f"scaling: {plural(n, 'process')} for {seconds:g} s: {shlex.join(argv)}", flush=True)
        try:
            progress = run_out / "logs" / "progress.jsonl"
            progress.unlink(missing_ok=True)
            run = start(jb, program(argv, env).argv, n, values, run_out, env, _measured(progress, seconds))
        except Interrupted:
            print("gpufleet: interrupted; every rank was stopped.", file=sys.stderr)
            return 130
        if run.silence.found is not None:
            print(run.silence.summary(run_out / "logs"), file=sys.stderr)
            return 1
        if run.code not in (0, STOPPED):
            print(explain(run_out / "logs", run.code, recipe.reference(jb.script), now), file=sys.stderr)
            return 1
        rows.append((n, scaling.throughput(scaling.read_points(run_out / "logs" / "progress.jsonl"))))
    print(scaling.table(rows))
    if any(rate is None for _, rate in rows):
        print(
            f"  a count without a rate printed fewer than two lines matching script.progress_regex "
            f"({jb.script.progress_regex!r}) in {seconds:g} s: call gpufleet.progress.report(samples) on rank 0, "
            "or give the regex of a line the script already prints"
        )
    if hw.is_cpu:
        print(
            f"  on the CPU ({plural(hw.cpu_count, 'core')}) the processes share the same cores: this shows the "
            "launch, data-parallel and communication overhead, not what more GPUs would give"
        )
    return 0
