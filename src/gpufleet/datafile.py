"""A local data file (.jsonl / .json / .csv / .parquet, text ones also .gz / .bz2 / .xz) or a folder of
them: validated and read by ONE parser.

`gpufleet check` and the trainer's loader both call `scan`, so they cannot disagree: check parses a
file up to FULL_CHECK_BYTES completely and, beyond that, its first CHECK_HEAD_ROWS rows; the loader
parses all of it with the same code, so a problem past the head is the same one-line error at load.
Memory stays bounded while checking: a line (or CSV record) over MAX_LINE_BYTES is refused by number.

Every problem is a `DataFileError` (a `UserError`) naming the file, the line / row, what is wrong and
the fix. Text formats are UTF-8 (a UTF-8 byte-order mark is allowed); CSV cells stay strings. How a text
file becomes records is datarecords.py's; what a record must hold is this module's.
"""

from __future__ import annotations

import heapq
import lzma
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet import datapath, datarecords
from gpufleet.datapath import DataFileError
from gpufleet.datarecords import MAX_LINE_BYTES, kind  # noqa: F401 (MAX_LINE_BYTES: said here too)
from gpufleet.paths import user_path

FORMATS = (".jsonl", ".json", ".csv", ".parquet")
FULL_CHECK_BYTES = 64 << 20
LONGEST = 16  # prompts kept by `scan` as the longest (by characters): check tokenises them (rules/prompts.py)
CHARS_PER_TOKEN = 32


def prompt_chars(max_prompt_length: int) -> int:
    """Characters of a prompt tokenised (its last ones): a long prompt is cut (from the left, as its ids
    are) to max(4096, CHARS_PER_TOKEN x max_prompt_length) characters first, so a 10 MB line costs what a
    short one does (rl/batch.py `encode_prompt`; check's count, rules/prompts.py, the same)."""
    return max(4096, CHARS_PER_TOKEN * max_prompt_length)


CHECK_HEAD_ROWS = 10_000


@dataclass
class Scan:
    """What one pass over the file found: the columns, the rows (kept only when loading), how many."""

    columns: list[str]
    count: int = 0
    complete: bool = True
    rows: list[dict[str, Any]] | None = None
    table: Any = None  # a pyarrow Table for .parquet when loading
    first_chat: str | None = None  # where the first chat-format prompt (a list of messages) is
    longest: list[tuple[int, int, str, Any]] = field(default_factory=list)
    """The LONGEST prompts by characters (a chat prompt: its messages' contents), as a heap of
    (characters, order, where, prompt); `longest_prompts()` gives them longest first."""
    _seen: set[str] = field(default_factory=set)
    _order: int = 0

    def longest_prompts(self) -> list[tuple[str, Any]]:
        """(where, prompt) of the longest prompts read, longest first."""
        return [(where, value) for _, _, where, value in sorted(self.longest, reverse=True)]

    def _keep_if_long(self, name: str, where: str, value: Any) -> None:
        """Keep the prompt at `name where` if it is among the LONGEST so far (a length and a compare for
        most rows: this runs for every row train loads)."""
        size = len(value) if isinstance(value, str) else sum(len(m["content"]) for m in value)
        self._order += 1
        if len(self.longest) >= LONGEST and size <= self.longest[0][0]:
            return  # no longer than the shortest kept (and later: the earlier row counts as longer)
        entry = (size, -self._order, f"{name} {where}" if name else where, value)
        (heapq.heappush if len(self.longest) < LONGEST else heapq.heappushpop)(self.longest, entry)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.table is not None:
            return self.table.slice(index, 1).to_pylist()[0]
        assert self.rows is not None, "scan(..., keep=True) keeps the rows"
        return self.rows[index]


def check_limit(path: Path) -> int | None:
    """Rows `gpufleet check` parses: all for a file up to FULL_CHECK_BYTES (as text), else the first
    CHECK_HEAD_ROWS."""
    try:
        files = datapath.folder_files(path, str(path), FORMATS) if path.is_dir() else [path]
        # compressed: ~8x as much text
        size = sum(f.stat().st_size * (8 if datapath.suffixes(f)[1] else 1) for f in files)
        return None if size <= FULL_CHECK_BYTES else CHECK_HEAD_ROWS
    except (OSError, DataFileError):
        return None


def scan(path: str | Path, prompt_field: str, *, max_rows: int | None = None, keep: bool = False) -> Scan:
    """Parse `path` (at most `max_rows` rows), checking every row's prompt; `keep`: hold the rows."""
    p = user_path(path)
    name = str(path)
    if p.is_dir():
        return _scan_folder(p, name, prompt_field, max_rows, keep)
    datapath.check_regular(p, name)  # a pipe, a device, a folder, a loop: said before anything is read
    suffix, compression = datapath.suffixes(p)
    if suffix not in FORMATS or (compression and suffix == ".parquet"):
        what = f"{suffix}{compression or ''}" or "no extension"
        raise DataFileError(
            f"{name}: {what} is not a data format gpufleet reads.",
            "convert it to .jsonl, .json, .parquet or .csv (text formats may be .gz, .bz2 or .xz)",
        )
    if suffix == ".parquet":
        return _scan_parquet(p, name, prompt_field, max_rows, keep)
    try:
        with datapath.open_binary(p, name) as f:
            return _scan_text(f, name, suffix, prompt_field, max_rows, keep)
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise DataFileError(
            f"{name} cannot be read ({getattr(e, 'strerror', None) or e}).",
            "check the file (a truncated or corrupt compressed file?) and its permissions",
        ) from None


def _scan_folder(p: Path, name: str, prompt_field: str, max_rows: int | None, keep: bool) -> Scan:
    """A folder of data files: each file scanned as above (named in errors), the rows in file order."""
    total = Scan(columns=[], rows=[] if keep else None)
    for f in datapath.folder_files(p, name, FORMATS):
        left = None if max_rows is None else max_rows - total.count
        if left == 0:
            total.complete = False
            break
        s = scan(f, prompt_field, max_rows=left, keep=keep)
        total.count += s.count
        total.complete &= s.complete
        total.columns += [c for c in s.columns if c not in total.columns]
        total.first_chat = total.first_chat or s.first_chat
        for _, _, where, value in sorted(s.longest, key=lambda e: -e[1]):  # in file order
            total._keep_if_long("", where, value)
        if keep:
            total.rows.extend(s.rows if s.rows is not None else s.table.to_pylist())
    return total


# ------------------------------------------------------------------------------------------ rows


def _check_prompt(name: str, where: str, rec: Any, prompt_field: str, s: Scan) -> bool:
    """One record: an object whose prompt is a non-empty string or a list of chat messages. False when
    it lacks the prompt key and no row before it had one (the column may not exist at all)."""
    if not isinstance(rec, dict):
        raise DataFileError(
            f"{name} {where}: a record must be an object with a {prompt_field!r} key, not {kind(rec)}.",
            'write one object per line, e.g. {"' + prompt_field + '": "..."}',
        )
    for key in rec:
        if key not in s._seen:
            s._seen.add(key)
            s.columns.append(key)
    if prompt_field not in rec:
        if prompt_field not in s._seen:
            return False  # maybe the column does not exist at all: decided at the end (`_finish`)
        raise DataFileError(
            f"{name} {where} has no {prompt_field!r} (the rows before it have one).",
            f"add {prompt_field!r} to that row or remove the row",
            field="data.prompt_field",
        )
    value = rec[prompt_field]
    if isinstance(value, str) and value:
        s._keep_if_long(name, where, value)
        return True
    chat = (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)
    )
    if chat and s.first_chat is None:
        s.first_chat = f"{name} {where}"
    if chat:
        s._keep_if_long(name, where, value)
    if not chat:
        ids = isinstance(value, list) and value and all(isinstance(v, int) for v in value)
        raise DataFileError(
            f"{name} {where}: {prompt_field!r} is {kind(value)}; a prompt is a non-empty string "
            "or a list of chat messages ({'role': ..., 'content': '...'}).",
            "store the prompt as text (tokenizer.decode(ids)); gpufleet tokenises it itself"
            if ids
            else "fix that row, or point data.prompt_field at the text column",
            field="data.prompt_field",
        )
    return True


def _finish(name: str, prompt_field: str, s: Scan, first_missing: str | None) -> Scan:
    if s.count == 0:
        raise DataFileError(f"{name} holds no rows.", "give a file with at least one prompt")
    if prompt_field not in s._seen:
        raise _no_column(name, prompt_field, s.columns)
    if first_missing is not None:  # the first rows lacked the prompt, a later one had it
        raise DataFileError(
            f"{name} {first_missing} has no {prompt_field!r} (other rows have one).",
            f"add {prompt_field!r} to that row or remove the row",
            field="data.prompt_field",
        )
    return s


def _no_column(name: str, prompt_field: str, columns: list[str]) -> DataFileError:
    import difflib

    likely = [
        c for c in ("prompt", "question", "query", "problem", "instruction", "input", "text") if c in columns
    ]
    close = difflib.get_close_matches(prompt_field, columns, n=1) or likely or columns[:1]
    sep = next((c for c in ";\t|" if len(columns) == 1 and c in columns[0]), None)
    if sep is not None and ".csv" in name:  # one column named 'prompt;answer': not comma-separated
        return DataFileError(
            f"{name} is not comma-separated: its one column is {columns[0]!r} (split by {sep!r}).",
            "save it with commas (pandas: df.to_csv(path, index=False)), or as .jsonl",
            field="data.path",
        )
    return DataFileError(
        f"{name} has no column {prompt_field!r} (columns: {', '.join(columns[:10]) or 'none'}).",
        f"--set data.prompt_field={close[0]}" if close else "add a prompt column to the file",
        field="data.prompt_field",
    )


# ------------------------------------------------------------------------------------ text formats


def _scan_text(f, name: str, suffix: str, prompt_field: str, max_rows: int | None, keep: bool) -> Scan:
    records = datarecords.records(f, name, suffix)
    s = Scan(columns=[], rows=[] if keep else None)
    first_missing = None
    for where, rec in records:
        if max_rows is not None and s.count >= max_rows:
            s.complete = False
            break
        if not _check_prompt(name, where, rec, prompt_field, s) and first_missing is None:
            first_missing = where
        s.count += 1
        if keep:
            s.rows.append(rec)
    return _finish(name, prompt_field, s, first_missing)


# ---------------------------------------------------------------------------------------- parquet


def _scan_parquet(p: Path, name: str, prompt_field: str, max_rows: int | None, keep: bool) -> Scan:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def broken(e: Exception) -> DataFileError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return DataFileError(
            f"{name} is not a readable parquet file ({first}).", "re-export it, or use .jsonl"
        )

    try:
        pf = pq.ParquetFile(p)
        columns = list(pf.schema_arrow.names)
        s = Scan(columns=columns, count=pf.metadata.num_rows, _seen=set(columns))
        if prompt_field not in columns:
            raise _no_column(name, prompt_field, columns)
        if s.count == 0:
            raise DataFileError(f"{name} holds no rows.", "give a file with at least one prompt")
        row = 0
        for batch in pf.iter_batches(columns=[prompt_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                _check_prompt(name, f"row {row}", {prompt_field: value}, prompt_field, s)
                if max_rows is not None and row >= max_rows:
                    s.complete = row >= s.count
                    return s
        if keep:
            s.table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise broken(e) from None
    return s
