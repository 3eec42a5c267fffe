"""Paths as the user writes them (gpufleet/paths.py)."""

from __future__ import annotations

from pathlib import Path

from gpufleet.paths import user_path


def test_the_home_is_expanded_and_an_unknown_user_left_as_written(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert user_path("~/data.jsonl") == Path("/home/someone/data.jsonl")
    assert user_path(Path("~")) == Path("/home/someone")
    assert user_path("~nosuchuser0/x") == Path("~nosuchuser0/x")  # pathlib's expanduser raises here
    assert user_path("runs/a") == Path("runs/a")
