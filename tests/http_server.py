"""A real HTTP server on 127.0.0.1 for download tests: serves a directory, honours single
``Range: bytes=N-[M]`` requests (206 + Content-Range), records every request, and injects faults
per path. Standard library only.

    with FileServer(tmp_path / "www") as srv:
        srv.set_fault("big.bin", Fault(drop_after=1_000_000, drop_times=1))
        fetch(srv.url("big.bin"), dest)
        assert srv.requests_for("big.bin")[1].range == "bytes=1000000-"
"""
from __future__ import annotations

import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass(frozen=True)
class Fault:
    """Misbehaviour for one path. ``*_times``: only the first K requests to the path misbehave."""
    status: int | None = None        # always answer with this status (e.g. 404, 410, 403)
    fail_status: int = 500           # status of the first fail_times requests
    fail_times: int = 0
    retry_after: str | None = None   # Retry-After header of those failing answers
    drop_after: int | None = None    # send this many body bytes, then close the connection ...
    drop_times: int = 0              # ... on the first drop_times requests
    ignore_range: bool = False       # answer Range requests with 200 and the whole file
    claim_length: int | None = None  # Content-Length of the whole file claimed as this (> real size):
                                     # the body ends early and the connection closes (every request)
    stall_s: float = 0.0             # wait this long before answering ...
    stall_times: int = 0             # ... the first stall_times requests (to trigger client timeouts)


@dataclass(frozen=True)
class Request:
    method: str
    path: str                        # URL path without the leading "/", unquoted
    range: str | None                # the Range header, if any
    status: int
    time: float = 0.0                # time.monotonic() when the request arrived


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args) -> None:  # keep test output quiet
        pass

    def do_HEAD(self) -> None:
        self._guarded(body=False)

    def do_GET(self) -> None:
        self._guarded(body=True)

    def _guarded(self, body: bool) -> None:
        try:
            self._serve(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (e.g. its timeout)
            self.close_connection = True

    def _status_only(self, rel: str, code: int, n: int, extra: dict[str, str] | None = None) -> None:
        self.server.record(Request(self.command, rel, self.headers.get("Range"), code, self.arrived))
        msg = f"{code} for {rel}\n".encode()
        self.send_response(code)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(msg)

    def _serve(self, body: bool) -> None:
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        n = self.server.count(rel)                    # 1 for the first request to this path
        self.arrived = time.monotonic()
        fault = self.server.faults.get(rel, Fault())
        if n <= fault.stall_times:
            time.sleep(fault.stall_s)
        if fault.status is not None:
            return self._status_only(rel, fault.status, n)
        if n <= fault.fail_times:
            extra = {"Retry-After": fault.retry_after} if fault.retry_after is not None else None
            return self._status_only(rel, fault.fail_status, n, extra)
        path = (self.server.root / rel).resolve()
        if self.server.root not in path.parents or not path.is_file():
            return self._status_only(rel, 404, n)
        data = path.read_bytes()
        full = fault.claim_length if fault.claim_length is not None else len(data)  # the size we claim
        rng = None if fault.ignore_range else self.headers.get("Range")
        start, end = 0, full - 1
        if rng:
            m = _RANGE.match(rng.strip())
            if m:
                start = int(m.group(1))
                end = min(int(m.group(2)), full - 1) if m.group(2) else full - 1
                if start >= full:
                    return self._status_only(rel, 416, n, {"Content-Range": f"bytes */{full}"})
            else:
                rng = None
        code = 206 if rng else 200
        self.server.record(Request(self.command, rel, self.headers.get("Range"), code, self.arrived))
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{full}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if not body:
            return
        payload = data[start:end + 1]  # shorter than announced when claim_length > real size
        drop = fault.drop_after is not None and n <= fault.drop_times
        if drop:
            payload = payload[:fault.drop_after]
        self.wfile.write(payload)
        self.wfile.flush()
        if drop or fault.claim_length is not None:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.faults: dict[str, Fault] = {}
        self.requests: list[Request] = []
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def count(self, rel: str) -> int:
        with self._lock:
            self._counts[rel] = self._counts.get(rel, 0) + 1
            return self._counts[rel]

    def record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)


class FileServer:
    """Context manager: ``with FileServer(directory) as srv: srv.url("name")``."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "FileServer":
        self._server = _Server(self.root)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="test-http-server")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, name: str) -> str:
        return f"{self.base_url}/{urllib.parse.quote(name)}"

    def set_fault(self, name: str, fault: Fault) -> None:
        assert self._server is not None
        self._server.faults[name] = fault

    @property
    def requests(self) -> list[Request]:
        assert self._server is not None
        with self._server._lock:
            return list(self._server.requests)

    def requests_for(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.path == name]
