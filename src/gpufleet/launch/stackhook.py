"""Every rank's Python stack on demand, without the script's cooperation: `faulthandler` on a signal.

`gpufleet launch` runs the user's command with this file on PYTHONPATH as `sitecustomize` (a copy in a
folder of its own, so nothing else of gpufleet is importable from there). Any Python process of a rank
(a `python ...` command, a console script such as `lerobot-train`, a spawned worker) then opens
STACKS/rank<R>.<pid>.txt at start-up and registers `faulthandler` for SIGNAL: on that signal the
interpreter writes the file:line of every thread into it, from C, even while the main thread is blocked
inside a collective. A sitecustomize that was there before is loaded after it. `gpufleet train`'s ranks
call `register` themselves. Standard library only: it runs in the user's Python, whatever its version.
"""

import faulthandler
import os
import signal
import sys

SIGNAL = signal.SIGRTMIN + 6
"""A real-time signal no library claims (SIGUSR1 is Lightning's Slurm requeue): the dump's trigger."""
FOLDER_VAR = "GPUFLEET_STACKS_DIR"

_kept = []  # the open files faulthandler writes to (kept for the life of the process)


def register(folder, rank):
    """Dump every thread's stack into FOLDER/rank<rank>.<pid>.txt when SIGNAL arrives; returns the path."""
    path = os.path.join(str(folder), f"rank{rank}.{os.getpid()}.txt")
    f = open(path, "w")
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    _kept.append(f)
    return path


def hook_env(folder, pythonpath=None):
    """The variables that make every Python process of the command load this hook (the hook written into
    FOLDER/hook/sitecustomize.py on first use)."""
    hook = os.path.join(str(folder), "hook")
    target = os.path.join(hook, "sitecustomize.py")
    if not os.path.exists(target):
        os.makedirs(hook, exist_ok=True)
        with open(__file__, encoding="utf-8") as src:
            text = src.read()
        tmp = f"{target}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as dst:
            dst.write(text)
        os.replace(tmp, target)
    path = hook + (os.pathsep + pythonpath if pythonpath else "")
    return {"PYTHONPATH": path, FOLDER_VAR: str(folder)}


def _next_sitecustomize():
    """Load the sitecustomize this one hides (a distribution's, a cluster's), if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if os.environ.get(FOLDER_VAR) and os.environ.get("RANK") is not None:
        try:
            register(os.environ[FOLDER_VAR], os.environ["RANK"])
        except (OSError, ValueError, RuntimeError):  # an unwritable folder: the script runs without the hook
            pass
    _next_sitecustomize()
