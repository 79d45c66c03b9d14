"""Verified, resumable downloads of dataset files (http, https, file:// and local paths).

``fetch`` writes to ``<dest>.part``, resumes it with an HTTP ``Range`` request after a dropped
connection or on a rerun, retries connection errors / 5xx / timeouts with exponential backoff,
checks size and md5/sha256, and only then renames the file to ``dest``. A file at ``dest`` has
therefore always been verified; a file with no pinned checksum gets its sha256 recorded in a
sidecar ``<dest>.sha256`` (sha256sum format) which later runs verify against.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import requests
import urllib3
from tqdm import tqdm

from chexflow.data.fashion_mnist import FASHION_MNIST_GZIP_MTIME
from chexflow.data.sources import Source, join_base, resolve_url
from chexflow.fsutil import open_regular, read_text_regular, write_text_atomic

__all__ = ["DownloadError", "NotFoundError", "ChecksumMismatch", "TruncatedDownload", "InsufficientSpace",
           "FetchResult", "fetch", "load_checksums", "parse_checksums", "fetch_source_file",
           "checksum_sidecar", "restore_debian_gzip"]


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


@dataclass(frozen=True)
class FetchResult:
    path: Path            # the verified file
    url: str              # where it came from (for a cached file: where it would have come from)
    size: int
    sha256: str
    md5: str | None       # computed only when an md5 is pinned
    cached: bool          # dest already existed and verified: nothing was fetched
    recorded: bool        # no pinned checksum: sha256 was written to the sidecar
    resumed: bool         # an existing .part was continued with a Range request
    attempts: int         # requests/copies made (0 when cached)


class _Transient(Exception):
    """A failure worth retrying (connection drop, timeout, 5xx); ``total``: file size if the server said."""

    def __init__(self, message: str, total: int | None = None) -> None:
        super().__init__(message)
        self.total = total


_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
_NETWORK_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_SHA256_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


def checksum_sidecar(dest: Path | str) -> Path:
    """``<dest>.sha256``: the sha256 recorded for a file that has no pinned checksum."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".sha256")


def _part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _is_http(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme in ("http", "https")


def _local_path(url: str) -> Path:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise DownloadError(f"{url}: file:// URLs with a host ({parts.netloc!r}) are not supported")
        return Path(urllib.request.url2pathname(parts.path))
    if parts.scheme and len(parts.scheme) > 1:  # one letter: a Windows drive
        raise DownloadError(f"{url}: unsupported URL scheme {parts.scheme!r} (use http, https, file:// or a path)")
    return Path(url).expanduser()


def _human(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError  # pragma: no cover


def _check_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise InsufficientSpace(f"not enough free space in {directory} for {what}: needs {needed} bytes "
                                f"({_human(needed)}), {free} bytes ({_human(free)}) free")


class _Hashes:
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


def _file_hashes(path: Path, want_md5: bool, chunk: int) -> _Hashes:
    h = _Hashes(want_md5)
    h.update_from_file(path, chunk)
    return h


def _read_sidecar(path: Path) -> str | None:
    side = checksum_sidecar(path)
    if not side.exists():
        return None
    m = _SHA256_LINE.match(read_text_regular(side, max_bytes=1 << 16).strip())
    return m.group(1).lower() if m else None


def _mismatch(path: Path, url: str, h: _Hashes, md5: str | None, sha256: str | None,
              size: int | None) -> str | None:
    """The first disagreement between ``h`` and the pins, as a message naming file and both values."""
    if size is not None and h.n != size:
        return f"size mismatch for {path.name} from {url}: expected {size} bytes, got {h.n} bytes"
    if sha256 is not None and h.sha256.hexdigest() != sha256.lower():
        return (f"sha256 mismatch for {path.name} from {url}: expected {sha256.lower()}, "
                f"got {h.sha256.hexdigest()}")
    if md5 is not None and h.md5 is not None and h.md5.hexdigest() != md5.lower():
        return f"md5 mismatch for {path.name} from {url}: expected {md5.lower()}, got {h.md5.hexdigest()}"
    return None


def _result(dest: Path, url: str, h: _Hashes, *, cached: bool, recorded: bool, resumed: bool,
            attempts: int) -> FetchResult:
    return FetchResult(path=dest, url=url, size=h.n, sha256=h.sha256.hexdigest(),
                       md5=h.md5.hexdigest() if h.md5 is not None else None, cached=cached,
                       recorded=recorded, resumed=resumed, attempts=attempts)


def _cached(dest: Path, url: str, md5: str | None, sha256: str | None, size: int | None,
            chunk: int) -> FetchResult | None:
    """A result for ``dest`` if it exists and verifies (against the pins, or else its sidecar)."""
    if not dest.is_file():
        return None
    if size is not None and dest.stat().st_size != size:
        reason = f"size {dest.stat().st_size} != pinned {size}"
    else:
        pinned_sha = sha256 or (None if md5 else _read_sidecar(dest))
        if md5 is None and pinned_sha is None:
            reason = f"no pinned checksum and no {checksum_sidecar(dest).name}"
        else:
            h = _file_hashes(dest, md5 is not None, chunk)
            problem = _mismatch(dest, url, h, md5, pinned_sha, size)
            if problem is None:
                return _result(dest, url, h, cached=True, recorded=False, resumed=False, attempts=0)
            reason = problem
    print(f"{dest}: existing file does not verify ({reason}); fetching it again", file=sys.stderr)
    dest.unlink()
    return None


def _write(fh: BinaryIO, block: bytes, part: Path) -> None:
    try:
        fh.write(block)
    except OSError as exc:  # not a network error: never retried
        raise DownloadError(f"cannot write {part}: {exc}") from exc


def _bar(total: int | None, initial: int, name: str, progress: bool) -> tqdm:
    return tqdm(total=total, initial=initial, desc=name, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, mininterval=2.0, file=sys.stderr, leave=False)


def _copy_local(src: Path, part: Path, h: _Hashes, size: int | None, progress: bool, chunk: int) -> None:
    """Copy a local file to ``part`` (from 0), hashing as it goes."""
    if not src.is_file():
        raise NotFoundError(f"{src}: no such file" + (" (it is a directory)" if src.is_dir() else ""))
    total = src.stat().st_size
    if size is not None and total != size:
        raise ChecksumMismatch(f"size mismatch for {part.name[:-5]} from {src}: expected {size} bytes, "
                               f"got {total} bytes")
    if size is None:  # a pinned size was checked before
        _check_space(part.parent, total, f"{part.name[:-5]} ({src})")
    h.reset()
    with open_regular(src) as fin, open(part, "wb") as fout, _bar(total, 0, part.name[:-5], progress) as bar:
        while block := fin.read(chunk):
            _write(fout, block, part)
            h.update(block)
            bar.update(len(block))


def _http_attempt(session: requests.Session, url: str, part: Path, h: _Hashes, size: int | None,
                  space_checked: bool, timeout: float, progress: bool, chunk: int) -> tuple[int | None, bool]:
    """One GET of ``url`` appended to ``part`` (Range-resumed if it has bytes).

    Returns (total size if the server said, whether a Range resume was honoured). Raises
    _Transient for retryable failures, NotFoundError / DownloadError for final ones.
    """
    have = h.n
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = session.get(url, headers=headers, stream=True, timeout=timeout, allow_redirects=True)
    except _NETWORK_ERRORS as exc:
        raise _Transient(f"{type(exc).__name__}: {exc}") from exc
    with resp:
        code = resp.status_code
        if code in (404, 410):
            raise NotFoundError(f"{url}: HTTP {code} {resp.reason} (file not found on the server)")
        if code in _RETRY_STATUS:
            raise _Transient(f"HTTP {code} {resp.reason}")
        if code == 416 and have:
            m = re.match(r"bytes\s+\*/(\d+)", resp.headers.get("Content-Range", ""))
            if m and int(m.group(1)) == have:  # the .part is already complete
                return have, True
            print(f"{url}: server refused the resume at byte {have} (HTTP 416); restarting from 0", file=sys.stderr)
            part.unlink(missing_ok=True)
            h.reset()
            raise _Transient("HTTP 416 on resume")
        if code not in (200, 206):
            raise DownloadError(f"{url}: HTTP {code} {resp.reason}")
        resumed = False
        length = resp.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        if code == 206:
            m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != have:
                part.unlink(missing_ok=True)
                h.reset()
                raise _Transient(f"unexpected Content-Range {resp.headers.get('Content-Range')!r} for a "
                                 f"resume at byte {have}; restarting from 0")
            total = int(m.group(3)) if m.group(3) != "*" else None
            mode, resumed = "ab", have > 0
        else:
            if have:
                print(f"{url}: server ignored the Range request; restarting from byte 0", file=sys.stderr)
                h.reset()
            total = length
            mode = "wb"
        start = h.n
        if total is not None and size is not None and total != size:
            raise DownloadError(f"{url}: server reports {total} bytes but {part.name[:-5]} should have "
                                f"{size} bytes (wrong file or a changed release?)")
        if total is not None and not space_checked:
            _check_space(part.parent, total - start, f"{part.name[:-5]} ({url})")
        with open(part, mode) as fh, _bar(total, start, part.name[:-5], progress) as bar:
            try:
                for block in resp.raw.stream(chunk, decode_content=False):
                    _write(fh, block, part)
                    h.update(block)
                    bar.update(len(block))
            except _NETWORK_ERRORS as exc:
                raise _Transient(f"connection lost after {h.n} bytes: {type(exc).__name__}: {exc}", total) from exc
        if total is not None and h.n < total:
            raise _Transient(f"connection closed after {h.n} of {total} bytes", total)
        return total, resumed


def _fetch_http(url: str, part: Path, h: _Hashes, size: int | None, *, retries: int, backoff: float,
                timeout: float, progress: bool, chunk: int) -> tuple[int, bool]:
    """Fill ``part`` from ``url``; returns (attempts, whether a resume was used)."""
    attempts, resumed, last = 0, False, ""
    total: int | None = size
    with requests.Session() as session:
        while True:
            if size is not None and h.n == size:
                return attempts, resumed  # a complete .part from an earlier run: just verify it
            attempts += 1
            try:
                total, r = _http_attempt(session, url, part, h, size, size is not None, timeout, progress, chunk)
                resumed = resumed or r
                return attempts, resumed
            except _Transient as exc:
                last = str(exc)
                total = exc.total if exc.total is not None else total
                if attempts > retries:
                    break
                wait = backoff * 2 ** (attempts - 1)
                print(f"{url}: {last}; retry {attempts}/{retries} in {wait:.2g} s", file=sys.stderr)
                time.sleep(wait)
    if total is not None and h.n < total:
        raise TruncatedDownload(f"{url}: got {h.n} of {total} bytes after {attempts} attempts "
                                f"(last error: {last}); the partial file {part} is kept for a later resume")
    raise DownloadError(f"{url}: giving up after {attempts} attempts: {last}")


def fetch(url: str, dest: Path | str, *, md5: str | None = None, sha256: str | None = None,
          size: int | None = None, retries: int = 5, backoff: float = 0.5, timeout: float = 60.0,
          progress: bool = True, chunk: int = 1 << 20) -> FetchResult:
    """Fetch ``url`` (http, https, file:// or a local path) to ``dest``, verified.

    Nothing is done if ``dest`` already verifies. With no md5/sha256 pinned, the sha256 is
    recorded in ``<dest>.sha256`` and printed.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    cached = _cached(dest, url, md5, sha256, size, chunk)
    if cached is not None:
        return cached
    part = _part_path(dest)
    h = _Hashes(want_md5=md5 is not None)
    if size is not None and part.exists() and part.stat().st_size > size:
        part.unlink()  # longer than the file can be: not a prefix of it
    if _is_http(url):
        if part.exists():
            h.update_from_file(part, chunk)  # continue the hashes over the bytes already there
        if size is not None:
            _check_space(dest.parent, size - h.n, f"{dest.name} ({url})")
        attempts, resumed = _fetch_http(url, part, h, size, retries=retries, backoff=backoff,
                                        timeout=timeout, progress=progress, chunk=chunk)
    else:
        src = _local_path(url)
        if size is not None:
            _check_space(dest.parent, size, f"{dest.name} ({url})")
        _copy_local(src, part, h, size, progress, chunk)
        attempts, resumed = 1, False
    problem = _mismatch(dest, url, h, md5, sha256, size)
    if problem is not None:
        part.unlink(missing_ok=True)  # wrong bytes: never resume from them
        if size is not None and h.n < size:
            raise TruncatedDownload(problem)
        raise ChecksumMismatch(problem)
    recorded = md5 is None and sha256 is None
    if recorded:
        digest = h.sha256.hexdigest()
        write_text_atomic(checksum_sidecar(dest), f"{digest}  {dest.name}\n")
        print(f"recorded sha256 {digest} for {dest} (no pinned checksum)", file=sys.stderr)
    os.replace(part, dest)
    return _result(dest, url, h, cached=False, recorded=recorded, resumed=resumed, attempts=attempts)


def _gzip_flags(path: Path) -> int | None:
    """FLG byte of a gzip file, None if ``path`` is not a readable gzip file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return None
    return head[3] if len(head) == 4 and head[:3] == b"\x1f\x8b\x08" else None


def restore_debian_gzip(src: Path | str, dest: Path | str, *, mtime: int, md5: str | None = None,
                        sha256: str | None = None, size: int | None = None, progress: bool = True,
                        chunk: int = 1 << 20) -> FetchResult:
    """Rebuild an upstream .gz file from a copy whose gzip header dh_strip_nondeterminism normalised.

    Debian packages (e.g. dataset-fashion-mnist) keep the compressed stream but drop the FNAME
    field and set MTIME to the packaging time. The upstream header is restored with FNAME = the
    name of ``dest`` without ".gz" and the given ``mtime``, keeping XFL and OS; the result is
    verified against the pins like any download.
    """
    src, dest = Path(src), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    where = f"{src} (restored gzip header)"
    cached = _cached(dest, where, md5, sha256, size, chunk)
    if cached is not None:
        return cached
    if not src.is_file():
        raise NotFoundError(f"{src}: no such file")
    if not dest.name.endswith(".gz"):
        raise DownloadError(f"{dest}: restore_debian_gzip needs a .gz destination name")
    part = _part_path(dest)
    h = _Hashes(want_md5=md5 is not None)
    with open(src, "rb") as fin:
        head = fin.read(10)
        if len(head) < 10 or head[:3] != b"\x1f\x8b\x08" or head[3] != 0:
            raise DownloadError(f"{src}: not a gzip file with a normalised header (no optional fields); "
                                f"first bytes {head.hex()}")
        header = (b"\x1f\x8b\x08\x08" + struct.pack("<I", mtime) + head[8:10]
                  + dest.name[:-3].encode("latin-1") + b"\0")
        total = src.stat().st_size - 10 + len(header)
        _check_space(dest.parent, total, f"{dest.name} ({src})")
        with open(part, "wb") as fout, _bar(total, 0, dest.name, progress) as bar:
            block = header
            while block:
                _write(fout, block, part)
                h.update(block)
                bar.update(len(block))
                block = fin.read(chunk)
    problem = _mismatch(dest, where, h, md5, sha256, size)
    if problem is not None:
        part.unlink(missing_ok=True)
        raise ChecksumMismatch(problem)
    os.replace(part, dest)
    return _result(dest, where, h, cached=False, recorded=False, resumed=False, attempts=1)


def _read_text(path_or_url: str, *, retries: int = 3, backoff: float = 0.5, timeout: float = 60.0) -> str:
    if not _is_http(path_or_url):
        p = _local_path(path_or_url)
        if not p.is_file():
            raise NotFoundError(f"{path_or_url}: no such file")
        return read_text_regular(p)
    last = ""
    for attempt in range(retries + 1):
        try:
            resp = requests.get(path_or_url, timeout=timeout)
        except _NETWORK_ERRORS as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if resp.status_code in (404, 410):
                raise NotFoundError(f"{path_or_url}: HTTP {resp.status_code} {resp.reason}")
            if resp.status_code == 200:
                return resp.text
            last = f"HTTP {resp.status_code} {resp.reason}"
            if resp.status_code not in _RETRY_STATUS:
                break
        if attempt < retries:
            time.sleep(backoff * 2 ** attempt)
    raise DownloadError(f"{path_or_url}: cannot read ({last})")


def parse_checksums(text: str, where: str = "<checksums>") -> dict[str, str]:
    """Parse sha256sum output ("<64 hex>  <name>" or "<hex> *<name>") into {name: hex}."""
    sums: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _SHA256_LINE.match(line)
        if not m:
            raise DownloadError(f"{where}:{lineno}: not a sha256sum line: {line!r}")
        name = m.group(2)
        name = name[2:] if name.startswith("./") else name
        if name in sums and sums[name] != m.group(1).lower():
            raise DownloadError(f"{where}:{lineno}: {name} is listed twice with different sums")
        sums[name] = m.group(1).lower()
    return sums


def load_checksums(path_or_url: str | Path, **kw) -> dict[str, str]:
    """{file name: sha256 hex} from a sha256sum-format file (local path, file:// or http(s))."""
    where = str(path_or_url)
    return parse_checksums(_read_text(where, **kw), where)


def fetch_source_file(source: Source, name: str, dest_dir: Path | str, mirror: str | None,
                      **kw) -> FetchResult:
    """Fetch file ``name`` of ``source`` into ``dest_dir``/name.

    The checksum is the pinned one; for unpinned files of a source with a ``checksums_file``,
    the sha256 listed there (read from the same base: the mirror, or the file's URL directory).
    ``kw`` go to ``fetch``.
    """
    rf = source.file(name)
    url = resolve_url(source, rf, mirror)
    if (source.name == "fashion_mnist" and rf.name in FASHION_MNIST_GZIP_MTIME and not _is_http(url)
            and _gzip_flags(_local_path(url)) == 0):  # a Debian copy (e.g. /usr/share/datasets/fashion-mnist)
        opts = {k: v for k, v in kw.items() if k in ("progress", "chunk")}
        return restore_debian_gzip(_local_path(url), Path(dest_dir) / rf.name, mtime=FASHION_MNIST_GZIP_MTIME[rf.name],
                                   md5=rf.md5, sha256=rf.sha256, size=rf.size, **opts)
    md5, sha256 = rf.md5, rf.sha256
    if md5 is None and sha256 is None and source.checksums_file:
        base = str(mirror) if mirror else url.rsplit("/", 1)[0]
        sums_url = join_base(base, source.checksums_file)
        sums = load_checksums(sums_url, **{k: v for k, v in kw.items() if k in ("retries", "backoff", "timeout")})
        if rf.name not in sums:
            raise DownloadError(f"{sums_url} lists no sha256 for {rf.name} (it lists {len(sums)} files)")
        sha256 = sums[rf.name]
    return fetch(url, Path(dest_dir) / rf.name, md5=md5, sha256=sha256, size=rf.size, **kw)
