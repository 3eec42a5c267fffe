"""`.bench-venv/`: the virtual environment the TRL comparison runs in, and the environment of its children.

TRL is not a dependency of gpufleet, so `vs_trl.py` creates `.bench-venv/` at the repository root (once,
reused afterwards: a stamp file records what was installed) and re-executes itself there. gpufleet is
imported from `src/` (or `--src DIR`) through PYTHONPATH; nothing is installed into `.venv`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
BENCH = ROOT / "bench"
BENCH_VENV = ROOT / ".bench-venv"
BENCH_PY = BENCH_VENV / "bin" / "python"

# What .bench-venv holds. Everything else is pinned by constraints.txt (the project's own pins).
REQUIREMENTS = [
    "torch==2.13.0",
    "trl==1.16.0",
    "accelerate==1.15.0",
    "transformers==5.23.0",
    "datasets",
    "pydantic",
    "pyyaml",
    "rich",
    "safetensors",
]
STAMP = BENCH_VENV / ".vs-trl-requirements"


def in_bench_venv() -> bool:
    return Path(sys.prefix).resolve() == BENCH_VENV.resolve()


def ensure_bench_venv() -> None:
    """Create .bench-venv (once) and install the pinned requirements; a stamp records what is there."""
    wanted = "\n".join(REQUIREMENTS) + "\n" + (ROOT / "constraints.txt").read_text()
    if BENCH_PY.exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return
    print(f"[vs_trl] setting up {BENCH_VENV} (once): {' '.join(REQUIREMENTS[:3])} ...", flush=True)
    if not BENCH_PY.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(BENCH_VENV)], check=True)
    cmd = [
        str(BENCH_PY),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
    ]
    if Path("/opt/wheels").is_dir():  # a local CPU wheel of torch on the project's machines
        cmd += ["--find-links", "/opt/wheels"]
    cmd += ["-c", str(ROOT / "constraints.txt"), *REQUIREMENTS]
    subprocess.run(cmd, check=True)
    STAMP.write_text(wanted)


def reexec_in_bench_venv(script: Path, argv: list[str]) -> None:
    """Replace this process by `script argv...` under .bench-venv's python (set up first if needed)."""
    ensure_bench_venv()
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    os.execve(str(BENCH_PY), [str(BENCH_PY), str(script.resolve()), *argv], env)


def child_env(threads: int, src: Path) -> dict[str, str]:
    """Environment of every child process: gpufleet from `src`, offline Hugging Face, `threads` threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        ACCELERATE_DISABLE_RICH="1",
    )
    return env
