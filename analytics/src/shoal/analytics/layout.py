"""Where log files live: date-partitioned part files, written atomically, read in order.

Layout written by ``export`` and ``generate``::

    DIR/date=2026-11-21/part-<namespace>.<group>-<first sequence, 12 digits>.jsonl

Readers (both report engines) take every ``*.jsonl`` file and every Parquet export
(``part-*.parquet``) below DIR, in the order of their paths relative to DIR, leave out the
report's own output folder when it lies below DIR, and skip anything whose name (or a
parent folder's name) starts with ``.`` or ``_`` (unless it holds a ``=``), as Spark does;
a part file is written under a hidden name and renamed when complete, so a reader never
sees half of one. Within one group, the order of the files and of the lines in them is the
log's order (the date folders sort by date, the part files by sequence). A single file
given as the input is read whatever its name: as Parquet if it ends in ``.parquet``, else
as JSON lines.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from datetime import date
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = [
    "PARQUET_PATTERN",
    "InputError",
    "PartWriter",
    "input_files",
    "is_hidden",
    "is_parquet",
    "part_prefix",
    "relative_name",
    "safe_name",
]

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"
# The Parquet files a folder is read for: what ``export --format parquet`` writes
# (part-<namespace>.<group>-<sequence>.parquet). Other *.parquet files are not exports.
PARQUET_PATTERN = "part-*.parquet"


class InputError(Exception):
    """The report's input cannot be read (missing, or a file that is not what it says):
    the command says so in one line."""


def is_parquet(path: str) -> bool:
    """Whether a file given as the input is read as Parquet (else as JSON lines)."""
    return path.endswith(".parquet")


def safe_name(value: str) -> str:
    """A file-name-safe spelling of a namespace or group."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", value)


def part_prefix(namespace: str, group: str) -> str:
    """``<namespace>.<group>``, file-name-safe: the part files' name prefix."""
    return f"{safe_name(namespace)}.{safe_name(group)}"


def _hidden_name(name: str) -> bool:
    # Spark's rule (InMemoryFileIndex.shouldFilterOutPathName), so both engines read the
    # same files.
    return (
        name.startswith(".")
        or (name.startswith("_") and "=" not in name)
        or name.endswith("._COPYING_")
    )


def is_hidden(relative: str) -> bool:
    """Whether a reader skips this path (relative to the input folder)."""
    return any(_hidden_name(part) for part in relative.split("/"))


def input_files(root: Path, exclude: Path | None = None) -> list[Path]:
    """Every JSON lines file and Parquet export below root (or root itself if it is a
    file, whatever its name), in read order; nothing below ``exclude`` (the report's
    output folder)."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise InputError(f"input {root} does not exist")
    skip = os.path.abspath(exclude) + os.sep if exclude is not None else None
    found = [
        p
        for pattern in (f"*{SUFFIX}", PARQUET_PATTERN)
        for p in root.rglob(pattern)
        if p.is_file()
        and not is_hidden(p.relative_to(root).as_posix())
        and not (skip is not None and os.path.abspath(p).startswith(skip))
    ]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def relative_name(root: str, path: str) -> str:
    """``path`` relative to ``root`` with ``/`` separators (``path`` itself if outside)."""
    absolute_root = os.path.abspath(root)
    absolute = os.path.abspath(path)
    if absolute == absolute_root:
        return os.path.basename(absolute)
    if absolute.startswith(absolute_root.rstrip(os.sep) + os.sep):
        return Path(os.path.relpath(absolute, absolute_root)).as_posix()
    return path


class PartWriter:
    """Writes lines into date-partitioned part files, at most ``max_lines`` per file.

    ``write(day, sequence, line)``: a new part file starts at a new date or when the current
    one is full, named after the sequence number of its first line. Files are renamed into
    place on rotation and on ``close()``; on error the partial file is removed.
    ``encode`` turns the buffered lines of a file into its bytes (JSON lines by default;
    the Parquet export passes its own).
    """

    def __init__(
        self,
        root: Path,
        prefix: str,
        *,
        max_lines: int = 20_000,
        suffix: str = SUFFIX,
        encode: Callable[[list[bytes], IO[bytes]], None] | None = None,
    ) -> None:
        self.root = root
        self.prefix = prefix
        self.max_lines = max_lines
        self.suffix = suffix
        self.encode = encode
        self.files: list[Path] = []
        self.lines = 0
        self._day: date | None = None
        self._first = 0
        self._buffer: list[bytes] = []

    def write(self, day: date, sequence: int, line: bytes) -> None:
        if self._buffer and (day != self._day or len(self._buffer) >= self.max_lines):
            self._flush()
        if not self._buffer:
            self._day, self._first = day, sequence
        self._buffer.append(line)
        self.lines += 1

    def _flush(self) -> None:
        if not self._buffer or self._day is None:
            return
        folder = self.root / f"date={self._day.isoformat()}"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{self.prefix}-{self._first:012d}{self.suffix}"
        final = folder / name
        temp = folder / f".{name}.tmp"
        try:
            with temp.open("wb") as out:
                if self.encode is None:
                    for line in self._buffer:
                        out.write(line.rstrip(b"\n") + b"\n")
                else:
                    self.encode(self._buffer, out)
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        log.debug("Wrote %d lines to %s", len(self._buffer), final)
        self.files.append(final)
        self._buffer = []

    def close(self) -> None:
        self._flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._buffer = []
