"""`gpufleet watch`: the view of a finished run (--once), and the live view of a real training run in a
real tmux pane (send-keys, capture-pane): it follows the steps, shows devices and ranks, and leaves on
Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.monitor.watch import bar, sparkline, value_range
from helpers import console_script, process_env, run_user

ROOT = Path(__file__).resolve().parents[1]


def test_sparkline_and_bar_by_hand():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([2.0, 2.0]) == "▁▁" and sparkline([]) == ""
    assert sparkline(list(range(100)), width=5) == "▁▃▅▆█"  # means of 0-19, 20-39, ...: 9.5 .. 89.5
    # the whole run, not its last `width` values: a rise early on stays visible
    assert sparkline([0.0] * 10 + [1.0] * 90, width=10) == "▁█████████"
    # the range is the run's own lowest and highest value (the last one included), not the bins' means
    assert value_range(list(range(100))) == "0 .. 99" and value_range([]) == "-"
    assert value_range([1.0] * 50 + [0.2]) == "0.2 .. 1"
    assert value_range([0.5, float("nan"), 0.51]) == "0.5 .. 0.51"
    assert bar(0.5, 10) == "█████░░░░░" and bar(1.7, 4) == "████"


def _train_argv(out: Path, steps: int) -> list[str]:
    argv = [console_script(), "train", str(ROOT / "examples" / "quickstart.yaml"), "--gpus", "cpu"]
    for s in (
        f"train.max_steps={steps}",
        "train.per_device_batch=8",
        "monitor.device_interval=0.2",
        f"output.dir={out}",
    ):
        argv += ["--set", s]
    return argv


def test_not_a_run_is_one_line(tmp_path):
    p = run_user("watch", str(tmp_path / "nothing"), "--once", cwd=tmp_path)
    assert p.returncode == 2 and "is not a folder" in p.stderr and p.stderr.strip().count("\n") == 0


class Tmux:
    """A tmux server of our own (its own socket), one pane of a fixed size."""

    def __init__(self, name: str):
        self.base = ["tmux", "-L", name]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "w")

    def wait_for(self, pred, timeout: float = 180) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.screen()
            if pred(text):
                return text
            time.sleep(0.3)
        raise AssertionError(f"tmux pane never matched; it shows:\n{self.screen()}")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="no tmux on PATH")
def test_live_view_follows_a_real_run_in_tmux(tmp_path):
    out = tmp_path / "live"
    train = subprocess.Popen(
        _train_argv(out, 8),
        env=process_env(),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    tmux = Tmux(f"gpufleet-test-{os.getpid()}")
    try:
        while not (out / "metrics.jsonl").exists():  # watch needs a run directory to exist
            assert train.poll() is None, train.stderr.read()
            time.sleep(0.2)
        cmd = f"{shlex.quote(console_script())} watch {shlex.quote(str(out))} --interval 0.3"
        tmux("new-session", "-d", "-s", "w", "-x", "110", "-y", "40", "-e", "COLUMNS=110", cmd)
        tmux("set-option", "-t", "w", "remain-on-exit", "on")
        early = tmux.wait_for(lambda s: "step " in s and "/8" in s)
        assert "curves" in early and "devices" in early and "ranks (last step)" in early
        assert "eta " in early or "finished" in early
        final = tmux.wait_for(lambda s: "step 8/8" in s and "finished" in s)
        assert train.wait(timeout=120) == 0
        assert "rank 0 policy" in final and "% cpu" in final and "GiB rss" in final
        assert any(ch in final for ch in "▁▂▃▄▅▆▇█")  # the sparklines
        assert "slowest phase" in final and re.search(
            r" 0 +│ +[\d.]+s │ (checkpoint|backward|generate) ", final
        )
        tmux("send-keys", "-t", "w", "C-c")
        tmux.wait_for(lambda s: tmux("display-message", "-p", "-t", "w", "#{pane_dead}").strip() == "1", 30)
    finally:
        train.kill()
        subprocess.run([*tmux.base, "kill-server"], capture_output=True)
    p = run_user("watch", str(out), "--once", cwd=tmp_path)  # and once, for scripts
    assert p.returncode == 0 and "step 8/8" in p.stdout and "finished" in p.stdout


MARKUP_SCRIPT = """
import json
import os
print("saved to [/tmp/ckpt] ok", flush=True)
if os.environ["RANK"] == "1":  # its last line, on stdout as the line before (one pump: in order)
    print("RuntimeError: [/__w/pytorch/pair.cc:553] Connection closed by peer", flush=True)
    raise SystemExit(1)
print("[bold]x", flush=True)
"""


def test_log_lines_and_commands_are_shown_as_written_not_read_as_markup(tmp_path):
    """A real 2-process launch whose ranks print `[/tmp/ckpt]` (a closing tag to rich), `[bold]x`, and a
    gloo-like error `[/__w/...]`; its command carries `[/red]`. watch (--once and live) shows each as it
    is: no MarkupError, no text swallowed."""
    home = tmp_path / "me"
    home.mkdir()
    (home / "br.py").write_text(MARKUP_SCRIPT)
    argv = [console_script(), "launch", "--gpus", "cpu", "--nproc", "2", "--set", "output.dir=runs/br"]
    done = subprocess.run(
        [*argv, "--", "python", "br.py", "[/red]"],
        cwd=home, env=process_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout + done.stderr
    p = run_user("watch", "runs/br", "--once", cwd=home, env_extra={"COLUMNS": "200"})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    words = " ".join(p.stdout.split())
    assert "[/__w/pytorch/pair.cc:553] Connection closed by peer" in words, p.stdout  # rank 1's error
    assert "[bold]x" in words and "br.py '[/red]'" in words, p.stdout  # rank 0's last line; the command
    live = subprocess.Popen(
        [console_script(), "watch", "runs/br", "--interval", "0.2"],
        cwd=home, env=process_env(COLUMNS="200"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2)
    live.send_signal(signal.SIGINT)
    out, err = live.communicate(timeout=30)
    assert live.returncode == 0 and "Traceback" not in err, err
    assert "[bold]x" in out, out


@pytest.mark.parametrize(
    "how",
    [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
    ids=["kill-9", "ctrl-c"],
)
def test_a_one_process_run_stopped_at_step_2_is_said_to_have_ended(tmp_path, how):
    """A real 1-process `gpufleet train` (its sampler samples its own process, so no record ever finds
    the rank gone; kill -9 writes nothing more) stopped after step 2 of 40: watch says it runs (ETA) while
    it does, then watch and report say it ended before its last step, not that it is running."""
    out, metrics = tmp_path / "runs" / "x", tmp_path / "runs" / "x" / "metrics.jsonl"
    proc = subprocess.Popen(_train_argv(out, 40), cwd=tmp_path, env=process_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if 2 in [json.loads(x).get("step") for x in lines if x.endswith("}")]:  # whole lines
                break
            time.sleep(0.05)
        running = run_user("watch", str(out), "--once", cwd=tmp_path, env_extra={"COLUMNS": "160"}).stdout
        proc.send_signal(how)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == (-9 if how == signal.SIGKILL else 130), proc.returncode
    assert re.match(r"x  step \d+/40 .* eta \d+:\d\d$", running.splitlines()[0]), running
    assert "the run is over" not in running, running
    p = run_user("watch", str(out), "--once", cwd=tmp_path, env_extra={"COLUMNS": "160"})
    assert p.returncode == 0, p.stderr
    header = p.stdout.splitlines()[0]
    said = r"x  step \d+/40 .* ended before its last step \(no final model; see logs/\)"
    assert re.match(said, header), p.stdout
    assert "the run is over: peaks over the run" in p.stdout, p.stdout
    r = run_user("report", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    page = (out / "report" / "index.html").read_text()
    assert re.search(r"x ended before its last step \(step \d+ of 40; no final model; see its logs/\)", page)
