"""`gpufleet report`: a real run's page and PNGs, several runs overlaid, opened in a real headless
Chromium (the page loads, logs nothing to the console, every figure decodes); a folder that holds no
run is one line and exit 2."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import console_script, process_env, run_user

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real 4-step quickstart run with the device sampler on (one process, CPU)."""
    home = tmp_path_factory.mktemp("report")
    out = home / "quick"
    argv = [console_script(), "train", str(ROOT / "examples" / "quickstart.yaml"), "--gpus", "cpu"]
    for s in (
        "train.max_steps=4",
        "train.per_device_batch=8",
        "monitor.device_interval=0.2",
        f"output.dir={out}",
    ):
        argv += ["--set", s]
    p = subprocess.run(argv, capture_output=True, text=True, env=process_env(), cwd=home, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


def test_report_of_one_run(run):
    p = run_user("report", str(run), cwd=run.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    index = run / "report" / "index.html"
    assert p.stdout.strip() == f"report: {index}"
    page = index.read_text()
    assert sorted(x.name for x in (run / "report").glob("*.png")) == [
        "curves.png",
        "devices.png",
        "timing.png",
    ]
    for section in ("Summary", "Curves", "Where the step&#x27;s time goes", "Devices over time"):
        assert f">{section}</h2>" in page, section
    assert "Plan vs measured peak memory" in page and "<td>policy rank 0</td>" in page
    assert (
        "Resolved job: quick" in page and "max_steps: 4  # flag --set train.max_steps=4" in page
    )  # the value's source
    assert len(re.findall(r'<img src="data:image/png;base64,', page)) == 3  # self-contained
    assert "http://" not in page and "https://" not in page and "<script" not in page


def test_names_are_text_not_tex(run, tmp_path):
    """A run folder named `q$\\alpha\\q$` (two dollars: mathtext to matplotlib, which raised on the unknown
    `\\q` in the figures' legends): the report draws it as written."""
    named = tmp_path / "q$\\alpha\\q$"
    shutil.copytree(run, named, ignore=shutil.ignore_patterns("report"))
    p = run_user("report", str(named), str(run), "--out", "cmp", cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "gpufleet report: q$\\alpha\\q$, quick" in (tmp_path / "cmp" / "index.html").read_text()


def test_not_a_run_is_one_line(tmp_path):
    p = run_user("report", str(tmp_path), cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "holds no metrics.jsonl" in p.stderr


def chromium(page: Path) -> tuple[str, list[str]]:
    """The DOM after load and the console lines of a headless Chromium opening `page`."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    p = subprocess.run([*argv, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    return p.stdout, [line for line in p.stderr.splitlines() if ":CONSOLE" in line]


# Appended to a copy of the page: after load, the decoded width of every image goes into the DOM.
PROBE = "<script>onload=()=>{document.body.dataset.widths=[...document.images].map(i=>i.naturalWidth).join()}</script>"


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (`make test` installs it when root)")
def test_two_runs_overlaid_in_a_real_browser(run, tmp_path):
    other = tmp_path / "quick-copy"
    shutil.copytree(run, other, ignore=shutil.ignore_patterns("report", "checkpoint*", "final"))
    p = run_user("report", str(run), str(other), "--out", str(tmp_path / "both"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    index = tmp_path / "both" / "index.html"
    dom, console = chromium(index)
    assert console == [] and "<h1>gpufleet report: quick, quick-copy</h1>" in dom
    for fig in ("curves", "timing", "devices"):
        assert f'id="fig-{fig}"' in dom
    probe = tmp_path / "both" / "probe.html"
    probe.write_text(index.read_text().replace("</body>", PROBE + "</body>"))
    dom, console = chromium(probe)
    widths = [int(w) for w in re.search(r'data-widths="([\d,]+)"', dom).group(1).split(",")]
    assert len(widths) == 3 and min(widths) > 500 and console == []
    # The detector sees what it should: a page with a console error is caught.
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>console.error('boom')</script></body></html>")
    assert any('"boom"' in line for line in chromium(bad)[1])
