"""Where a row of a CSV table is in its file: for messages that name a bad row by its line.

pandas keeps no line numbers (it skips blank lines, and a quoted field may span lines), so the line
of a row is found again, only when a message needs it, by reading the file with the csv module.
"""
from __future__ import annotations

import csv
import gzip
import io
import zlib
from pathlib import Path
from typing import Any

import pandas as pd


def line_of(path: Path | str, column: str, value: str) -> int | None:
    """The line (1-based, the header is line 1) where the first record whose ``column`` is ``value``
    starts in ``path`` (``.gz``: decompressed); None when the file or the record cannot be found."""
    try:
        raw = gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")
    except OSError:
        return None
    with raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="") as text:
        reader = csv.reader(text)
        try:
            header = [h.strip() for h in next(reader)]
            at = header.index(column)
            start = reader.line_num + 1
            for record in reader:
                if len(record) > at and record[at].strip() == value:
                    return start
                start = reader.line_num + 1
        except (StopIteration, ValueError, csv.Error, OSError, EOFError, zlib.error):
            return None
    return None


def first_bad(bad: pd.Series, path: Path | str, column: str, names: pd.Series | None) -> tuple[Any, str, str]:
    """(index of the first True row of ``bad``, ``line N (<column> <its name>)``, `` (and K more
    rows like it)`` or ""); ``names``: the rows' ``column`` (same index), without them the row is
    named by its index."""
    first = bad.idxmax()
    line = line_of(path, column, names[first]) if names is not None else None
    row = f"{column} {names[first]}" if names is not None else f"row {first}"
    more = f" (and {int(bad.sum()) - 1} more row(s) like it)" if bad.sum() > 1 else ""
    return first, f"line {line} ({row})" if line is not None else row, more
