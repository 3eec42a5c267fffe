"""Nothing hangs silently (issue 34 section 1): a launched script whose rank never reaches an all_reduce is
stopped after `launch.collective_timeout` seconds of silence, with every rank's Python stack (faulthandler,
from the ranks themselves), the rank that did not arrive named with its line, and no process left."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from gpufleet.launch import stacks
from gpufleet.launch.stall import Silence
from helpers import run_user
from test_interrupt import gone, processes_of

HANG = """
import os, time, torch, torch.distributed as dist
open(f"pid{os.environ['RANK']}", "w").write(str(os.getpid()))
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} up", flush=True)
if rank == 1:
    time.sleep(3600)  # never arrives
dist.all_reduce(torch.ones(1))
"""


@pytest.mark.slow
def test_a_rank_that_never_arrives_is_named_with_its_line_and_every_rank_stops(tmp_path):
    (tmp_path / "hang.py").write_text(HANG)
    argv = ["launch", "--gpus", "cpu", "--nproc", "2", "--set", "output.dir=run"]
    started = time.monotonic()
    p = run_user(*argv, "--set", "launch.collective_timeout=10", "--", "python", "hang.py", cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert time.monotonic() - started < 90
    script = tmp_path / "hang.py"
    err = p.stderr
    assert "the run hangs: no rank printed anything for 1" in err and "rank 1 held it up" in err, err
    assert f"rank 1 did not arrive: it is at {script}:8 in <module>: time.sleep(3600)" in err, err
    assert f"rank 0 waits in all_reduce, called at {script}:9 in <module>" in err, err
    dump = (tmp_path / "run" / "logs" / "stacks.txt").read_text()
    assert f'File "{script}", line 8 in <module>' in dump and f'File "{script}", line 9 in <module>' in dump
    assert "distributed_c10d.py" in dump and "=== rank 0" in dump and "=== rank 1" in dump
    assert gone(tmp_path / "run"), processes_of(tmp_path / "run")
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "a rank outlived the launch"


def test_silence_says_what_it_waits_on_and_output_resets_it(tmp_path):
    """The heartbeat (a minute in a run; 0.3 s here) and the clock that any byte of any rank restarts."""
    logs = tmp_path / "logs"
    logs.mkdir()
    said: list[str] = []
    watch = Silence(logs, [0, 1], 120, tmp_path / "hooks", logs / "stacks.txt", said.append, first=0.3)
    (logs / "rank0.log").write_text("start\n")
    time.sleep(0.4)
    assert not watch() and not said  # rank 1 has not started: the rendezvous is not the ranks' silence
    (logs / "rank1.log").write_text("start\n")
    assert not watch()
    time.sleep(0.4)
    assert not watch() and said == [
        "gpufleet: no rank has printed for 0 s; waiting (launch.collective_timeout 120 s)"
    ]
    (logs / "rank1.log").write_text("start\na line\n")
    assert not watch() and watch.quiet < 0.1 and len(said) == 1


def frames(*where: tuple[str, int, str]) -> str:
    body = "".join(f'  File "{f}", line {n} in {fn}\n' for f, n, fn in where)
    return f"Current thread 0x00007f (most recent call first):\n{body}"


C10D = "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def test_who_did_not_arrive_from_the_stacks():
    waits = stacks.RankStack(
        0, 10, "", stacks.main_thread(frames((C10D, 5, "barrier"), ("/me/t.py", 9, "<module>")))
    )
    late = stacks.RankStack(
        1, 11, "", stacks.main_thread(frames(("/me/t.py", 4, "load"), ("/me/t.py", 8, "<module>")))
    )
    lines, blame = stacks.findings({0: waits, 1: late}, [0, 1])
    assert blame == [1] and lines[0] == "rank 1 did not arrive: it is at /me/t.py:4 in load"
    assert "rank 0 waits in barrier, called at /me/t.py:9 in <module>" in lines
    lines, blame = stacks.findings({0: waits, 1: None}, [0, 1, 2])
    assert (
        blame == [1]
        and "rank 1: its process has ended" in lines
        and any("rank 2: no stack" in x for x in lines)
    )
    lines, blame = stacks.findings({0: late}, [0])
    assert blame == [0] and any("no rank is inside a torch.distributed call" in x for x in lines)


HANGING_REWARD = """
import os, time


def hang_on_rank1(prompts, completions, **kw):
    if os.environ.get("RANK") == "1":
        time.sleep(3600)  # never returns
    return [len(c) / 10 for c in completions]
"""


@pytest.mark.slow
def test_train_collective_timeout_shows_every_ranks_stack(tmp_path):
    """`gpufleet train`: rank 1's reward function never returns; rank 0's gather times out after
    launch.collective_timeout and the summary names rank 1 at the reward function's line."""
    (tmp_path / "hangrew.py").write_text(HANGING_REWARD.lstrip())
    quick = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
    sets = [
        "output.dir=run",
        "launch.nproc_per_node=2",
        "train.per_device_batch=4",
        "reward.functions=hangrew:hang_on_rank1",
        "reward.weights=null",
        "reward.timeout=3600",
        "launch.collective_timeout=10",
    ]
    p = run_user("train", str(quick), "--gpus", "cpu", *[x for s in sets for x in ("--set", s)], cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    reward = tmp_path / "hangrew.py"
    assert "rank 0 failed: RuntimeError:" in p.stderr and "Timed out waiting 10000ms" in p.stderr, p.stderr
    assert f"rank 1 did not arrive: it is at {reward}:6 in hang_on_rank1: time.sleep(3600)" in p.stderr
    assert "rank 0 waits in all_gather, called at" in p.stderr
    # while it waited, the launcher said so (from collective_timeout / 2 on) and what bounds the wait
    assert re.search(
        r"gpufleet: no rank has printed for \d+ s; waiting \(a collective that waits launch", p.stderr
    )
    dump = (tmp_path / "run" / "logs" / "stacks.txt").read_text()
    assert f'File "{reward}", line 6 in hang_on_rank1' in dump and "=== rank 0" in dump
    assert gone(tmp_path / "run"), processes_of(tmp_path / "run")


def test_the_stack_hook_keeps_the_sitecustomize_it_hides(tmp_path):
    """A distribution's or a cluster's own sitecustomize still runs under gpufleet's hook, and the hook has
    registered the process (its stack file exists)."""
    import subprocess
    import sys

    from gpufleet.launch.stackhook import hook_env

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    env = {"PATH": "/usr/bin:/bin", "RANK": "3", **hook_env(tmp_path / "stacks", str(theirs))}
    code = (
        "import os, sitecustomize; print(os.environ.get('THEIRS_RAN'), sitecustomize.__file__, os.getpid())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    ran, module, pid = out.stdout.split()
    assert (ran, module) == ("yes", str(theirs / "sitecustomize.py")), out.stderr
    assert (tmp_path / "stacks" / f"rank3.{pid}.txt").exists()


SILENT = """
import time
print("loading", flush=True)
while True:
    time.sleep(1)  # stuck without a collective (or a wait NCCL would show only at the next sync)
"""


@pytest.mark.slow
def test_a_silent_rank_outside_any_collective_is_stopped_only_once_it_has_not_moved(tmp_path):
    """No rank in a collective at the first look: the run goes on (a silent evaluation looks the same);
    a collective_timeout later, every rank still at the same line: stopped, with where it is."""
    (tmp_path / "silent.py").write_text(SILENT.lstrip())
    argv = ["launch", "--gpus", "cpu", "--nproc", "1", "--set", "output.dir=run"]
    p = run_user(*argv, "--set", "launch.collective_timeout=10", "--", "python", "silent.py", cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    first = "none waits in a torch.distributed call (rank 0 at"
    assert first in p.stderr and "still running: stopped if no rank has moved in another 10 s" in p.stderr
    assert p.stderr.index(first) < p.stderr.index("gpufleet: the run hangs: no rank printed anything for 2")
    assert f"rank 0 is at {tmp_path / 'silent.py'}:4 in <module>: time.sleep(1)" in p.stderr, p.stderr
    assert gone(tmp_path / "run"), processes_of(tmp_path / "run")
