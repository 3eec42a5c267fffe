"""The records of a text data file (.jsonl, .json, .csv; datafile.py validates them into a `Scan`): UTF-8
lines read with a bounded buffer (a line over MAX_LINE_BYTES is refused by number), JSON objects per line or
a JSON list, CSV rows under their header. Every problem is a `DataFileError` naming the file and line."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from typing import Any

from gpufleet.datapath import DataFileError

MAX_LINE_BYTES = 1 << 20


def records(f, name: str, suffix: str) -> Iterator[tuple[str, Any]]:
    """(where, record) of a text data file opened in binary (`f`): .csv rows as dicts of strings, .json a
    list's records, .jsonl (or .json of one object per line) each line's; every problem a DataFileError."""
    lines = _lines(f, name)
    if suffix == ".csv":
        return _csv_records(lines, name)
    first = next(((n, t) for n, t in lines if t.strip()), None)
    if first is None:
        raise DataFileError(f"{name} is empty.", "give a file with at least one prompt")
    return (
        _json_array(first, lines, name)
        if first[1].lstrip().startswith("[")
        else _json_lines(first, lines, name)
    )


def _lines(f, name: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file, each line read with a bounded buffer."""
    start = f.read(4)
    if start[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise DataFileError(
            f"{name} is UTF-16 encoded (it starts with a UTF-16 byte-order mark).", _utf8_fix("utf-16")
        )
    f.seek(3 if start[:3] == b"\xef\xbb\xbf" else 0)
    number = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 2)
        if not raw:
            return
        number += 1
        body = raw.rstrip(b"\r\n")
        if len(body) > MAX_LINE_BYTES:
            raise DataFileError(
                f"{name} line {number} is longer than {MAX_LINE_BYTES >> 20} MiB.",
                "split or shorten that record (is the file really one record per line?)",
            )
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _encoding_error(name, number, raw, e) from None


def _encoding_error(name: str, number: int, raw: bytes, e: UnicodeDecodeError) -> DataFileError:
    if b"\x00" in raw:
        guess, source = "it looks UTF-16 (NUL bytes between characters)", "utf-16"
    else:
        char = raw[e.start : e.start + 1].decode("cp1252", errors="replace")
        guess, source = f"it looks Latin-1 / Windows-1252 ({char!r} there)", "cp1252"
    return DataFileError(
        f"{name} line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); {guess}.",
        _utf8_fix(source),
    )


def _utf8_fix(source: str) -> str:
    return f"re-save it as UTF-8, e.g. iconv -f {source} -t utf-8 FILE > FILE.utf8"


def _json_lines(first: tuple[int, str], lines: Iterator[tuple[int, str]], name: str):
    for number, text in _chain(first, lines):
        if not text.strip():
            continue
        try:
            yield f"line {number}", json.loads(text)
        except json.JSONDecodeError as e:
            raise DataFileError(
                f"{name} line {number} is not valid JSON ({e.msg} at column {e.colno}).",
                'fix that line: one JSON object per line, e.g. {"prompt": "..."}',
            ) from None
        except (RecursionError, ValueError) as e:  # nested too deep, an integer of thousands of digits
            raise _unreadable_json(f"{name} line {number}", e) from None


def _json_array(first: tuple[int, str], lines: Iterator[tuple[int, str]], name: str):
    text = "".join(t for _, t in _chain(first, lines))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFileError(
            f"{name} is not valid JSON ({e.msg} at line {e.lineno + first[0] - 1} column {e.colno}).",
            "fix the JSON there (a list of objects), or write one object per line as .jsonl",
        ) from None
    except (RecursionError, ValueError) as e:
        raise _unreadable_json(name, e) from None
    if not isinstance(data, list):
        raise DataFileError(f"{name} is {kind(data)}, not a list of records.", "write a list of objects")
    for i, rec in enumerate(data, 1):
        yield f"record {i}", rec


def _unreadable_json(where: str, e: Exception) -> DataFileError:
    why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
    return DataFileError(f"{where} is not readable JSON ({why}).", "fix that record")


def _chain(first, rest):
    yield first
    yield from rest


def _csv_records(lines: Iterator[tuple[int, str]], name: str):
    csv.field_size_limit(MAX_LINE_BYTES)
    counted = _Counted(lines)
    reader = csv.reader(counted, strict=True)
    header: list[str] | None = None
    while True:
        start = counted.number + 1
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            why = "a quote is never closed" if "end of data" in str(e) or "EOF" in str(e) else str(e)
            raise DataFileError(
                f"{name} line {start}: {why}.",
                'fix the quoting there (a quote inside a field is written "")',
            ) from None
        if not row:
            continue
        if header is None:
            header = row
            doubled = sorted({c for c in row if row.count(c) > 1})
            if doubled:
                raise DataFileError(
                    f"{name}: column {doubled[0]!r} appears twice in the header.", "rename one of them"
                )
            continue
        if len(row) != len(header):
            raise DataFileError(
                f"{name} line {start} has {len(row)} fields, the header has {len(header)}.",
                "quote fields that contain commas, or fix the row",
            )
        yield f"line {start}", dict(zip(header, row, strict=True))
    if header is None:
        raise DataFileError(f"{name} is empty.", "give a header line and at least one row")


class _Counted:
    """Lines for csv.reader that remember the number of the last line handed out."""

    def __init__(self, lines: Iterator[tuple[int, str]]):
        self.lines, self.number = lines, 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        self.number, text = next(self.lines)
        return text


def kind(value: Any) -> str:
    """What a record or prompt value is, in words ("a number (3)", "an empty list", ...)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "an empty string" if not value else "a string"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return f"a list of {len(value)} numbers (token ids?)"
        return "an empty list" if not value else "a list that is not chat messages"
    return f"{type(value).__name__ if not isinstance(value, dict) else 'an object'}"
