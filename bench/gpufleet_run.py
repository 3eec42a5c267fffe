"""gpufleet's side of `vs_trl.py`: one training run in this process (started by `vs_trl.py --worker gpufleet`).

The job is built from `--set` overrides only (no job file), at the settings the TRL side uses too; the
step ends come from the trainer's `log` callback (called once per step with `train.log_every=1`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from measure import (
    BENCH_MODELS,
    PROMPT_TOKENS,
    TEMPERATURE,
    Preset,
    StepClock,
    add_peak,
    model_folder,
    write_result,
)


def job_sets(a: argparse.Namespace, p: Preset, out: Path) -> list[str]:
    """The job as `--set` overrides: the shared settings of preset `p`, steps, lr and seed from `a`."""
    model = str(model_folder(p)) if p.model in BENCH_MODELS else f"builtin:{p.model}"
    return [
        f"model.path={model}",
        "model.dtype=float32",
        "model.gradient_checkpointing=false",
        "data.path=builtin:repeat",
        "algorithm.name=grpo",
        f"algorithm.num_generations={p.generations}",
        f"algorithm.beta={p.beta}",
        "algorithm.loss_type=grpo",
        "algorithm.importance_level=token",
        "algorithm.scale_rewards=group",
        "algorithm.epsilon=0.2",
        "algorithm.epsilon_high=0.2",
        "algorithm.num_iterations=1",
        f"rollout.max_prompt_length={PROMPT_TOKENS}",
        f"rollout.max_completion_length={p.completion_tokens}",
        f"rollout.temperature={TEMPERATURE}",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        f"train.per_device_batch={p.batch}",
        "train.steps_per_generation=1",
        f"train.learning_rate={a.lr}",
        "train.lr_scheduler=constant",
        "train.warmup_steps=0",
        "train.weight_decay=0.0",
        "train.max_grad_norm=1.0",
        f"train.max_steps={a.steps}",
        f"train.seed={a.seed}",
        f"train.precision={a.precision}",
        f"train.torch_compile={str(getattr(a, 'torch_compile', False)).lower()}",
        "train.log_every=1",
        "train.samples_every=0",
        f"output.dir={out}",
        "output.resume=never",
    ]


def run(a: argparse.Namespace, p: Preset) -> None:
    """Train once with gpufleet and write the result file `a.result` (see measure.write_result)."""
    clock = StepClock()
    import torch

    torch.set_num_threads(a.threads)
    from gpufleet.config.load import load_job
    from gpufleet.dist import Runtime
    from gpufleet.rl.trainer import train

    out = Path(a.out)
    resolved = load_job(None, job_sets(a, p, out), env={})
    errors = [e for e in resolved.problems if e.severity == "error"]
    if errors:
        raise SystemExit("\n".join(e.render() for e in errors))
    settings = {
        f"{sec}.{f}": str(v)
        for sec in ("algorithm", "rollout", "train")
        for f, v in getattr(resolved.job, sec)
    }
    print("[vs_trl] gpufleet job:", json.dumps(settings), flush=True)
    rt = Runtime(device=torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu"))
    if a.device == "cuda":
        torch.cuda.set_device(rt.device)
    clock.train(lambda: train(resolved.job, out, rt, log=lambda _line: clock.step_end()))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    own = [r["step_time"] for r in rows]  # the trainer's own time of each step
    write_result(
        Path(a.result),
        clock,
        own[0],
        trainer="gpufleet",
        seed=a.seed,
        settings=settings,
        threads=torch.get_num_threads(),
        inner_step_time=own,
        reward=[r["reward"] for r in rows],
        completion_length=[r["completions/mean_length"] for r in rows],
        max_length=[r["completions/max_length"] for r in rows],
        timing={k: [r.get(k, 0.0) for r in rows] for k in rows[0] if k.startswith("timing/")},
        peak_gib=[r.get("memory/peak_gib") for r in rows],
    )
    for key in ("memory/peak_gib", "memory/plan_gib", "memory/plan_ratio"):  # measured vs the plan
        print(f"[vs_trl] gpufleet {key} per step:", [r.get(key) for r in rows], flush=True)
    add_peak(Path(a.result), p, a.threads, a.device, a.precision)
