"""Reward functions for examples/agent-frozenlake.yaml, scored on the whole transcript (TRL's signature).

An env job's completion is the episode after the first prompt: the policy's moves and the grids the
environment answered with. Gymnasium's FrozenLake pays 1 only at the goal, which a random-init model
never reaches in 8 turns; `progress` adds a dense signal for getting closer.
"""

from __future__ import annotations


def _cells(text: str) -> list[str]:
    """The rows of the last grid in `text` (FrozenLake renders rows of S F H G and * for the agent)."""
    rows: list[str] = []
    last: list[str] = []
    for line in text.splitlines():
        if line and set(line) <= set("SFHG*"):
            rows.append(line)
            if len(rows) >= 2:
                last = list(rows)
        else:
            rows = []
    return last


def progress(prompts: list[str], completions: list[str], **_) -> list[float]:
    """How much closer to G the agent's last seen cell is than the start: 1 - distance / start distance."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        grid = _cells(prompt + completion)
        where = [(r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == "*"]
        goal = [(r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == "G"]
        if not where or not goal:
            out.append(0.0)
            continue
        (r, c), (gr, gc) = where[0], goal[0]
        start = gr + gc  # S is the top-left corner
        out.append(1.0 - (abs(gr - r) + abs(gc - c)) / start)
    return out
