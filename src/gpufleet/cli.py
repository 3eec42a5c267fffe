"""gpufleet command line: parse, then call one function per verb.

    gpufleet check JOB [--set s.f=v ...] [--gpus SPEC] [--nproc N]   every problem at once; exit 2 if any error
    gpufleet config JOB [--set ...] [--format table|yaml|json] [--explain [FIELD]]   resolved job, source of each value
    gpufleet plan JOB [--set ...] [--gpus SPEC] [--format table|json]   memory per device, what fits
    gpufleet train JOB [--set ...] [--gpus auto|cpu]       train (one process, or torchrun for N); resumes
    gpufleet export RUN_DIR --to DIR [--step N] [--merge]  a checkpoint as a Hugging Face model folder
    gpufleet launch [JOB] [--nproc N] [--set ...] [--dry-run] [--scaling 1,2] -- CMD ...   anyone's script on N processes
    gpufleet watch RUN_DIR [--once]                        live view of a running (or finished) run
    gpufleet report RUN_DIR [RUN_DIR ...] [--out DIR]      one HTML page (+ PNGs) about one run or several

User errors print one clear line and exit 2; `check`/`config` import no torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from functools import partial

from gpufleet.errors import EXIT_USER_ERROR, UserError

WHAT_IF = (
    "auto (detect), cpu, 4x24GB, 2xA100-80GB, 0:24GB,1:16GB; add ,host=256GB to state the host RAM per node"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpufleet", description="Take an RL post-training job from one GPU to many."
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    _info_verbs(sub)
    _run_verbs(sub)
    _monitor_verbs(sub)
    return p


def _counts(text: str) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4): process counts, each >= 1."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give process counts like 1,2,4")
    return counts


def _job_verb(sub, name: str, help: str, gpus: str, job_optional: bool = False) -> argparse.ArgumentParser:
    """A verb on a job file: JOB, --set, and --gpus when `gpus` says what it means."""
    sp = sub.add_parser(name, help=help, description=help)
    sp.add_argument("job", nargs="?" if job_optional else None, help="the job file (YAML)")
    sp.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field (repeatable; wins over the file and GPUFLEET_* env)",
    )
    if gpus:
        sp.add_argument("--gpus", default="auto", metavar="SPEC", help=gpus)
    return sp


def _info_verbs(sub) -> None:
    """The verbs that only read and print: check, config, plan."""
    what_if = WHAT_IF
    job_verb = partial(_job_verb, sub)
    c = job_verb(
        "check",
        "check every rule of a job before anything loads; exit 2 on any error",
        f"hardware to check against: {what_if}",
    )
    c.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="processes per node (= launch.nproc_per_node), as launch",
    )
    c = job_verb("config", "print the resolved job and where each value came from", "", job_optional=True)
    c.add_argument("--format", choices=("table", "yaml", "json"), default="table")
    c.add_argument(
        "--explain",
        nargs="?",
        const=True,
        default=False,
        metavar="FIELD",
        help="each field's documentation and choices (table: under it; yaml: as comments; json: 'doc'); "
        "FIELD (train.lr_scheduler) or SECTION (train) for those only, with or without a job",
    )
    c = job_verb(
        "plan",
        "predict the memory of every device; which role goes where; the largest that fits",
        f"hardware to plan for: {what_if}",
    )
    c.add_argument("--format", choices=("table", "json"), default="table")


def _run_verbs(sub) -> None:
    """The verbs that run or write: train, export, launch."""
    job_verb = partial(_job_verb, sub)
    c = job_verb(
        "train",
        "check the job, then train it and save the model, metrics and samples",
        "auto (detect) or cpu (each placement device id becomes a CPU process); a what-if spec such as 4x24GB only with --print-launch (ask `plan` or `check` whether it fits)",
    )
    c.add_argument("--print-launch", action="store_true", help="print the torchrun command per node and exit")
    c.add_argument(
        "--force", action="store_true", help="train even if the job is predicted not to fit in memory"
    )
    c.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    e = sub.add_parser(
        "export",
        help="write a checkpoint (or the final model) as a Hugging Face model folder",
        description="write a checkpoint (or the final model) as a Hugging Face model folder",
    )
    e.add_argument("run_dir", help="a run directory (output.dir of a gpufleet train run)")
    e.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: the final model, else the newest)"
    )
    e.add_argument("--to", required=True, help="the folder to write (new or empty)")
    e.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run (model.use_peft): write base + adapter merged into one model (default: the adapter)",
    )
    la = job_verb(
        "launch",
        "run anyone's training script on N processes (torchrun), its batch and LR scaled from a reference "
        "recipe; the command follows --",
        "auto (detect) or cpu; a what-if spec such as 4x24GB only with --dry-run",
        job_optional=True,
    )
    la.add_argument(
        "--nproc", type=int, default=None, metavar="N", help="processes per node (= launch.nproc_per_node)"
    )
    la.add_argument(
        "--dry-run", action="store_true", help="check, print the scaled recipe and the command; run nothing"
    )
    la.add_argument(
        "--scaling",
        type=_counts,
        default=(),
        metavar="N,M,...",
        help="run briefly at each process count and report samples/s, speed-up and efficiency",
    )
    la.add_argument(
        "--scaling-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds each --scaling run is measured, from its first progress line",
    )


def _monitor_verbs(sub) -> None:
    """The verbs that look at a run: watch, report."""
    w = sub.add_parser(
        "watch",
        help="a live terminal view of a run: step / ETA, curves, devices, per-rank timings, warnings",
        description="a live terminal view of a run: step / ETA, curves, devices, per-rank timings, warnings",
    )
    w.add_argument("run_dir", help="a run directory (output.dir), running or finished")
    w.add_argument("--once", action="store_true", help="print the view once and exit (for scripts)")
    w.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes")
    r = sub.add_parser(
        "report",
        help="one self-contained HTML page (+ PNGs) about a run, or several runs overlaid",
        description="one self-contained HTML page (+ PNGs) about a run, or several runs overlaid",
    )
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (output.dir)")
    r.add_argument("--out", default=None, metavar="DIR", help="where to write (default: RUN_DIR/report)")


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Entry point. Returns the exit code (0 ok, 2 user error)."""
    env = os.environ if env is None else env
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []  # `launch ... -- CMD ARGS`
    argv = argv[: argv.index("--")] if "--" in argv else argv
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed a one-line usage error
        return EXIT_USER_ERROR if e.code not in (0, None) else 0
    if args.version:
        from gpufleet import __version__

        print(f"gpufleet {__version__}")
        return 0
    if not args.verb:
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return _run(args, env, command)
    except UserError as e:
        print(f"gpufleet: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("gpufleet: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gpufleet config JOB | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a full or read-only disk while writing is the user's to fix; the rest is a bug
        from gpufleet.fsfaults import fault_error

        user = fault_error(e)
        if user is None:
            raise
        print(f"gpufleet: error: {user}", file=sys.stderr)
        return EXIT_USER_ERROR


def _names_a_file(text: str) -> bool:
    return text.endswith((".yaml", ".yml")) or os.path.isfile(text)


def _run(args: argparse.Namespace, env: Mapping[str, str], command: list[str]) -> int:
    """Call the verb's function (imported here, so that `check` never imports torch)."""
    if args.verb == "check":
        from gpufleet.verbs.check import check

        return check(args.job, args.sets, args.gpus, env, nproc=args.nproc)
    if args.verb == "config":
        from gpufleet.verbs.config import show_config

        job, explain = args.job, args.explain
        if job is None and isinstance(explain, str) and _names_a_file(explain):
            job, explain = explain, True  # `config --explain job.yaml`: the flag, then the job
        return show_config(job, args.sets, args.format, env, explain=explain)
    if args.verb == "plan":
        from gpufleet.verbs.plan import plan_command

        return plan_command(args.job, args.sets, args.gpus, args.format, env)
    if args.verb == "export":
        from gpufleet.verbs.export import export_command

        return export_command(args.run_dir, args.step, args.to, merge=args.merge)
    if args.verb == "launch":
        from gpufleet.verbs.launch import launch_command

        return launch_command(
            args.job,
            args.sets,
            args.gpus,
            env,
            command,
            nproc=args.nproc,
            dry_run=args.dry_run,
            scaling=args.scaling,
            scaling_seconds=args.scaling_seconds,
        )
    if args.verb == "report":
        from gpufleet.monitor.report import write_report

        print(f"report: {write_report(args.run_dirs, args.out)}")
        return 0
    if args.verb == "watch":
        from gpufleet.monitor.watch import watch

        return watch(args.run_dir, once=args.once, interval=args.interval)
    if args.verb == "train" and args.worker:
        from gpufleet.launch.worker import run_worker

        return run_worker(args.job, args.gpus)
    if args.verb == "train":
        from gpufleet.verbs.train import train_command

        return train_command(
            args.job, args.sets, args.gpus, env, print_launch=args.print_launch, force=args.force
        )
    raise AssertionError(f"unhandled verb {args.verb}")  # pragma: no cover
