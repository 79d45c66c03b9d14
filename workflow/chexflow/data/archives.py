"""Safe reading of tar archives, shared by the dataset readers (NIH, ImageNet...)."""
from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from chexflow.fsutil import open_regular

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
