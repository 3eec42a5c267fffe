"""Wall time of `gpufleet plan` as a whole process (the user's view) and in-process; no assertions.

    .venv/bin/python bench/plan_speed.py [--runs 10]

Target: the whole command under 1 s. Cases: the note-001 example on 3x16GB (fits: table + largest that
fits), on 2x16GB (refused: the layout search), and a 7B job on 1x24GB (refused: every fix family,
including the search for how many GPUs FSDP needs). `python -c pass` and the import of the plan
command are timed for scale. `gpufleet plan` is timed when the CLI has the verb, otherwise the same
function through `python -c`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GSPO = str(ROOT / "examples" / "gspo-3gpu.yaml")
BIG = """model: {path: Qwen/Qwen2.5-7B-Instruct}
data: {path: builtin:repeat}
algorithm: {num_generations: 8}
rollout: {max_prompt_length: 512, max_completion_length: 512}
train: {per_device_batch: 8}
"""


def has_plan_verb() -> bool:
    p = subprocess.run(
        [sys.executable, "-m", "gpufleet", "plan", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    return p.returncode == 0


def plan_argv(job: str, gpus: str, verb: bool) -> list[str]:
    if verb:
        return [sys.executable, "-m", "gpufleet", "plan", job, "--gpus", gpus]
    code = (
        "import sys; from gpufleet.verbs.plan import plan_command; "
        f"sys.exit(plan_command({job!r}, [], {gpus!r}, 'table', {{}}))"
    )
    return [sys.executable, "-c", code]


def timed(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, check=False)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    verb = has_plan_verb()
    with tempfile.TemporaryDirectory() as tmp:
        big = str(Path(tmp) / "qwen7b.yaml")
        Path(big).write_text(BIG)
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import gpufleet.verbs.plan": [sys.executable, "-c", "import gpufleet.verbs.plan"],
            "plan gspo-3gpu 3x16GB (fits)": plan_argv(GSPO, "3x16GB", verb),
            "plan gspo-3gpu 2x16GB (layouts)": plan_argv(GSPO, "2x16GB", verb),
            "plan 7B 1x24GB (all fixes)": plan_argv(big, "1x24GB", verb),
        }
        print(
            f"whole process ({'gpufleet plan' if verb else 'plan_command via python -c'}), {args.runs} runs:"
        )
        for name, argv in commands.items():
            t = timed(argv, args.runs)
            print(f"  {name:34s} median {statistics.median(t) * 1000:7.1f} ms   best {min(t) * 1000:7.1f} ms")

        import contextlib
        import io

        from gpufleet.verbs.plan import plan_command

        print("in-process plan_command (imports done):")
        for name, job, gpus in (
            ("gspo-3gpu 3x16GB", GSPO, "3x16GB"),
            ("gspo-3gpu 2x16GB", GSPO, "2x16GB"),
            ("7B 1x24GB", big, "1x24GB"),
        ):
            t = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    plan_command(job, [], gpus, "table", {})
                t.append(time.perf_counter() - t0)
            print(f"  {name:34s} median {statistics.median(t) * 1000:7.1f} ms   best {min(t) * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
