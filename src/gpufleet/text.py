"""Small wording helpers for what the CLI prints."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 step`, `2 steps` (`many` for irregular plurals: plural(2, "process", "processes"))."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
