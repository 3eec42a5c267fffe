"""What a local data path really is, found before anything reads it, and how it is opened.

A data file must be a regular file (or `data.path` a folder of them, see `folder_files`): a FIFO would
block `gpufleet check` forever, `/dev/zero` is an endless line, a symlink loop is not a file at all. `open_binary` opens without blocking (O_NONBLOCK,
then fstat), so a pipe, a device, a folder, a symlink loop, a dangling link or a file without read
permission is one `DataFileError` that says which of these it is. Compressed text files
(`.jsonl.gz`, `.csv.bz2`, `.json.xz`, ...) are read through the standard library, line by line.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import lzma
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from gpufleet.errors import UserError

COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
"""Compression suffix -> opener (a binary file object with a bounded readline)."""

_MAGIC = {b"\x1f\x8b": ".gz", b"BZh": ".bz2", b"\xfd7zXZ": ".xz", b"\x28\xb5\x2f\xfd": ".zst"}


class DataFileError(UserError):
    """The path is not a readable regular file; `why` and `fix` separately for `gpufleet check`."""

    def __init__(self, why: str, fix: str, field: str = "data.path"):
        self.why = why
        super().__init__(why, field=field, fix=fix)


def suffixes(path: Path) -> tuple[str, str | None]:
    """(format suffix, compression suffix or None): `a.jsonl.gz` -> (".jsonl", ".gz")."""
    last = path.suffix.lower()
    if last in COMPRESSIONS or last in (".zst", ".zstd"):
        return Path(path.stem).suffix.lower(), last
    return last, None


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder, not a data file"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO); reading it would wait for a writer"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a file; it may never end"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_fd(path: Path, name: str) -> int:
    """A read-only descriptor of the regular file `path`, opened without ever blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _open_error(path, name, e) from None
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise DataFileError(
                f"{name} is {kind}.",
                "name a regular .jsonl/.json/.csv/.parquet file (optionally .gz/.bz2/.xz)",
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_error(path: Path, name: str, e: OSError) -> DataFileError:
    if e.errno == errno.ELOOP:
        return DataFileError(
            f"{name} is a symbolic link loop (it leads back to itself).",
            f"point the link at a real file (ls -l {path})",
        )
    if e.errno == errno.ENOENT and path.is_symlink():
        return DataFileError(
            f"{name} is a symbolic link to {os.readlink(path)}, which does not exist.",
            "fix the link, or name the data file itself",
        )
    if e.errno == errno.ENOENT:
        return DataFileError(
            f"{name} does not exist.", "fix the path (a .jsonl, .json, .parquet or .csv file)"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return DataFileError(
            f"{name} cannot be read: permission denied (this user may not read it or a folder above it).",
            f"give read permission (chmod a+r {path}) or copy it somewhere readable",
        )
    return DataFileError(f"{name} cannot be read ({e.strerror or e}).", "check the path and its permissions")


@contextlib.contextmanager
def open_binary(path: Path, name: str) -> Iterator:
    """The file's bytes as a binary file object with a bounded `readline`, decompressed when the name
    says .gz / .bz2 / .xz (closed, with the file, when the block ends). A compressed file named as plain
    text (or the reverse) is a `DataFileError`."""
    fmt, compression = suffixes(path)
    if compression in (".zst", ".zstd"):
        raise DataFileError(
            f"{name}: zstd-compressed files are not read.",
            f"decompress it first (zstd -d {path}), or re-compress it with gzip",
        )
    with open(open_fd(path, name), "rb", closefd=True) as raw:
        magic = raw.peek(6)[:6]
        found = next((s for m, s in _MAGIC.items() if magic.startswith(m)), None)
        if compression is None and found not in (None, ".bz2"):  # "BZh" may well start a CSV header
            raise DataFileError(
                f"{name} is {found[1:]}-compressed, but its name says plain {fmt or 'text'}.",
                f"rename it to {path.name}{found} so it is decompressed while read",
            )
        if compression is None:
            yield raw
            return
        if found != compression and magic:  # an empty file is said to be empty, by the parser
            raise DataFileError(
                f"{name} is not {compression[1:]}-compressed data, though its name ends in {compression}.",
                f"rename it to {path.name[: -len(compression)]} if it is plain text",
            )
        with COMPRESSIONS[compression](raw, "rb") as f:
            yield f


def folder_files(folder: Path, name: str, formats: tuple[str, ...]) -> list[Path]:
    """The data files of a folder given as `data.path`, in name order: every non-hidden file directly in
    it whose suffix is a data format (other files, such as a README, and subfolders are skipped)."""
    try:
        found = sorted(
            f for f in folder.iterdir() if not f.name.startswith(".") and suffixes(f)[0] in formats
        )
    except OSError as e:
        raise _open_error(folder, name, e) from None
    if not found:
        raise DataFileError(
            f"{name} is a folder with no data files in it ({', '.join(formats)}, optionally compressed).",
            "put the data files directly in that folder, or name one file",
        )
    return found


def check_regular(path: Path, name: str) -> os.stat_result:
    """The stat of `path` once it is known to be a readable regular file (else `DataFileError`)."""
    fd = open_fd(path, name)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)
