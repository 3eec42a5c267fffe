"""A rank or child that a signal ended is named by its signal ("was killed by SIGABRT (signal 6)"), never
as a bare "exited with code -6": in `gpufleet launch`'s summary (the rank's exit record), in `gpufleet
train`'s summary of a rank that died without an error record (torchrun's failure summary), and for env
servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpufleet.launch.diagnose import Failure, agent_exits, how_it_ended, killed_rank, unexplained
from gpufleet.launch.recipe import Recipe
from gpufleet.launch.scriptfail import explain
from gpufleet.launch.torchrun import free_port


@pytest.mark.parametrize(
    "code, words",
    [
        (-6, "was killed by SIGABRT (signal 6)"),
        (-9, "was killed by SIGKILL (signal 9)"),
        (-11, "was killed by SIGSEGV (signal 11)"),
        (-99, "was killed by an unnamed signal (signal 99)"),
        (3, "exited with code 3"),
        (0, "exited with code 0"),
        (134, "exited with code 134 (128 + 6: killed by SIGABRT?)"),
        (255, "exited with code 255"),
    ],
)
def test_exit_status_in_words(code, words):
    assert how_it_ended(code) == words


# torchrun 2.x's failure summary (as printed by the installed torch; see the real run below)
SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
s.py FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_03:49:40
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 7024)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 7024
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_03:49:40
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 7025)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 7025
======================================================
"""


def test_torchrun_summary_root_cause_first():
    assert agent_exits(SUMMARY) == [(1, -6), (0, -15)]
    assert agent_exits("no summary here") == []


def test_train_summary_names_the_signal_of_this_run_only(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("step 1\n")
    (logs / "rank1.log").write_text("step 1\n")
    agent = logs / "torchrun.log"
    earlier = SUMMARY.replace("exitcode  : -6", "exitcode  : -9")  # an earlier run in the same folder
    agent.write_text(earlier)
    since = agent.stat().st_size
    with agent.open("a") as f:
        f.write(SUMMARY)
    head = unexplained(logs, 1, agent.read_text()[since:]).splitlines()[0]  # train reads from `since`
    assert head.startswith(
        "gpufleet: rank 1 was killed by SIGABRT (signal 6) without an error record (torchrun exit code 1): "
        "a crash in native code"
    ), head
    old = logs / "torchrun.old.log"
    old.write_text(earlier)
    killed = unexplained(logs, 1, old.read_text()).splitlines()[0]
    assert "rank 1 was killed by SIGKILL (signal 9)" in killed and "out-of-memory killer" in killed
    assert "likely killed by a signal" in unexplained(logs, 1).splitlines()[0]  # no agent log: as before


def test_a_peers_connection_error_is_not_the_root_cause(tmp_path):
    """Rank 1 aborts; rank 0's collective then fails with gloo's "Connection reset by peer" and writes the
    only error record. The killed rank is the cause; rank 0's error is shown as its echo."""
    echo = Failure(0, "RuntimeError", "[pair.cc:537] Read error: Connection reset by peer. GLHF", False, [])
    assert killed_rank(echo, SUMMARY) == (1, -6) and killed_rank(None, SUMMARY) == (1, -6)
    real = Failure(0, "ValueError", "bad shape", False, [])  # a real exception of its own: it is the cause
    assert killed_rank(real, SUMMARY) is None and killed_rank(echo, "no summary") is None
    user = Failure(0, "UserError", "reward function f raised", True, [])
    assert killed_rank(user, SUMMARY) is None
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "torchrun.log").write_text(SUMMARY)
    lines = unexplained(logs, 1, (logs / "torchrun.log").read_text(), echo=echo).splitlines()
    assert lines[0].startswith("gpufleet: rank 1 was killed by SIGABRT (signal 6) without an error record")
    assert lines[1] == f"  then rank 0 failed: RuntimeError: {echo.message} (its peer was gone)"


def test_launch_summary_names_the_signal(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank1.log").write_text("--- rank 1 ---\nloading\n")
    (logs / "rank1.exit.json").write_text(json.dumps({"rank": 1, "code": -6, "time": time.time()}))
    r = Recipe(devices=2, per_device_batch=4, grad_accum=1, learning_rate=1e-3, max_steps=10)
    text = explain(logs, 1, r, r)
    assert text.startswith("gpufleet: rank 1 failed first: the command was killed by SIGABRT (signal 6)"), (
        text
    )


def test_a_real_torchrun_abort_is_named(tmp_path):
    """The installed torchrun's own summary of a rank that called abort(), read as `gpufleet train` reads it."""
    script = tmp_path / "s.py"
    script.write_text('import os, time\nif os.environ["RANK"] == "1":\n    os.abort()\ntime.sleep(3)\n')
    logs = tmp_path / "logs"
    logs.mkdir()
    agent = logs / "torchrun.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with agent.open("w") as f:
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            + ["--master-port", str(free_port()), str(script)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=120,
        )
    assert p.returncode != 0
    head = unexplained(logs, p.returncode, agent.read_text()).splitlines()[0]
    assert "rank 1 was killed by SIGABRT (signal 6)" in head, agent.read_text()


def _rank1_done_before(tmp_path, error: str):
    """Logs of a launch whose rank 0 failed with `error` now, 3 s after rank 1 exited 0; a 2-rank recipe."""
    logs = tmp_path / "logs"
    logs.mkdir()
    now = time.time()
    (logs / "rank0.log").write_text(f"--- rank 0 ---\n{error}\n")
    (logs / "rank0.exit.json").write_text(json.dumps({"rank": 0, "code": 1, "time": now}))
    (logs / "rank1.done.json").write_text(json.dumps({"rank": 1, "time": now - 3}))
    return logs, now, Recipe(devices=2, per_device_batch=4, grad_accum=1, learning_rate=1e-3, max_steps=10)


def test_a_rank_that_ended_early_is_named_as_the_cause(tmp_path):
    """Rank 1 exited 0 (rank1.done.json) while rank 0 still waited for it: rank 0's gloo error is the echo,
    the early end the cause, with the fix."""
    logs, now, r = _rank1_done_before(tmp_path, "RuntimeError: [pair.cc:553] Connection closed by peer")
    first = explain(logs, 1, r, r).splitlines()[0]
    assert first.startswith("gpufleet: rank 0 failed first: rank 1 ended (exit code 0) 3 s before"), first
    assert "Connection closed by peer" in first and "do not return early on some ranks" in first
    (logs / "rank1.done.json").write_text(json.dumps({"rank": 1, "time": now + 3}))  # ended after: not it
    assert "ended (exit code 0)" not in explain(logs, 1, r, r)


def test_an_ordinary_error_after_a_clean_end_is_that_error(tmp_path):
    """Rank 1 returned after destroy_process_group (a rank-0-only save follows): rank 0's own ValueError is
    the cause, not rank 1's clean end."""
    logs, _, r = _rank1_done_before(tmp_path, "ValueError: no such column")
    assert (
        explain(logs, 1, r, r).splitlines()[0] == "gpufleet: rank 0 failed first: ValueError: no such column"
    )


def test_a_launch_clears_the_ends_an_earlier_launch_left(tmp_path):
    """A re-launch into the same folder: this node's ranks' records and (node 0) those of ranks past its
    world go; another node's stay."""
    from types import SimpleNamespace

    from gpufleet.launch.scriptrun import _clear_ends

    logs = tmp_path / "logs"
    logs.mkdir()
    for name in (
        "rank0.exit.json",
        "rank1.done.json",
        "rank2.done.json",
        "rank5.exit.json",
        "rankx.done.json",
    ):
        (logs / name).write_text("{}")
    _clear_ends(logs, SimpleNamespace(node_rank=0, nnodes=2), per_node=2)  # node 0: ranks 0-1; world 4
    assert sorted(p.name for p in logs.iterdir()) == ["rank2.done.json", "rankx.done.json"]
