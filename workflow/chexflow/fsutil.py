"""Atomic file writing (a half-written output never carries its final name) and file checksums.

The one place that knows how chexflow writes a file: every writer in the package goes through
:func:`atomic_path` (or the two helpers built on it) and every file checksum through
:func:`sha256_file`.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Iterator


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path | str, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` only if the block succeeds.

    ``fsync=True`` also flushes the file and then its directory entry to disk, so that a crash of
    the machine (not only of the process) leaves either the old file or the whole new one
    (checkpoints).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
        if fsync:
            _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write ``text`` as UTF-8 (whatever the locale), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes_atomic(path: Path | str, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def link_numbered(path: Path | str) -> Path:
    """Give file ``path`` (created empty if missing) a second name, ``<stem>.<n><suffix>`` with the first
    free ``n`` from 1, and return it. Both names are one file: what is written to ``path`` is also kept
    under the numbered name, which survives a later removal of ``path`` (Snakemake deletes a job's
    log before every attempt; this keeps one log per attempt). ``link`` is atomic, also on NFS: two
    attempts at once get two numbers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    stem, suffix = (path.stem, path.suffix) if path.suffix else (path.name, "")
    n = 1
    while True:
        numbered = path.with_name(f"{stem}.{n}{suffix}")
        try:
            os.link(path, numbered)
            return numbered
        except FileExistsError:
            n += 1
