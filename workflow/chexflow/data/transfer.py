"""What every transfer of a dataset file shares: its errors, the running hashes of the bytes
written, the free-space check before the first byte, the progress bar (chexflow.data.download
uses them for local copies and, through chexflow.data.http_transfer, for HTTP)."""
from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from chexflow.fsutil import open_regular


class DownloadError(RuntimeError):
    """A file could not be fetched; the message names the file/URL and the cause."""


class NotFoundError(DownloadError):
    """HTTP 404/410, or a local/file:// source that does not exist."""


class ChecksumMismatch(DownloadError):
    """The fetched bytes are not the pinned ones (size, md5 or sha256)."""


class TruncatedDownload(DownloadError):
    """Fewer bytes than Content-Length / the pinned size arrived, even after retries."""


class InsufficientSpace(DownloadError):
    """Not enough free disk space for the file (checked before any byte is written)."""


def _human(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError  # pragma: no cover


def check_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise InsufficientSpace(f"not enough free space in {directory} for {what}: needs {needed} bytes "
                                f"({_human(needed)}), {free} bytes ({_human(free)}) free")


class Hashes:
    """Running sha256 (always) and md5 (when pinned) of the bytes written to the .part file."""

    def __init__(self, want_md5: bool) -> None:
        self.want_md5 = want_md5
        self.reset()

    def reset(self) -> None:
        self.sha256 = hashlib.sha256()
        self.md5 = hashlib.md5() if self.want_md5 else None
        self.n = 0

    def update(self, block: bytes) -> None:
        self.sha256.update(block)
        if self.md5 is not None:
            self.md5.update(block)
        self.n += len(block)

    def update_from_file(self, path: Path, chunk: int) -> None:
        with open_regular(path) as fh:
            while block := fh.read(chunk):
                self.update(block)


def write_block(fh: BinaryIO, block: bytes, part: Path) -> None:
    try:
        fh.write(block)
    except OSError as exc:  # not a network error: never retried
        raise DownloadError(f"cannot write {part}: {exc}") from exc


def progress_bar(total: int | None, initial: int, name: str, progress: bool) -> tqdm:
    return tqdm(total=total, initial=initial, desc=name, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, mininterval=2.0, file=sys.stderr, leave=False)
