"""The user guide stays true: docs/reference.md is what the schema generates, every page the README links
exists, and `mkdocs build --strict` (broken links, anchors, pages) passes, offline."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.config.reference import markdown, type_text
from gpufleet.config.schema import SECTIONS, field_paths

ROOT = Path(__file__).resolve().parents[1]


def test_reference_page_is_what_the_schema_generates():
    page = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert page == markdown(), "run: .venv/bin/python -m gpufleet.config.reference > docs/reference.md"


def test_reference_names_every_field_with_its_env_variable_and_default():
    page = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    for path in field_paths():
        section, name = path.split(".")
        env = f"GPUFLEET_{section.upper()}__{name.upper()}"
        row = next((x for x in page.splitlines() if x.startswith(f"| `{path}`<br>`{env}` |")), None)
        assert row is not None, path
        info = SECTIONS[section].model_fields[name]
        assert type_text(info.annotation, info.metadata) in row.replace("\\|", "|"), path


def test_type_text_reads_the_schema_types():
    fields = {p: SECTIONS[p.split(".")[0]].model_fields[p.split(".")[1]] for p in field_paths()}

    def text(path):
        return type_text(fields[path].annotation, fields[path].metadata)

    assert text("train.per_device_batch") == "int >= 1"
    assert text("train.global_batch") == "int >= 1 or null"
    assert text("placement.strategy") == "one of `ddp`, `fsdp`"
    assert text("placement.reference") == "`auto`, `colocate` or list of int >= 0"
    assert text("algorithm.scale_rewards") == "one of `group`, `batch`, `none` or null"
    assert text("script.command") == "command line (a string or a list)"


def test_readme_links_into_the_guide_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(((?:docs|bench)/[^)#]+)", readme)
    assert len(links) >= 15, links
    for link in links:
        assert (ROOT / link).is_file(), link
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= {Path(x).name for x in links if x.startswith("docs/")}, "a guide page the README omits"


def test_quickstart_commands_are_the_readmes():
    """The commands the slow quickstart test runs come from the README's Quickstart block."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_readme_quickstart import quickstart_commands

    commands = quickstart_commands()
    assert commands[0] == ".venv/bin/gpufleet check examples/quickstart.yaml"
    assert any(c.startswith(".venv/bin/gpufleet export") for c in commands)
    assert "```python\nfrom transformers import" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.skipif(not (Path(sys.executable).parent / "mkdocs").exists(), reason="mkdocs not installed")
def test_guide_builds_strict(tmp_path):
    site = tmp_path / "site"
    p = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (site / "troubleshooting" / "index.html").is_file()
    html = "".join(f.read_text(encoding="utf-8") for f in site.rglob("*.html"))
    assert "cdnjs" not in html and "googleapis" not in html  # nothing fetched from the network to read it
    shutil.rmtree(site)
