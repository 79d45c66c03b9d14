"""Atomic file writing (a half-written output never carries its final name), file checksums, and
opening only regular files.

The one place that knows how chexflow writes a file: every writer in the package goes through
:func:`atomic_path` (or the two helpers built on it) and every file checksum through
:func:`sha256_file`. Every file chexflow reads goes through :func:`open_regular` (or
:func:`read_regular`): a FIFO, a device, a socket or a directory under a file's name is refused
before a byte is read (never blocking), a symbolic link is followed only where the caller says the
user named the path, and a file larger than the reader's bound is refused unread. Every JSON record
is read by :func:`read_json`.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

# The bound of a text file read whole (a JSON manifest, a label table, a list of files) where its
# reader has no setting of its own: the largest chexflow writes or reads (ImageNet's part manifests,
# NIH's label table) are tens of MB.
MAX_READ_BYTES = 1 << 30


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
    # the pid alone is not unique on a file system that several nodes share (two ranks or jobs writing one file)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{secrets.token_hex(4)}")
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
    with open_regular(path) as fh:
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


class NotRegularFile(OSError):
    """A path chexflow refuses to read: not a regular file, a symbolic link where none is followed, or
    larger than its reader's bound. ``str()`` is ``<path>: <reason>``; ``strerror`` the reason alone.
    Never carries any of the file's content."""

    def __init__(self, path: Path | str, reason: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, reason, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"

    def __reduce__(self):
        # OSError pickles as cls(errno, strerror, filename), which this __init__ reads as (path, reason):
        # a refusal sent to other ranks (broadcast_object) or processes would name the errno as its path
        return type(self), (self.filename, self.strerror, self.errno)


class ReplacedWhileOpening(NotRegularFile):
    """The path named another regular file when it was opened than when it was checked: a writer
    renamed a new version into place in between (an atomic write), or someone swapped it. A reader
    that expects concurrent atomic writers may try again; the file read is always the one checked."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    return next((what for test, what in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else
                "not a regular file")


def check_regular(path: Path | str, *, follow_symlinks: bool = True) -> os.stat_result:
    """``stat`` (``lstat`` unless ``follow_symlinks``) of ``path`` if it is a regular file, else
    :class:`NotRegularFile` naming what it is. Opens nothing."""
    st = os.stat(path, follow_symlinks=follow_symlinks)
    if not stat.S_ISREG(st.st_mode):
        what = file_kind(st.st_mode)
        hint = " (links are not followed here)" if stat.S_ISLNK(st.st_mode) else ""
        raise NotRegularFile(path, f"{what}, not a regular file{hint}; not read")
    return st


def open_regular(path: Path | str, *, follow_symlinks: bool = True, max_bytes: int | None = None,
                 what: str = "file") -> BinaryIO:
    """``path`` opened for reading in binary mode, only if it is a regular file of at most ``max_bytes``.

    ``follow_symlinks``: a symbolic link is followed (the user named the path) or refused (a file
    found by scanning a folder or by its name in one). The file is checked before it is opened
    (``stat``) and again on the open descriptor (``fstat``, the same file): it is opened with
    ``O_NONBLOCK``, so a FIFO or a device swapped in meanwhile never blocks the open, and is then
    refused. :class:`NotRegularFile` (an ``OSError``) names the file and the reason; a missing file
    raises ``FileNotFoundError``. ``what``: the file's role in the size message ("archive", ...).
    """
    before = check_regular(path, follow_symlinks=follow_symlinks)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise NotRegularFile(path, "a symbolic link, not a regular file (links are not followed here); "
                                       "not read") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path, f"{file_kind(st.st_mode)} (replaced while being opened); not read")
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise ReplacedWhileOpening(path, "a regular file (replaced while being opened); not read")
        if max_bytes is not None and st.st_size > max_bytes:
            raise NotRegularFile(path, f"{what} of {st.st_size:,} bytes, more than the {max_bytes:,} allowed; "
                                       "not read", errno.EFBIG)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path | str, *, max_bytes: int = MAX_READ_BYTES, follow_symlinks: bool = True,
                 what: str = "file") -> bytes:
    """The bytes of regular file ``path`` (:func:`open_regular`), at most ``max_bytes`` of them: a file
    that grows past the bound while being read is refused too."""
    with open_regular(path, follow_symlinks=follow_symlinks, max_bytes=max_bytes, what=what) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise NotRegularFile(path, f"{what} grew past the {max_bytes:,} bytes allowed while being read; not read",
                             errno.EFBIG)
    return data


def read_text_regular(path: Path | str, *, max_bytes: int = MAX_READ_BYTES, follow_symlinks: bool = True,
                      what: str = "file") -> str:
    """:func:`read_regular` decoded as UTF-8 (``UnicodeDecodeError`` for a file that is not)."""
    return read_regular(path, max_bytes=max_bytes, follow_symlinks=follow_symlinks, what=what).decode("utf-8")


def read_json(path: Path | str, error: Callable[[str], Exception], *, what: str, kind: str | None = None) -> Any:
    """The JSON in regular file ``path``, where every record's reader starts: a missing file, bytes that are
    not UTF-8 JSON and, given ``kind`` (e.g. "a scaling point"), a value that is not an object are an ``error``
    naming the file (``<what> not found: <path>``, ``<path>: not <kind> (not valid JSON: ...)``, without
    ``kind`` ``<what> <path> is not valid JSON: ...``, ``<path>: not <kind> (a JSON list, not an object)``)."""
    try:
        data = json.loads(read_text_regular(path, what=what))
    except FileNotFoundError as exc:
        raise error(f"{what} not found: {path}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not {kind} (not valid JSON: {exc})" if kind else
                    f"{what} {path} is not valid JSON: {exc}") from exc
    if kind and not isinstance(data, dict):
        raise error(f"{path}: not {kind} (a JSON {type(data).__name__}, not an object)")
    return data
