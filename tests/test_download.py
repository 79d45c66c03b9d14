"""chexflow.data.sources / chexflow.data.download against a real HTTP server on 127.0.0.1."""
from __future__ import annotations

import hashlib
import re
import socket
import sys
from pathlib import Path

import pytest

from chexflow.data import download as D
from chexflow.data import nih, registry
from chexflow.data import sources as S

try:
    from http_server import Fault, FileServer
except ImportError:  # tests/ not on sys.path (e.g. --import-mode=importlib)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from http_server import Fault, FileServer

MB = 1 << 20
DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"   # Debian's dataset-fashion-mnist package
FAST = dict(retries=3, backoff=0.01, timeout=10.0, progress=False, chunk=256 * 1024)


def _payload(n: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"chexflow-{seed}".encode()).digest(n)


@pytest.fixture
def www(tmp_path: Path) -> Path:
    d = tmp_path / "www"
    d.mkdir()
    return d


@pytest.fixture
def big(www: Path) -> tuple[str, bytes]:
    data = _payload(3 * MB + 12345)
    (www / "big.bin").write_bytes(data)
    return "big.bin", data


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _md5(b: bytes) -> str:
    return hashlib.md5(b).hexdigest()


def _gets(srv: FileServer, name: str):
    return [r for r in srv.requests_for(name) if r.method == "GET"]


def _part(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


# ----------------------------------------------------------------------------- resume / retry
def test_resume_after_disconnect_uses_range(www, big, tmp_path):
    name, data = big
    dest = tmp_path / "out" / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(drop_after=1_200_000, drop_times=1))
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), md5=_md5(data), **FAST)
        gets = _gets(srv, name)
    assert dest.read_bytes() == data
    assert res.sha256 == _sha(data) and res.md5 == _md5(data) and res.size == len(data)
    assert res.resumed and not res.cached and res.attempts == 2
    assert [g.range for g in gets] == [None, "bytes=1200000-"]
    assert gets[1].status == 206
    assert not _part(dest).exists()


def test_resume_partial_file_from_earlier_run(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    _part(dest).write_bytes(data[:MB])
    with FileServer(www) as srv:
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        gets = _gets(srv, name)
    assert [g.range for g in gets] == [f"bytes={MB}-"]
    assert res.resumed and dest.read_bytes() == data


def test_server_ignoring_range_restarts_from_zero(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    _part(dest).write_bytes(b"\0" * MB)  # garbage: would corrupt the file if appended to
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(ignore_range=True))
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        gets = _gets(srv, name)
    assert gets[0].range == f"bytes={MB}-" and gets[0].status == 200
    assert not res.resumed and dest.read_bytes() == data


def test_complete_part_with_pinned_size_needs_no_request(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    _part(dest).write_bytes(data)
    with FileServer(www) as srv:
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), size=len(data), **FAST)
        assert _gets(srv, name) == []
    assert res.attempts == 0 and dest.read_bytes() == data


def test_complete_part_without_size_is_confirmed_by_416(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    _part(dest).write_bytes(data)
    with FileServer(www) as srv:
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        gets = _gets(srv, name)
    assert [(g.range, g.status) for g in gets] == [(f"bytes={len(data)}-", 416)]
    assert dest.read_bytes() == data and not _part(dest).exists()


def test_timeout_is_retried(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(stall_s=1.0, stall_times=1))
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **{**FAST, "timeout": 0.3})
    assert res.attempts == 2 and dest.read_bytes() == data


def test_5xx_then_success(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(fail_status=503, fail_times=2))
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        statuses = [g.status for g in _gets(srv, name)]
    assert statuses == [503, 503, 200]
    assert res.attempts == 3 and dest.read_bytes() == data


def test_5xx_beyond_retries_fails_and_leaves_nothing(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(fail_status=500, fail_times=100))
        with pytest.raises(D.DownloadError, match=r"HTTP 500") as ei:
            D.fetch(srv.url(name), dest, sha256=_sha(data), **{**FAST, "retries": 2})
        assert len(_gets(srv, name)) == 3
    assert srv.url(name) in str(ei.value)
    assert not dest.exists()


def test_connection_refused_retries_then_fails(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.bin"
    with pytest.raises(D.DownloadError, match=re.escape(url)):
        D.fetch(url, tmp_path / "x.bin", sha256="0" * 64, **{**FAST, "retries": 1})
    assert not (tmp_path / "x.bin").exists()


def test_retry_after_is_honoured(www, big, tmp_path):
    """The policy waits what the server's Retry-After says (1 s), not its own backoff (0.01 s)."""
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(fail_status=429, fail_times=1, retry_after="1"))
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        gets = _gets(srv, name)
    assert [g.status for g in gets] == [429, 200] and res.attempts == 2 and dest.read_bytes() == data
    assert gets[1].time - gets[0].time >= 1.0


@pytest.mark.parametrize("code", [400, 403])
def test_other_4xx_is_final(www, big, tmp_path, code):
    name, data = big
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(status=code))
        with pytest.raises(D.DownloadError, match=rf"HTTP {code}"):
            D.fetch(srv.url(name), tmp_path / name, sha256=_sha(data), **FAST)
        assert len(_gets(srv, name)) == 1


def test_checksums_file_follows_the_same_retry_policy(www, tmp_path):
    """The checksums file is read under the policy of fetch: 5xx retried up to ``retries``, 404 not."""
    (www / "SUMS").write_text(f"{'c' * 64}  x.bin\n")
    with FileServer(www) as srv:
        srv.set_fault("SUMS", Fault(fail_status=503, fail_times=2))
        assert D.load_checksums(srv.url("SUMS"), retries=2, backoff=0.01) == {"x.bin": "c" * 64}
        assert [g.status for g in _gets(srv, "SUMS")] == [503, 503, 200]
        srv.set_fault("SUMS2", Fault(fail_status=503, fail_times=5))
        with pytest.raises(D.DownloadError, match=r"HTTP 503 .* after 2 attempts"):
            D.load_checksums(srv.url("SUMS2"), retries=1, backoff=0.01)
        assert len(_gets(srv, "SUMS2")) == 2
        with pytest.raises(D.NotFoundError, match="HTTP 404"):
            D.load_checksums(srv.url("NOPE"), retries=3, backoff=0.01)
        assert len(_gets(srv, "NOPE")) == 1
    policy = D.retry_policy(4, 0.5)
    assert policy.total == 4 and set(policy.status_forcelist) == set(D.RETRY_STATUS) == {408, 425, 429, 500, 502,
                                                                                         503, 504}


def test_failed_requests_then_a_dropped_transfer_are_both_retried(www, big, tmp_path):
    """Two 503s retried by the policy, then a transfer cut off at 1 MB and resumed from there."""
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(fail_status=503, fail_times=2, drop_after=MB, drop_times=3))
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        gets = _gets(srv, name)
    assert [(g.status, g.range) for g in gets] == [(503, None), (503, None), (200, None), (206, f"bytes={MB}-")]
    assert res.attempts == 4 and res.resumed and dest.read_bytes() == data


# ----------------------------------------------------------------------------- failures
def test_checksum_mismatch_names_file_and_both_sums(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    wrong = "ab" * 32
    with FileServer(www) as srv:
        with pytest.raises(D.ChecksumMismatch) as ei:
            D.fetch(srv.url(name), dest, sha256=wrong, **FAST)
    msg = str(ei.value)
    assert name in msg and "sha256" in msg and wrong in msg and _sha(data) in msg
    assert not dest.exists() and not _part(dest).exists()


def test_md5_mismatch(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        with pytest.raises(D.ChecksumMismatch, match=r"md5 mismatch") as ei:
            D.fetch(srv.url(name), dest, md5="0" * 32, **FAST)
    assert "0" * 32 in str(ei.value) and _md5(data) in str(ei.value)
    assert not dest.exists() and not _part(dest).exists()


@pytest.mark.parametrize("code", [404, 410])
def test_not_found_names_url_and_is_not_retried(www, tmp_path, code):
    dest = tmp_path / "missing.bin"
    with FileServer(www) as srv:
        if code == 410:
            srv.set_fault("missing.bin", Fault(status=410))
        with pytest.raises(D.NotFoundError) as ei:
            D.fetch(srv.url("missing.bin"), dest, sha256="0" * 64, **FAST)
        assert len(_gets(srv, "missing.bin")) == 1
    assert srv.url("missing.bin") in str(ei.value) and str(code) in str(ei.value)
    assert not dest.exists() and not _part(dest).exists()


def test_truncated_body_raises_after_retries(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(claim_length=len(data) + 500_000))
        with pytest.raises(D.TruncatedDownload) as ei:
            D.fetch(srv.url(name), dest, sha256=_sha(data), **{**FAST, "retries": 2})
        assert len(_gets(srv, name)) == 3
    assert srv.url(name) in str(ei.value) and f"of {len(data) + 500_000} bytes" in str(ei.value)
    assert not dest.exists()
    assert _part(dest).stat().st_size == len(data)  # kept as a resumable prefix, never as dest


def test_insufficient_space_from_pinned_size_before_any_request(www, big, tmp_path):
    name, data = big
    dest = tmp_path / "out" / name
    with FileServer(www) as srv:
        with pytest.raises(D.InsufficientSpace) as ei:
            D.fetch(srv.url(name), dest, sha256=_sha(data), size=10**15, **FAST)
        assert srv.requests == []
    msg = str(ei.value)
    assert str(dest.parent) in msg and str(10**15) in msg and "free" in msg
    assert not dest.exists() and not _part(dest).exists()


def test_insufficient_space_from_content_length_before_any_byte(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        srv.set_fault(name, Fault(claim_length=10**15))
        with pytest.raises(D.InsufficientSpace, match=str(10**15)):
            D.fetch(srv.url(name), dest, **FAST)
    assert not dest.exists() and not _part(dest).exists()


def test_insufficient_space_local_copy(www, big, tmp_path):
    name, data = big
    with pytest.raises(D.InsufficientSpace):
        D.fetch(str(www / name), tmp_path / name, sha256=_sha(data), size=10**15, **FAST)
    assert not (tmp_path / name).exists()


# ----------------------------------------------------------------------------- local sources
@pytest.mark.parametrize("form", ["file_url", "path"])
def test_local_sources_are_verified_copies(www, big, tmp_path, form):
    name, data = big
    src = www / name
    url = src.as_uri() if form == "file_url" else str(src)
    res = D.fetch(url, tmp_path / "out" / name, sha256=_sha(data), size=len(data), **FAST)
    assert res.path.read_bytes() == data and res.size == len(data)
    with pytest.raises(D.ChecksumMismatch, match=name):
        D.fetch(url, tmp_path / "bad" / name, md5="f" * 32, **FAST)
    assert not (tmp_path / "bad" / name).exists() and not _part(tmp_path / "bad" / name).exists()


def test_local_source_missing(tmp_path):
    with pytest.raises(D.NotFoundError, match="nothere.bin"):
        D.fetch((tmp_path / "nothere.bin").as_uri(), tmp_path / "o.bin", **FAST)
    assert not (tmp_path / "o.bin").exists()


# ----------------------------------------------------------------------------- caching / recording
def test_verified_dest_is_not_downloaded_again(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        n = len(srv.requests)
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        assert len(srv.requests) == n
    assert res.cached and res.attempts == 0


def test_corrupt_dest_is_fetched_again(www, big, tmp_path):
    name, data = big
    dest = tmp_path / name
    dest.write_bytes(data[:-1] + b"X")
    with FileServer(www) as srv:
        res = D.fetch(srv.url(name), dest, sha256=_sha(data), **FAST)
        assert len(_gets(srv, name)) == 1
    assert not res.cached and dest.read_bytes() == data


def test_unpinned_file_gets_sha256_recorded(www, big, tmp_path, capsys):
    name, data = big
    dest = tmp_path / name
    with FileServer(www) as srv:
        res = D.fetch(srv.url(name), dest, **FAST)
        assert res.recorded and res.sha256 == _sha(data)
        assert D.checksum_sidecar(dest).read_text() == f"{_sha(data)}  {name}\n"
        assert f"recorded sha256 {_sha(data)}" in capsys.readouterr().err
        n = len(srv.requests)
        again = D.fetch(srv.url(name), dest, **FAST)  # verified against the sidecar
        assert again.cached and len(srv.requests) == n
        dest.write_bytes(b"tampered")
        fixed = D.fetch(srv.url(name), dest, **FAST)
        assert not fixed.cached and dest.read_bytes() == data


# ----------------------------------------------------------------------------- checksums files
def test_load_checksums_formats(tmp_path):
    a, b = "a" * 64, "B" * 64
    f = tmp_path / "SUMS"
    f.write_text(f"# comment\n{a}  one.tar.gz\n{b} *./two.txt\n\n")
    assert D.load_checksums(f) == {"one.tar.gz": a, "two.txt": b.lower()}
    assert D.load_checksums(f.as_uri()) == {"one.tar.gz": a, "two.txt": b.lower()}
    f.write_text(f"{a}  one\nnot a line\n")
    with pytest.raises(D.DownloadError, match=r"SUMS:2"):
        D.load_checksums(f)


def _demo_release(d: Path, n: int) -> dict[str, bytes]:
    files = {nih.archive_name(i): _payload(200_000 + i, seed=i) for i in range(1, n + 1)}
    files.update({t: f"{t}\n".encode() for t in (*nih.NIH_TABLES, nih.BOX_LIST_NAME)})
    for k, v in files.items():
        (d / k).write_bytes(v)
    (d / "SHA256SUMS").write_text("".join(f"{_sha(v)}  {k}\n" for k, v in files.items()))
    return files


def test_fetch_source_file_with_checksums_file_over_http(www, tmp_path):
    files = _demo_release(www, 2)
    src = registry.get_source("nih_demo", n_archives=2)
    out = tmp_path / "raw" / "nih_demo"
    with FileServer(www) as srv:
        results = [D.fetch_source_file(src, name, out, srv.base_url + "/", **FAST) for name in S.file_names(src)]
        assert [r.path.name for r in results] == S.file_names(src)
        assert all(not r.recorded for r in results)
        assert all((out / k).read_bytes() == v for k, v in files.items())
        # a tampered mirror file fails against SHA256SUMS
        (www / "test_list.txt").write_bytes(b"tampered\n")
        (out / "test_list.txt").unlink()
        with pytest.raises(D.ChecksumMismatch, match="test_list.txt"):
            D.fetch_source_file(src, "test_list.txt", out, srv.base_url, **FAST)
    assert not (out / "test_list.txt").exists()


def test_fetch_source_file_local_mirror_missing_entry(www, tmp_path):
    _demo_release(www, 1)
    src = registry.get_source("nih_demo", n_archives=1)
    res = D.fetch_source_file(src, "images_001.tar.gz", tmp_path / "o", str(www), **FAST)
    assert res.sha256 == _sha((www / "images_001.tar.gz").read_bytes())
    (www / "SHA256SUMS").write_text("")
    with pytest.raises(D.DownloadError, match=r"SHA256SUMS lists no sha256 for train_val_list.txt"):
        D.fetch_source_file(src, "train_val_list.txt", tmp_path / "o", www.as_uri(), **FAST)


# ----------------------------------------------------------------------------- registry
def test_resolve_url():
    src = registry.get_source("nih_demo", n_archives=1)
    f = src.file("images_001.tar.gz")
    assert S.resolve_url(src, f, "/data/mirror") == "/data/mirror/images_001.tar.gz"
    assert S.resolve_url(src, f, "http://h:8/base/") == "http://h:8/base/images_001.tar.gz"
    assert S.resolve_url(src, f, "https://h/base") == "https://h/base/images_001.tar.gz"
    assert S.resolve_url(src, f, "file:///data/m") == "file:///data/m/images_001.tar.gz"
    with pytest.raises(S.NoURLError, match="phantom release is generated locally"):
        S.resolve_url(src, f, None)
    fm = registry.get_source("fashion_mnist")
    g = fm.file("t10k-labels-idx1-ubyte.gz")
    assert S.resolve_url(fm, g, None) == \
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/t10k-labels-idx1-ubyte.gz"
    real = registry.get_source("nih")
    with pytest.raises(S.NoURLError, match="nihcc.app.box.com/v/ChestXray-NIHCC"):
        S.resolve_url(real, real.file("Data_Entry_2017_v2020.csv"), None)


def test_unknown_source_lists_known_ones():
    with pytest.raises(KeyError) as ei:
        registry.get_source("nope")
    msg = str(ei.value)
    assert "'nope'" in msg
    for known in ("fashion_mnist", "nih", "nih_demo", "imagenet"):
        assert known in msg


def test_nih_registry():
    src = registry.get_source("nih")
    arch = S.archives(src)
    assert [a.name for a in arch] == [f"images_{i:03d}.tar.gz" for i in range(1, 13)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", a.md5) for a in arch)
    assert len({a.md5 for a in arch}) == 12
    assert all(a.url.startswith("https://nihcc.box.com/shared/static/") and a.url.endswith(".gz") for a in arch)
    assert arch[0].md5 == "fe8ed0a6961412fddcbb3603c11b3698" and arch[-1].md5 == "dc9fda1757c2de0032b63347a7d2895c"
    assert {f.name: f.role for f in src.files if f.role != "archive"} == {
        "Data_Entry_2017_v2020.csv": "labels", "train_val_list.txt": "split_list", "test_list.txt": "split_list",
        "BBox_List_2017.csv": "boxes"}
    assert src.file("BBox_List_2017.csv").url is None and src.file("BBox_List_2017.csv").sha256 is None  # recorded
    # the real release always has its 12 archives; a pilot is declared in the config, not by cutting the source
    with pytest.raises(ValueError, match=r"always has its 12 archives.*datasets\.nih\.archives"):
        registry.get_source("nih", n_archives=3)


def test_nih_demo_and_imagenet_registry():
    demo = registry.get_source("nih_demo", n_archives=4)
    assert demo.synthetic and demo.checksums_file == "SHA256SUMS"
    assert [a.name for a in S.archives(demo)] == [f"images_{i:03d}.tar.gz" for i in range(1, 5)]
    assert S.file_names(demo)[4:] == [*nih.NIH_TABLES, nih.BOX_LIST_NAME]
    with pytest.raises(ValueError, match="n_archives"):
        registry.get_source("nih_demo")
    inet = registry.get_source("imagenet")
    assert {f.name: f.md5 for f in inet.files} == {
        "ILSVRC2012_img_train.tar": "1d675b47d978889d74fa0da5fadfb00e",
        "ILSVRC2012_img_val.tar": "29b22e2961454d5413ddabcf34fc5622",
        "ILSVRC2012_devkit_t12.tar.gz": "fa75699e90414af021442c21a62c3abf"}
    assert all(f.url is None for f in inet.files) and "image-net.org" in inet.how_to_obtain


@pytest.mark.skipif(not Path(DEBIAN_FASHION_MNIST_DIR).is_dir(), reason="Debian dataset-fashion-mnist not installed")
def test_fashion_mnist_pins_match_debian_copies(tmp_path):
    """The Debian copies (gzip header normalised) restore to bytes with the published md5s."""
    src = registry.get_source("fashion_mnist")
    published = {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                 "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
                 "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
                 "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}
    assert {f.name: f.md5 for f in src.files} == published
    assert {f.name: f.role for f in src.files} == {
        "train-images-idx3-ubyte.gz": "archive", "t10k-images-idx3-ubyte.gz": "archive",
        "train-labels-idx1-ubyte.gz": "labels", "t10k-labels-idx1-ubyte.gz": "labels"}
    for f in src.files:
        deb = Path(DEBIAN_FASHION_MNIST_DIR) / f.name
        assert deb.stat().st_size == f.size - len(f.name) + 2  # only the FNAME field ("name\0" sans .gz) differs
        res = D.fetch_source_file(src, f.name, tmp_path, DEBIAN_FASHION_MNIST_DIR, progress=False)
        body = res.path.read_bytes()
        assert _md5(body) == f.md5 and _sha(body) == f.sha256 and len(body) == f.size
        assert body[10:].startswith(f.name[:-3].encode() + b"\0") and body[10 + len(f.name) - 2:] == deb.read_bytes()[10:]
        assert D.fetch_source_file(src, f.name, tmp_path, DEBIAN_FASHION_MNIST_DIR, progress=False).cached


def test_local_header_of_a_source_is_written_instead_of_the_copy_s_first_bytes(tmp_path):
    """A source's ``local_header`` (Fashion-MNIST's for Debian's copies) rewrites a local copy's first
    bytes; the result is verified against the pins; over HTTP it is not asked; the downloader itself
    names no dataset."""
    official = b"HEADER-v1|" + _payload(50_000)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "f.bin").write_bytes(b"hdr" + official[10:])          # a 3-byte header instead of 10
    asked = []

    def header(rf, path):
        asked.append((rf.name, path))
        return official[:10], 3

    rf = S.RemoteFile("f.bin", None, sha256=_sha(official), size=len(official))
    src = S.Source("toy", "Toy", (rf,), local_header=header)
    res = D.fetch_source_file(src, "f.bin", tmp_path / "out", str(mirror), progress=False)
    assert res.path.read_bytes() == official and asked == [("f.bin", mirror / "f.bin")]
    (mirror / "g.bin").write_bytes(b"hdr" + official[10:])
    bad = S.Source("toy", "Toy", (S.RemoteFile("g.bin", None, sha256="0" * 64),), local_header=header)
    with pytest.raises(D.ChecksumMismatch, match="g.bin"):
        D.fetch_source_file(bad, "g.bin", tmp_path / "out", str(mirror), progress=False)
    with FileServer(mirror) as srv:
        plain = S.Source("toy", "Toy", (S.RemoteFile("f.bin", None),), local_header=header)
        res = D.fetch_source_file(plain, "f.bin", tmp_path / "http", srv.base_url, **FAST)
    assert res.path.read_bytes() == (mirror / "f.bin").read_bytes() and len(asked) == 2
    text = "".join(Path(m.__file__).read_text().lower() for m in (D, S))
    assert "fashion" not in text and "debian" not in text
