"""Verified, resumable downloads of dataset files (http, https, file:// and local paths).

``fetch`` writes to ``<dest>.part``, resumes it with an HTTP ``Range`` request after a dropped
connection or on a rerun, checks size and md5/sha256, and only then renames the file to ``dest``.
A file at ``dest`` has therefore always been verified; a file with no pinned checksum gets its
sha256 recorded in a sidecar ``<dest>.sha256`` (sha256sum format) which later runs verify against.

HTTP goes through chexflow.data.http_transfer: one retry policy (urllib3's ``Retry``) for every
request and for resuming a transfer cut off mid-body. The downloader knows no dataset: a source
whose local copies differ from the official files in their first bytes says so itself
(``Source.local_header``).
"""
from __future__ import annotations

import os
import re
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from chexflow.data.http_transfer import RETRY_STATUS, fetch_http, read_text, retry_policy
from chexflow.data.sources import Source, join_base, resolve_url
from chexflow.data.transfer import (ChecksumMismatch, DownloadError, Hashes, InsufficientSpace, NotFoundError,
                                    TruncatedDownload, check_space, progress_bar, write_block)
from chexflow.fsutil import open_regular, read_text_regular, write_text_atomic

__all__ = ["DownloadError", "NotFoundError", "ChecksumMismatch", "TruncatedDownload", "InsufficientSpace",
           "FetchResult", "fetch", "load_checksums", "parse_checksums", "fetch_source_file",
           "checksum_sidecar", "retry_policy", "RETRY_STATUS"]


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


def _read_sidecar(path: Path) -> str | None:
    side = checksum_sidecar(path)
    if not side.exists():
        return None
    m = _SHA256_LINE.match(read_text_regular(side, max_bytes=1 << 16).strip())
    return m.group(1).lower() if m else None


def _mismatch(path: Path, url: str, h: Hashes, md5: str | None, sha256: str | None,
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


def _result(dest: Path, url: str, h: Hashes, *, cached: bool, recorded: bool, resumed: bool,
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
            h = Hashes(want_md5=md5 is not None)
            h.update_from_file(dest, chunk)
            problem = _mismatch(dest, url, h, md5, pinned_sha, size)
            if problem is None:
                return _result(dest, url, h, cached=True, recorded=False, resumed=False, attempts=0)
            reason = problem
    print(f"{dest}: existing file does not verify ({reason}); fetching it again", file=sys.stderr)
    dest.unlink()
    return None


def _copy_local(src: Path, part: Path, h: Hashes, size: int | None, progress: bool, chunk: int,
                header: tuple[bytes, int] | None = None) -> None:
    """Copy a local file to ``part`` (from 0), hashing as it goes; ``header``: (bytes written instead
    of the copy's first ``n`` bytes, n), see ``Source.local_header``."""
    if not src.is_file():
        raise NotFoundError(f"{src}: no such file" + (" (it is a directory)" if src.is_dir() else ""))
    head, skip = header or (b"", 0)
    total = src.stat().st_size - skip + len(head)
    if size is not None and total != size:
        raise ChecksumMismatch(f"size mismatch for {part.name[:-5]} from {src}: expected {size} bytes, "
                               f"got {total} bytes")
    if size is None:  # a pinned size was checked before
        check_space(part.parent, total, f"{part.name[:-5]} ({src})")
    h.reset()
    with open_regular(src) as fin, open(part, "wb") as fout, progress_bar(total, 0, part.name[:-5], progress) as bar:
        fin.seek(skip)
        block = head or fin.read(chunk)
        while block:
            write_block(fout, block, part)
            h.update(block)
            bar.update(len(block))
            block = fin.read(chunk)


def fetch(url: str, dest: Path | str, *, md5: str | None = None, sha256: str | None = None,
          size: int | None = None, retries: int = 5, backoff: float = 0.5, timeout: float = 60.0,
          progress: bool = True, chunk: int = 1 << 20, header: tuple[bytes, int] | None = None) -> FetchResult:
    """Fetch ``url`` (http, https, file:// or a local path) to ``dest``, verified.

    Nothing is done if ``dest`` already verifies. With no md5/sha256 pinned, the sha256 is
    recorded in ``<dest>.sha256`` and printed. ``retries``/``backoff``: :func:`retry_policy`.
    ``header`` (local copies only): (bytes written instead of the copy's first ``n`` bytes, n).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    cached = _cached(dest, url, md5, sha256, size, chunk)
    if cached is not None:
        return cached
    part = _part_path(dest)
    h = Hashes(want_md5=md5 is not None)
    if size is not None and part.exists() and part.stat().st_size > size:
        part.unlink()  # longer than the file can be: not a prefix of it
    if _is_http(url):
        if part.exists():
            h.update_from_file(part, chunk)  # continue the hashes over the bytes already there
        if size is not None:
            check_space(dest.parent, size - h.n, f"{dest.name} ({url})")
        attempts, resumed = fetch_http(url, part, h, size, retries=retries, backoff=backoff,
                                        timeout=timeout, progress=progress, chunk=chunk)
    else:
        src = _local_path(url)
        if size is not None:
            check_space(dest.parent, size, f"{dest.name} ({url})")
        _copy_local(src, part, h, size, progress, chunk, header)
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


def _read_text(path_or_url: str, *, retries: int = 3, backoff: float = 0.5, timeout: float = 60.0) -> str:
    if _is_http(path_or_url):
        return read_text(path_or_url, retries=retries, backoff=backoff, timeout=timeout)
    p = _local_path(path_or_url)
    if not p.is_file():
        raise NotFoundError(f"{path_or_url}: no such file")
    return read_text_regular(p)


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
    A local copy is read through the source's ``local_header`` where it has one. ``kw`` go to ``fetch``.
    """
    rf = source.file(name)
    url = resolve_url(source, rf, mirror)
    if source.local_header is not None and not _is_http(url):
        kw = {**kw, "header": source.local_header(rf, _local_path(url))}
    md5, sha256 = rf.md5, rf.sha256
    if md5 is None and sha256 is None and source.checksums_file:
        base = str(mirror) if mirror else url.rsplit("/", 1)[0]
        sums_url = join_base(base, source.checksums_file)
        sums = load_checksums(sums_url, **{k: v for k, v in kw.items() if k in ("retries", "backoff", "timeout")})
        if rf.name not in sums:
            raise DownloadError(f"{sums_url} lists no sha256 for {rf.name} (it lists {len(sums)} files)")
        sha256 = sums[rf.name]
    return fetch(url, Path(dest_dir) / rf.name, md5=md5, sha256=sha256, size=rf.size, **kw)
