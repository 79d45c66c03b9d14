"""Safe reading of tar archives, shared by the dataset readers (NIH, ImageNet...): the members that are
safe to read, and the PNG members of a .tar.gz streamed in order (NIH's image archives)."""
from __future__ import annotations

import gzip
import logging
import os
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

# Python 3.12's tarfile, with the extraction filters (PEP 706), on every Python chexflow runs on: the
# standard library has them from 3.11.4, Debian 12's python3 is 3.11.2. One implementation
# everywhere: the members checked here and in chexflow's image are checked by the same code.
from backports import tarfile

from chexflow.fsutil import open_regular

log = logging.getLogger(__name__)

_FILTER_ROOT = os.path.join(os.sep, "nonexistent-chexflow-extract-root")


class ArchiveError(RuntimeError):
    """An image archive is truncated, corrupt or not a gzip-compressed tar; names the archive."""


def safe_members(tar: tarfile.TarFile, report: Callable[[str, str], None], *,
                 max_bytes: int | None = None) -> Iterator[tarfile.TarInfo]:
    """The regular-file members of ``tar`` (read in order) that are safe to read.

    Every member first passes ``tarfile.data_filter`` (the 'data' extraction filter: ``..``, links
    pointing outside, device files are rejected); absolute names (which the filter would merely
    strip) are rejected too, and only regular files are yielded (no symlinks or hard links at
    all). ``max_bytes``: a member whose header declares more bytes (for a sparse member: its
    expanded size) is rejected from its header alone; tarfile then skips its data in bounded
    reads, so an oversize member never sits in memory. Rejected members go to
    ``report(member_name, reason)``; directories are skipped silently.
    """
    for member in tar:
        if member.name.startswith(("/", "\\")) or os.path.isabs(member.name):
            report(member.name, "absolute member path")
            continue
        try:
            member = tarfile.data_filter(member, _FILTER_ROOT)
        except tarfile.FilterError as exc:
            report(member.name, f"rejected by the tar 'data' filter: {exc}")
            continue
        if member.isdir():
            continue
        if not member.isfile():
            report(member.name, "not a regular file (links and special files are not read)")
            continue
        if max_bytes is not None and member.size > max_bytes:
            report(member.name, f"{member.size:,} bytes, more than the {max_bytes:,} allowed (max_member_mb); not read")
            continue
        yield member


def posix_basename(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def open_archive(path: Path | str, what: str) -> BinaryIO:
    """An archive opened for reading, only if it is a regular file (a FIFO would block the open, a link to
    ``/dev/zero`` never end): ``fsutil.NotRegularFile`` otherwise, ``FileNotFoundError`` naming ``what``."""
    try:
        return open_regular(path, what=what)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: {what} not found") from None


# --------------------------------------------------------------------------- .tar.gz of PNGs (NIH's layout)

_TAR_READ_BYTES = 1 << 20


def _log_skip(member: str, reason: str) -> None:
    log.warning("skipping archive member %r: %s", member, reason)


def iter_archive(path: Path | str, *, on_skip: Callable[[str, str], None] | None = None,
                 max_member_bytes: int | None = None) -> Iterator[tuple[str, bytes]]:
    """``(basename, bytes)`` of every ``.png`` member of a ``.tar.gz``, in archive order (``iter_members``)."""
    for member, data in iter_members(path, on_skip=on_skip, max_member_bytes=max_member_bytes):
        yield posix_basename(member), data


def iter_members(path: Path | str, *, on_skip: Callable[[str, str], None] | None = None,
                 max_member_bytes: int | None = None) -> Iterator[tuple[str, bytes]]:
    """Stream ``(member name, bytes)`` for every ``.png`` member of a ``.tar.gz``, in archive order.

    Reads without extracting, in tarfile's streaming mode (``r|`` over a ``gzip`` stream), so an
    archive is read once, sequentially. Every member first passes :func:`safe_members` (``max_bytes``:
    ``max_member_bytes``); those it rejects go to ``on_skip(member_name, reason)`` (default: a logged
    warning), non-PNG files are skipped silently.

    A truncated or corrupt archive raises ``ArchiveError`` naming it: the gzip stream is read to
    its end, so a missing gzip trailer or a CRC mismatch is detected even when the tar part ends
    on a member boundary.
    """
    path = Path(path)
    report = on_skip or _log_skip
    try:     # a regular file only: a FIFO would block, a link to /dev/zero never end
        with open_regular(path, what="archive") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            # 1 MiB reads instead of tarfile's 10 KiB records: far fewer gzip calls per image
            with tarfile.open(fileobj=gz, mode="r|", bufsize=_TAR_READ_BYTES) as tar:
                for member in safe_members(tar, report, max_bytes=max_member_bytes):
                    if not member.name.lower().endswith(".png"):
                        continue
                    fh = tar.extractfile(member)
                    if fh is None:  # pragma: no cover - isfile() members always have data
                        report(member.name, "no data")
                        continue
                    yield member.name, fh.read()
            while gz.read(1 << 20):  # drain: verifies the gzip trailer (length and CRC)
                pass
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ArchiveError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from exc
    except OSError as exc:
        raise ArchiveError(f"{path}: cannot read archive ({exc})") from exc
