"""`gpufleet train`: check everything, prepare the run directory, then train in-process (1 process)
or through torchrun (N processes), and print where the results are or why it failed."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpufleet.config.batch import batch_note
from gpufleet.config.load import load_job
from gpufleet.config.problems import render_problems, summary
from gpufleet.errors import EXIT_USER_ERROR
from gpufleet.fsfaults import write_text_atomic
from gpufleet.hardware import hardware_here, resolve_hardware
from gpufleet.paths import user_path
from gpufleet.preflight import p2p_env
from gpufleet.rules import run_checks
from gpufleet.rules.resources import holds_run
from gpufleet.text import plural
from gpufleet.usercode import pythonpath, roots, use_roots
from gpufleet.verbs.config import render_yaml

RUN_LOGS = ("metrics.jsonl", "samples.jsonl", "devices.jsonl", "warnings.jsonl")
"""What a restart without a checkpoint keeps aside as NAME.previous."""


def train_command(
    job: str,
    sets: Sequence[str],
    gpus: str,
    env: Mapping[str, str],
    *,
    print_launch: bool = False,
    force: bool = False,
) -> int:
    """Check, prepare the run directory, train (in-process or torchrun), say where the results are."""
    # Ctrl-C must stop a run even when the shell that started it ignored SIGINT (background jobs of a
    # non-interactive shell inherit SIG_IGN, and Python then installs no KeyboardInterrupt handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    hw = resolve_hardware(gpus, env) if print_launch else hardware_here(gpus, env, verb="train", job=job)
    r, problems, ctx = _checked(job, sets, hw, env, force)
    if any(p.severity == "error" for p in problems):
        print(render_problems(problems), file=sys.stderr)
        print(summary(problems) + " Nothing was started.", file=sys.stderr)
        return EXIT_USER_ERROR
    for p in problems:
        print(p.render())
    topo, jb = ctx.topo, r.job
    use_roots(roots(r.job_path))  # the job's own modules (rewards) import from its folder, then cwd
    out = user_path(jb.output.dir)
    job_file = out / "job.yaml"
    p2p, note = p2p_env(hw, topo.devices if topo.world_size > 1 else (), env)
    if note:
        print(note)
    if print_launch:
        return _print_launch(job, r, topo, hw, env, p2p)
    start = _start(out, jb, topo, roots(r.job_path))
    if start is None:  # the run in `out` is finished
        return 0
    _prepare_run_dir(r, out, job_file, hw, env)
    _header(job, jb, topo, hw, out)
    if batch := batch_note(r, topo.policy_ranks):  # the global batch follows the rank count: say so
        print(f"  {batch}", flush=True)
    from gpufleet.launch.torchrun import Interrupted

    try:
        with _beside(jb, out, topo, hw, roots(r.job_path)):
            code = (
                _in_process(jb, out, hw, topo, start.checkpoint)
                if topo.world_size == 1
                else _torchrun(
                    jb,
                    topo,
                    job_file,
                    out,
                    hw,
                    {**env, **p2p, "PYTHONPATH": pythonpath(roots(r.job_path), env)},
                )
            )
    except (KeyboardInterrupt, Interrupted):
        print(_interrupted(out, jb), file=sys.stderr)
        return 130
    if code == 0:
        _results(out, jb)
    return code


@contextlib.contextmanager
def _beside(jb, out: Path, topo, hw, folders: list[str]):
    """What runs beside the ranks on this node: the env servers and the device sampler."""
    from gpufleet.monitor.devices import sampling, train_labels

    node, cpu = jb.launch.node_rank, hw.is_cpu
    with (
        env_servers(jb, out, topo, hw, folders),
        sampling(
            jb.monitor.device_interval,
            out,
            node,
            train_labels(topo, node, cpu),
            cpu=cpu,
            in_process=topo.world_size == 1,
        ),
    ):
        yield


@contextlib.contextmanager
def env_servers(jb, out: Path, topo, hw, folders: list[str]):
    """gpufleet's environment servers for the run (an env job with env.servers != 0 and no
    env.address): started and healthy before training, watched (a dead one is restarted), stopped after,
    whatever happens. `auto`: one per policy device of this node."""
    cfg = jb.env
    if not cfg.name or cfg.address or cfg.servers == 0:
        yield None
        return
    from gpufleet.env.servers import EnvServers

    count = len(topo.policy_devices) if cfg.servers == "auto" else cfg.servers
    devices = None if hw.is_cpu else [str(d) for d in topo.policy_devices]
    node = jb.launch.node_rank
    with EnvServers(cfg.name, dict(cfg.kwargs), folders, count, out, devices=devices, node=node) as servers:
        servers.start()
        print(f"env: {plural(count, 'server')} of {cfg.name} on {', '.join(servers.addresses())}", flush=True)
        yield servers


def _checked(job: str, sets: Sequence[str], hw, env: Mapping[str, str], force: bool):
    """Resolve and check the job; apply `placement: auto` as the planner decides; --force."""
    r = load_job(job, sets, env)
    _not_a_launch_job(job, r)
    problems, ctx = run_checks(r, hw, env)
    auto = _auto_placement(r, hw, env) if not any(p.severity == "error" for p in problems) else ()
    if auto:  # `placement: auto` decided by memory: the planner's dedicated device, made explicit
        from gpufleet.plan.change import apply, flags

        print(f"placement auto -> {flags(auto)} (gpufleet plan explains why)")
        r = apply(r, auto)
        problems, ctx = run_checks(r, hw, env)
    if force:  # --force: a predicted out-of-memory is the user's call; every other rule still holds
        for p in problems:
            if p.extra.get("rule") == "fit" and p.severity == "error":
                p.severity = "warning"
    return r, problems, ctx


def _not_a_launch_job(job: str, r) -> None:
    """A `gpufleet launch` job (script.command set, or script: fields and nothing of a trainer job) is
    refused, as `gpufleet check` takes it for one: train runs no script, and with no trainer field set it
    would train the built-in demo (every trainer default) into the script's output.dir."""
    import shlex

    from gpufleet.errors import UserError
    from gpufleet.launch.checks import TRAINER_SECTIONS

    script = r.set_fields("script")
    trainer = [p for s in TRAINER_SECTIONS for p in r.set_fields(s)]
    if not r.job.script.command and (not script or trainer):
        return
    said = (
        f"script.command is set ({r.source('script.command')})"
        if r.job.script.command
        else f"it sets {', '.join(script)} and no field of a trainer job"
    )
    then = "train runs no script" + ("" if trainer else "; it would train the built-in demo into output.dir")
    fix = f"gpufleet launch {shlex.quote(job)}" + (
        "; or remove script: to train the job's model" if trainer else ""
    )
    raise UserError(f"this is a launch job: {said}, and gpufleet {then}.", fix=fix)


def _start(out: Path, jb, topo, folders: list[str]):
    """The one resume decision (rl/resume.py `decide`: raises UserError on a breaking change), said out
    loud; None when the run in `out` already reached max_steps (then say so and how to go on)."""
    from gpufleet.rl.resume import decide

    start = decide(jb, out, jb.train.per_device_batch * topo.policy_ranks, folders)
    if start.checkpoint is None:
        return start
    if start.step >= jb.train.max_steps:
        _finished(out, jb, start)
        return None
    changed = f"; changed: {'; '.join(start.changes)}" if start.changes else ""
    print(f"resuming from {start.checkpoint} (step {start.step})" + changed)
    return start


def _finished(out: Path, jb, start) -> None:
    """Say that the run in `out` reached max_steps, and where its model is: final/, written from the
    checkpoint first when the run stopped before writing it (node 0: nodes may share the folder)."""
    from gpufleet.continuity import new_run
    from gpufleet.rl.resume import final_from

    final = out / "final"
    ours = (out / "checkpoints").resolve() in Path(start.checkpoint).resolve().parents
    if not ours:  # output.resume names another run's checkpoint, already at max_steps
        print(
            f"{start.checkpoint} is at step {start.step}, train.max_steps {jb.train.max_steps}: nothing to train "
            f"into {out}; its model is there. Train on with --set train.max_steps=<more>."
        )
        return
    if jb.launch.node_rank == 0 and final_from(start.checkpoint, final):
        print(
            f"{out} holds a run that reached step {start.step} (max_steps) and stopped before writing its model: "
            f"wrote {final} from {start.checkpoint}; nothing to train."
        )
    else:
        print(f"{out} already holds a finished run ({start.step} steps; model in {final}); nothing to do.")
    print(f"Train longer with --set train.max_steps=<more>, or start another with {new_run(jb.output)}")


def _prepare_run_dir(r, out: Path, job_file: Path, hw, env: Mapping[str, str]) -> None:
    """Keep an unfinished run's logs aside (node 0 only: nodes may share the folder), write job.yaml
    and plan.json (the memory each rank is predicted to take: monitor/memory.py)."""
    from gpufleet import checkpoint
    from gpufleet.monitor.memory import write_plan

    if r.job.launch.node_rank == 0 and checkpoint.latest(out) is None and holds_run(out):
        for name in RUN_LOGS:  # a run that never reached a checkpoint
            if (out / name).exists():
                (out / name).replace(out / f"{name}.previous")
    # Atomic: on a shared file system every node writes this file, and workers read it.
    write_text_atomic(job_file, render_yaml(r) + "\n")
    said = write_plan(r, hw, env, out)
    if said:
        print(said)


PRINTED_JOB = Path("print-launch") / "job.yaml"
"""Where --print-launch writes the resolved job its command reads, inside output.dir: not OUTPUT/job.yaml,
which marks a run (`output.resume: never` refuses such a folder) and which the launcher writes when it
starts one; the worker copies the job there when it starts from this file."""


def _print_launch(job: str, r, topo, hw, env: Mapping[str, str], p2p: Mapping[str, str]) -> int:
    """`--print-launch`: the torchrun command per node, runnable as printed: the resolved job it reads is
    written (the launcher's job.yaml, atomically, into OUTPUT/print-launch/; nothing else in output.dir is
    touched), and the command starts in this folder (output.dir and the paths flags gave are relative to
    it) with the ranks' PYTHONPATH (the job's folder, then this one, for the user's modules)."""
    from gpufleet.launch.torchrun import describe_launch

    if topo.world_size == 1:
        print(f"# one process: gpufleet train {job} runs in-process (no torchrun)")
        return 0
    printed = user_path(r.job.output.dir) / PRINTED_JOB
    write_text_atomic(printed, render_yaml(r) + "\n")
    folders = pythonpath(roots(r.job_path), env)
    here = os.getcwd()
    print(
        describe_launch(
            r.job, topo, printed, cpu=hw.is_cpu, job_arg=job, extra_env=p2p, pythonpath=folders, cwd=here
        )
    )
    print(
        f"# it reads {printed}, the resolved job, written now; output.dir and flag paths are relative to {here}"
    )
    cfg = r.job.env
    if cfg.name and not cfg.address and cfg.servers != 0:
        print(
            f"# env.servers={cfg.servers}: gpufleet train starts the environment servers beside the ranks and this "
            "command does not (its ranks would stop, finding none): print it with --set env.servers=0, or give "
            "env.address"
        )
    return 0


def _header(job: str, jb, topo, hw, out: Path) -> None:
    a, t = jb.algorithm, jb.train
    what = f"episodes; env {jb.env.name}" if jb.env.name else f"completions; data {jb.data.path}"
    print(f"gpufleet train {job}: {jb.model.path}; {topo.describe()}; {hw.describe()}", flush=True)
    print(
        f"  {a.name}: G={a.num_generations}, loss {a.loss_type}, {a.importance_level} level, beta {a.beta}; "
        f"{plural(t.max_steps, 'step')} x {t.per_device_batch * topo.policy_ranks} {what}; "
        f"output {out}",
        flush=True,
    )


def _last_metrics(out: Path) -> dict:
    """The last step's record in metrics.jsonl ({} when there is none)."""
    import json

    try:
        lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def _results(out: Path, jb) -> None:
    """The closing lines: the same for 1 and N processes; only node 0 holds the model."""
    if jb.launch.node_rank != 0:
        print(
            f"done: node {jb.launch.node_rank}'s ranks finished; node 0 writes the model to {out / 'final'}"
        )
        return
    last = _last_metrics(out)
    print(f"done: reward {last.get('reward', float('nan')):.3f} at step {int(last.get('step', 0))}")
    if jb.model.use_peft:
        print(f"  adapter: {out / 'final'}  (LoRA; gpufleet export {out} --to DIR --merge writes one model)")
    else:
        print(f"  model:   {out / 'final'}  (AutoModelForCausalLM.from_pretrained)")
    print(f"  metrics: {out / 'metrics.jsonl'}")
    print(f"  samples: {out / 'samples.jsonl'}")
    print(f"  report:  gpufleet report {out}  (live: gpufleet watch {out})")


def _interrupted(out: Path, jb) -> str:
    """After Ctrl-C / SIGTERM: where the run stopped, the checkpoint a re-run resumes from."""
    from gpufleet import checkpoint

    step = int(_last_metrics(out).get("step", 0))
    ckpt = checkpoint.latest(out)
    head = f"gpufleet: interrupted after step {step}; every rank was stopped."
    if ckpt is None:
        return (
            f"{head} No checkpoint was written yet (output.save_every={jb.output.save_every}): running the same "
            "command again starts from step 0."
        )
    at = checkpoint.load_state(ckpt).step
    return f"{head} Last checkpoint: {ckpt} (step {at}); run the same command again to resume from it."


def _auto_placement(r, hw, env) -> tuple:
    """The planner's choice for `auto` reference/reward placements, as `Change`s (() = colocate)."""
    pl = r.job.placement
    if hw.is_cpu or "auto" not in (pl.reference, pl.reward):
        return ()
    from gpufleet.errors import UserError
    from gpufleet.plan.search import make_plan

    try:
        plan, _ = make_plan(r, hw, env)
    except UserError:  # the model cannot be sized offline: keep the default (colocate)
        return ()
    return plan.changes if plan is not None else ()


def _in_process(job, out: Path, hw, topo, resume_from: Path | None) -> int:
    """One process, no torchrun: the same `dist.init` and `train` as a torchrun worker."""
    from gpufleet import dist
    from gpufleet.launch.worker import rank_log
    from gpufleet.rl.trainer import train

    with rank_log(out / "logs", 0, console=True):
        offload = job.placement.offload != "none"
        rt = dist.init(topo, cpu=hw.is_cpu, timeout_s=job.launch.collective_timeout, host_collectives=offload)
        train(job, out, rt, resume_from=resume_from)
    return 0


def _torchrun(job, topo, job_file: Path, out: Path, hw, env) -> int:
    from gpufleet.launch.diagnose import agent_failure, first_failure, killed_rank, unexplained
    from gpufleet.launch.stall import heartbeat
    from gpufleet.launch.torchrun import run_agent, torchrun_argv, worker_env

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    first = job.launch.node_rank * topo.nproc_per_node  # this node's ranks (nodes may share the folder)
    for rank in range(first, first + topo.nproc_per_node):
        (logs / f"rank{rank}.error.json").unlink(missing_ok=True)
    argv = torchrun_argv(job, topo, job_file, cpu=hw.is_cpu)
    agent = logs / ("torchrun.log" if job.launch.nnodes == 1 else f"torchrun.node{job.launch.node_rank}.log")
    with agent.open("a", encoding="utf-8") as agent_log:
        start = agent_log.tell()
        ranks = list(range(first, first + topo.nproc_per_node))
        voice = heartbeat(logs, ranks, job.launch.collective_timeout)  # says so while no rank prints
        code = run_agent(argv, worker_env(topo.nproc_per_node, env), agent_log, stop_when=voice)
    if code == 0:
        return 0
    with agent.open(encoding="utf-8", errors="replace") as f:
        f.seek(start)
        agent_text = f.read()
    failure = first_failure(logs)
    if failure is not None and killed_rank(failure, agent_text) is None:
        print(failure.summary(logs, code), file=sys.stderr)
        return EXIT_USER_ERROR if failure.user_error else 1
    said = agent_failure(agent_text, job.launch) if failure is None else None
    if said is not None:
        print(said, file=sys.stderr)
        return EXIT_USER_ERROR
    print(unexplained(logs, code, agent_text, echo=failure), file=sys.stderr)
    return 1
