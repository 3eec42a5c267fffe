"""Small wording helpers for what the CLI prints."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 step`, `2 steps`, `2 processes` (`many` for irregular plurals)."""
    regular = word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{n} {word if n == 1 else (many or regular)}"
