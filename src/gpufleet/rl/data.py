"""Prompts: a built-in task or a local dataset, read as a deterministic stream of positions.

Generation batch k takes stream positions [k*P, (k+1)*P). A position maps to a dataset row through a
seeded permutation per epoch, so the order depends only on (seed, position): not on the rank count,
and a resumed run continues the same order.
"""

from __future__ import annotations

import random
from typing import Any

from gpufleet import datafile
from gpufleet.config.schema import DataSection
from gpufleet.errors import UserError
from gpufleet.paths import user_path


class PromptSource:
    """`examples(start, count)`: dicts with the prompt under `prompt_field` plus every other column."""

    def __init__(self, cfg: DataSection, seed: int):
        self.cfg, self.seed = cfg, seed
        self.task = None
        self.rows: Any = None
        if cfg.path.startswith("builtin:"):
            from gpufleet import tasks

            try:
                self.task = tasks.get_task(cfg.path[len("builtin:") :])
            except ValueError as e:
                raise UserError(
                    str(e), field="data.path", fix="use builtin:repeat or a local .jsonl file"
                ) from None
            self.field = "prompt"
        else:
            self.rows = _load_rows(cfg.path, cfg.prompt_field)
            self.field = cfg.prompt_field
        self._perm: dict[int, list[int]] = {}

    def _index(self, position: int) -> int:
        """The dataset row at stream `position`."""
        n = len(self.rows)
        epoch, offset = divmod(position, n)
        if not self.cfg.shuffle:
            return offset
        if epoch not in self._perm:
            order = list(range(n))
            random.Random(f"gpufleet-data:{self.seed}:{epoch}").shuffle(order)
            self._perm = {epoch: order}  # only the current epoch is kept
        return self._perm[epoch][offset]

    def describe(self, position: int) -> str:
        """The prompt at stream `position` in words, for errors: "row 7 of data.jsonl"."""
        if self.task is not None:
            return f"example {position} of {self.cfg.path}"
        return f"row {self._index(position) + 1} of {self.cfg.path}"

    def _row(self, position: int) -> dict[str, Any]:
        if self.task is not None:
            return self.task.make_example(position, self.seed)
        index = self._index(position)
        row = dict(self.rows[index])
        if isinstance(self.rows, datafile.Scan):  # every column of the file, None where a row lacks it
            row = dict.fromkeys(self.rows.columns) | row  # (as datasets loads such a file; TRL reads that)
        prompt = row.get(self.field)
        if not isinstance(prompt, (str, list)) or not prompt:
            raise UserError(
                f"row {index} of {self.cfg.path} has prompt {prompt!r} in column {self.field!r}; "
                "a prompt is a non-empty string or a list of chat messages.",
                field="data.prompt_field",
                fix="clean that row or point data.prompt_field at the text column",
            )
        return row

    def examples(self, start: int, count: int) -> list[dict[str, Any]]:
        return [self._row(p) for p in range(start, start + count)]

    def reward_names(self) -> list[str]:
        return list(self.task.default_rewards) if self.task is not None else []

    def reward_columns(self) -> list[str]:
        """The columns reward functions get by keyword (`usercode.reward_columns`, as `gpufleet check`)."""
        from gpufleet.usercode import reward_columns

        if self.task is not None:
            names = list(self.task.make_example(0, self.seed))
        elif isinstance(self.rows, datafile.Scan):
            names = list(self.rows.columns)
        else:  # a hub dataset
            names = list(self.rows.column_names)
        return reward_columns(names, self.field)


def _load_rows(path: str, prompt_field: str):
    """A local file through `datafile.scan` (every row checked, as `gpufleet check` does), else a hub
    dataset through `datasets` (its rows are checked one by one as they are used, in `_row`)."""
    p = user_path(path)
    if p.exists() or p.is_symlink():
        return datafile.scan(p, prompt_field, keep=True)
    import datasets

    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(path, split="train")
    except (FileNotFoundError, ValueError, OSError, datasets.exceptions.DatasetNotFoundError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"cannot load {path}: {first}",
            field="data.path",
            fix="give a readable local .jsonl/.json/.parquet/.csv file or a reachable hub dataset",
        ) from None
    columns = list(rows.column_names)
    if prompt_field not in columns:
        raise UserError(
            f"{path} has no column {prompt_field!r} (columns: {', '.join(columns)}).",
            field="data.prompt_field",
            fix=f"--set data.prompt_field={columns[0] if columns else '<column>'}",
        )
    if len(rows) == 0:
        raise UserError(f"{path} holds no rows.", field="data.path", fix="give a dataset with prompts")
    return rows
