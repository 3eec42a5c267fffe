"""Shared test helpers: run the CLI in-process and capture its output."""

from __future__ import annotations

from gpufleet.cli import main


def run_cli(capsys, argv, env=None):
    code = main(list(argv), env=env or {})
    out = capsys.readouterr()
    return code, out.out + out.err
