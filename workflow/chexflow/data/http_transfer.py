"""HTTP transfers of dataset files under one retry policy (urllib3's ``Retry``, mounted on a requests session).

Every request is retried by the policy on connection errors, timeouts and ``RETRY_STATUS`` answers
(honouring ``Retry-After``); 404/410 and other 4xx are final. A transfer cut off after its response
began is resumed with a ``Range`` request from its last byte, each resume counted against a copy of
the same policy, so ``retries`` bounds both. The bytes are hashed as they are written
(:class:`chexflow.data.transfer.Hashes`); chexflow.data.download verifies them.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.exceptions import MaxRetryError, ProtocolError
from urllib3.util import Retry

from chexflow.data.transfer import (DownloadError, Hashes, NotFoundError, TruncatedDownload, check_space,
                                    progress_bar, write_block)


class _Dropped(Exception):
    """A transfer cut off (or refused as a resume) after the response began: resumed under the policy."""

    def __init__(self, message: str, total: int | None = None) -> None:
        super().__init__(message)
        self.total = total                   # the file's size, if the server said
        self.tries = 1                       # requests the policy made for the broken response


RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})   # answers worth asking again
NETWORK_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def retry_policy(retries: int, backoff: float) -> Retry:
    """The retry policy of every request: ``retries`` retries of connection errors, timeouts and
    ``RETRY_STATUS`` answers. Between them it waits what the server's ``Retry-After`` says, or else
    urllib3's exponential backoff: nothing before the first retry, ``backoff * 2**(n-1)`` s (at most
    120 s) before the n-th."""
    return Retry(total=retries, backoff_factor=backoff, status_forcelist=RETRY_STATUS,
                 allowed_methods=frozenset({"GET"}), raise_on_status=False, respect_retry_after_header=True)


def make_session(policy: Retry) -> requests.Session:
    """A requests session whose http(s) requests all follow ``policy``."""
    s = requests.Session()
    adapter = HTTPAdapter(max_retries=policy)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return s


def requests_made(resp: requests.Response) -> int:
    """Requests that the policy made for this response: 1 + its retries."""
    retries = getattr(resp.raw, "retries", None)
    return 1 + len(retries.history) if retries is not None else 1


def _http_attempt(session: requests.Session, url: str, part: Path, h: Hashes, size: int | None,
                  space_checked: bool, timeout: float, progress: bool, chunk: int) -> tuple[bool, int]:
    """One GET of ``url`` (the session's policy retries it) appended to ``part`` (Range-resumed if it has bytes).

    Returns (whether a Range resume was honoured, requests made). Raises _Dropped when the transfer
    broke off after the response began, NotFoundError / DownloadError for final failures.
    """
    have = h.n
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = session.get(url, headers=headers, stream=True, timeout=timeout, allow_redirects=True)
    except NETWORK_ERRORS as exc:
        raise DownloadError(f"{url}: giving up under the retry policy: {type(exc).__name__}: {exc}") from exc
    with resp:
        code, n = resp.status_code, requests_made(resp)
        if code in (404, 410):
            raise NotFoundError(f"{url}: HTTP {code} {resp.reason} (file not found on the server)")
        if code in RETRY_STATUS:
            raise DownloadError(f"{url}: giving up after {n} attempts: HTTP {code} {resp.reason}")
        if code == 416 and have:
            m = re.match(r"bytes\s+\*/(\d+)", resp.headers.get("Content-Range", ""))
            if m and int(m.group(1)) == have:  # the .part is already complete
                return True, n
            print(f"{url}: server refused the resume at byte {have} (HTTP 416); restarting from 0", file=sys.stderr)
            part.unlink(missing_ok=True)
            h.reset()
            raise _Dropped("HTTP 416 on resume")
        if code not in (200, 206):
            raise DownloadError(f"{url}: HTTP {code} {resp.reason}")
        try:
            _receive(resp, url, part, h, size, space_checked, progress, chunk)
        except _Dropped as exc:
            exc.tries = n
            raise
        return code == 206 and have > 0, n


def _receive(resp: requests.Response, url: str, part: Path, h: Hashes, size: int | None, space_checked: bool,
             progress: bool, chunk: int) -> None:
    """Append the body of a 200/206 answer to ``part`` (a 200 from byte 0), hashing as it goes."""
    total, mode = _response_total(resp, url, part, h, h.n)
    start = h.n
    if total is not None and size is not None and total != size:
        raise DownloadError(f"{url}: server reports {total} bytes but {part.name[:-5]} should have "
                            f"{size} bytes (wrong file or a changed release?)")
    if total is not None and not space_checked:
        check_space(part.parent, total - start, f"{part.name[:-5]} ({url})")
    with open(part, mode) as fh, progress_bar(total, start, part.name[:-5], progress) as bar:
        try:
            for block in resp.raw.stream(chunk, decode_content=False):
                write_block(fh, block, part)
                h.update(block)
                bar.update(len(block))
        except NETWORK_ERRORS as exc:
            raise _Dropped(f"connection lost after {h.n} bytes: {type(exc).__name__}: {exc}", total) from exc
    if total is not None and h.n < total:
        raise _Dropped(f"connection closed after {h.n} of {total} bytes", total)


def _response_total(resp: requests.Response, url: str, part: Path, h: Hashes, have: int) -> tuple[int | None, str]:
    """(the file's size if the server said, the mode to open ``part`` with) for a 200 or 206 answer."""
    if resp.status_code == 206:
        m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
        if not m or int(m.group(1)) != have:
            part.unlink(missing_ok=True)
            h.reset()
            raise _Dropped(f"unexpected Content-Range {resp.headers.get('Content-Range')!r} for a "
                           f"resume at byte {have}; restarting from 0")
        return (int(m.group(3)) if m.group(3) != "*" else None), "ab"
    if have:
        print(f"{url}: server ignored the Range request; restarting from byte 0", file=sys.stderr)
        h.reset()
    length = resp.headers.get("Content-Length")
    return (int(length) if length and length.isdigit() else None), "wb"


def fetch_http(url: str, part: Path, h: Hashes, size: int | None, *, retries: int, backoff: float,
                timeout: float, progress: bool, chunk: int) -> tuple[int, bool]:
    """Fill ``part`` from ``url``; returns (requests made, whether a resume was used)."""
    policy = retry_policy(retries, backoff)
    drops = policy                        # resumes of broken transfers, counted by the same policy
    attempts, total = 0, size
    with make_session(policy) as s:
        while not (size is not None and h.n == size):  # a complete .part from an earlier run: just verify it
            try:
                r, n = _http_attempt(s, url, part, h, size, size is not None, timeout, progress, chunk)
                return attempts + n, r
            except _Dropped as exc:
                attempts += exc.tries
                total = exc.total if exc.total is not None else total
                try:
                    drops = drops.increment("GET", url, error=ProtocolError(str(exc)))
                except MaxRetryError:
                    _give_up(url, part, h, total, attempts, str(exc))
                print(f"{url}: {exc}; resuming ({len(drops.history)}/{retries})", file=sys.stderr)
                drops.sleep()
    return attempts, False


def _give_up(url: str, part: Path, h: Hashes, total: int | None, attempts: int, last: str) -> None:
    if total is not None and h.n < total:
        raise TruncatedDownload(f"{url}: got {h.n} of {total} bytes after {attempts} attempts "
                                f"(last error: {last}); the partial file {part} is kept for a later resume")
    raise DownloadError(f"{url}: giving up after {attempts} attempts: {last}")


def read_text(url: str, *, retries: int, backoff: float, timeout: float) -> str:
    """The text at an http(s) ``url`` (e.g. a checksums file), under the same retry policy."""
    with make_session(retry_policy(retries, backoff)) as s:
        try:
            resp = s.get(url, timeout=timeout)
        except NETWORK_ERRORS as exc:
            raise DownloadError(f"{url}: cannot read ({type(exc).__name__}: {exc})") from exc
    if resp.status_code in (404, 410):
        raise NotFoundError(f"{url}: HTTP {resp.status_code} {resp.reason}")
    if resp.status_code != 200:
        raise DownloadError(f"{url}: cannot read (HTTP {resp.status_code} {resp.reason} after "
                            f"{requests_made(resp)} attempts)")
    return resp.text
