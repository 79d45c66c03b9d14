"""Registry of the datasets chexflow downloads: file names, official URLs, pinned checksums.

A ``Source`` lists the files of one dataset as they lie under ``data/raw/<dataset>/``. Each file
has its official URL (or ``None`` where the data sit behind a registration or a folder link, in
which case the user gives a *mirror*: a local directory, a ``file://`` URL or an ``http(s)``
base URL holding the files under the same names) and, where known, its published checksums.

Tests that serve a *generated* mirror of a real source (e.g. a tiny ChestX-ray14 in the exact
release layout) cannot match the pinned checksums or the published table sizes. For them only,
the environment variable ``CHEXFLOW_TEST_REGISTRY`` may name a JSON file that replaces those pins
and expectations (``load_test_registry``). Nothing in ``config.yaml`` can set it; the CLI stages
that use it print a warning naming the file.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

ROLES = ("archive", "images", "labels", "split_list", "checksums", "devkit", "data")


@dataclass(frozen=True)
class RemoteFile:
    name: str                 # file name under data/raw/<dataset>/
    url: str | None           # official URL (None: the user must give a mirror/path)
    md5: str | None = None
    sha256: str | None = None
    size: int | None = None
    role: str = "data"        # one of ROLES; "archive" = one image archive = one shard job

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: role {self.role!r} is not one of {ROLES}")
        if "/" in self.name or self.name in ("", ".", ".."):
            raise ValueError(f"{self.name!r}: a file name, not a path, is expected")


@dataclass(frozen=True)
class Source:
    name: str
    title: str
    files: tuple[RemoteFile, ...]
    checksums_file: str | None = None  # sha256sum-format file at the same base giving sums for unpinned files
    synthetic: bool = False
    how_to_obtain: str = ""            # shown when a URL is None and no mirror is given

    def file(self, name: str) -> RemoteFile:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(f"source {self.name!r} has no file {name!r}; its files are {file_names(self)}")


class UnknownSourceError(KeyError):
    """``get_source`` was asked for a dataset the registry does not know."""

    def __str__(self) -> str:  # KeyError would show the repr of the message
        return str(self.args[0]) if self.args else ""


class NoURLError(ValueError):
    """A file has no official URL and no mirror was given."""


# --------------------------------------------------------------------------- Fashion-MNIST
_FMNIST_BASE = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# md5: published in the Fashion-MNIST README. sha256 and size: of the official files, computed
# from the Debian package dataset-fashion-mnist after restoring their gzip header (see below);
# the restored bytes reproduce all four published md5s.
_FMNIST = (
    # name, md5, sha256, size, role
    ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
     "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", 26421880, "archive"),
    ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe",
     "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", 29515, "labels"),
    ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79",
     "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", 4422102, "archive"),
    ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310",
     "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", 5148, "labels"),
)
# Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist) ships the same compressed
# streams, but dh_strip_nondeterminism rewrote each gzip header: FNAME dropped, MTIME set to the
# packaging time. The official header is FLG=FNAME, this MTIME, XFL=0, OS=3 (Unix), the name
# without ".gz". chexflow.data.download.restore_debian_gzip rebuilds the official bytes.
FASHION_MNIST_GZIP_MTIME = {
    "train-images-idx3-ubyte.gz": 1504176606,   # 2017-08-31 10:50:06 UTC
    "train-labels-idx1-ubyte.gz": 1504176606,
    "t10k-images-idx3-ubyte.gz": 1504176627,    # 2017-08-31 10:50:27 UTC
    "t10k-labels-idx1-ubyte.gz": 1504176627,
}


def _fashion_mnist() -> Source:
    return Source(
        name="fashion_mnist",
        title="Fashion-MNIST (Zalando Research)",
        files=tuple(RemoteFile(name=n, url=_FMNIST_BASE + n, md5=md5, sha256=sha, size=size, role=role)
                    for n, md5, sha, size, role in _FMNIST),
        how_to_obtain="Official files at " + _FMNIST_BASE + " (no registration needed).",
    )


# --------------------------------------------------------------------------- NIH ChestX-ray14
_NIH_HOW = (
    "The NIH ChestX-ray14 label and split files are in the NIH Box folder "
    "https://nihcc.app.box.com/v/ChestXray-NIHCC (Data_Entry_2017_v2020.csv, train_val_list.txt, "
    "test_list.txt); Data_Entry_2017_v2020.csv is also shipped inside the torchxrayvision wheel. "
    "Put them in a directory (or serve it over HTTP) and pass it as the mirror."
)
# (Box shared-link id, md5) of images_001.tar.gz ... images_012.tar.gz, as published with
# PyHealth's ChestX-ray14 loader (not verified by chexflow).
_NIH_ARCHIVES = (
    ("vfk49d74nhbxq3nqjg0900w5nvkorp5c", "fe8ed0a6961412fddcbb3603c11b3698"),
    ("i28rlmbvmfjbl8p2n3ril0pptcmcu9d1", "ab07a2d7cbe6f65ddd97b4ed7bde10bf"),
    ("f1t00wrtdk94satdfb9olcolqx20z2jp", "2301d03bde4c246388bad3876965d574"),
    ("0aowwzs5lhjrceb3qp67ahp0rd1l1etg", "9f1b7f5aae01b13f4bc8e2c44a4b8ef6"),
    ("v5e3goj22zr6h8tzualxfsqlqaygfbsn", "1861f3cd0ef7734df8104f2b0309023b"),
    ("asi7ikud9jwnkrnkj99jnpfkjdes7l6l", "456b53a8b351afd92a35bc41444c58c8"),
    ("jn1b4mw4n6lnh74ovmcjb8y48h8xj07n", "1075121ea20a137b87f290d6a4a5965e"),
    ("tvpxmn7qyrgl0w8wfh9kqfjskv6nmm1j", "b61f34cec3aa69f295fbb593cbd9d443"),
    ("upyy3ml7qdumlgk2rfcvlb9k6gvqq2pj", "442a3caa61ae9b64e61c561294d1e183"),
    ("l6nilvfa9cg3s28tqv1qc1olm3gnz54p", "09ec81c4c31e32858ad8cf965c494b74"),
    ("hhq8fkdgvcari67vfhs7ppg2w6ni4jze", "499aefc67207a5a97692424cf5dbeed5"),
    ("ioqwiy20ihqwyr8pf4c24eazhh281pbu", "dc9fda1757c2de0032b63347a7d2895c"),
)
NIH_TABLES = ("Data_Entry_2017_v2020.csv", "train_val_list.txt", "test_list.txt")
NIH_N_ARCHIVES = len(_NIH_ARCHIVES)


def archive_name(i: int) -> str:
    """Name of the i-th (1-based) NIH image archive: ``images_001.tar.gz``."""
    return f"images_{i:03d}.tar.gz"


def _nih_tables() -> tuple[RemoteFile, ...]:
    label, *splits = NIH_TABLES
    return (RemoteFile(label, None, role="labels"),
            *(RemoteFile(s, None, role="split_list") for s in splits))


def _check_n_archives(source: str, n_archives: int | None, maximum: int | None) -> int:
    if n_archives is None:
        if maximum is None:
            raise ValueError(f"source {source!r} needs n_archives (how many images_NNN.tar.gz the release has)")
        return maximum
    if isinstance(n_archives, bool) or not isinstance(n_archives, int) or n_archives < 1:
        raise ValueError(f"source {source!r}: n_archives must be a positive integer, got {n_archives!r}")
    if maximum is not None and n_archives > maximum:
        raise ValueError(f"source {source!r}: n_archives={n_archives} but the release has only {maximum} archives")
    if n_archives > 999:
        raise ValueError(f"source {source!r}: n_archives={n_archives} exceeds the images_NNN naming (max 999)")
    return n_archives


def _nih(n_archives: int | None) -> Source:
    if n_archives is not None:
        raise ValueError(f"source 'nih' always has its {NIH_N_ARCHIVES} archives; a pilot on part of the "
                         "release is declared with datasets.nih.archives (e.g. [1, 2])")
    archives = tuple(
        RemoteFile(archive_name(i), f"https://nihcc.box.com/shared/static/{box_id}.gz", md5=md5, role="archive")
        for i, (box_id, md5) in enumerate(_NIH_ARCHIVES, start=1))
    return Source(name="nih", title="NIH ChestX-ray14 (NIH Clinical Center)",
                  files=archives + _nih_tables(), how_to_obtain=_NIH_HOW)


def _nih_demo(n_archives: int | None) -> Source:
    n = _check_n_archives("nih_demo", n_archives, None)
    archives = tuple(RemoteFile(archive_name(i), None, role="archive") for i in range(1, n + 1))
    return Source(
        name="nih_demo", title="Synthetic phantom release in the NIH ChestX-ray14 layout",
        files=archives + _nih_tables(), checksums_file="SHA256SUMS", synthetic=True,
        how_to_obtain="The phantom release is generated locally (chexflow.data.phantoms); "
                      "pass the directory it was written to as the mirror.")


# --------------------------------------------------------------------------- ImageNet
def _imagenet() -> Source:
    how = ("ImageNet (ILSVRC2012) requires registration at https://image-net.org/ ; download "
           "ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and ILSVRC2012_devkit_t12.tar.gz and give "
           "their directory (or a file:// / http(s) URL of it) as the mirror.")
    return Source(
        name="imagenet", title="ImageNet ILSVRC2012",
        files=(RemoteFile("ILSVRC2012_img_train.tar", None, md5="1d675b47d978889d74fa0da5fadfb00e", role="archive"),
               RemoteFile("ILSVRC2012_img_val.tar", None, md5="29b22e2961454d5413ddabcf34fc5622", role="archive"),
               RemoteFile("ILSVRC2012_devkit_t12.tar.gz", None, md5="fa75699e90414af021442c21a62c3abf",
                          role="devkit")),
        how_to_obtain=how)


_REGISTRY = {
    "fashion_mnist": lambda n: _fashion_mnist(),
    "nih": _nih,
    "nih_demo": _nih_demo,
    "imagenet": lambda n: _imagenet(),
}
SOURCE_NAMES = tuple(sorted(_REGISTRY))


def get_source(name: str, *, n_archives: int | None = None) -> Source:
    """The registered source ``name``.

    ``n_archives``: for ``nih_demo`` (required) the number of archives of the generated release;
    an error for ``nih`` (always its 12 archives); ignored by the others.
    """
    try:
        build = _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownSourceError(f"unknown dataset source {name!r}; known sources: {', '.join(SOURCE_NAMES)}") from None
    return build(n_archives)


def _is_url(s: str) -> bool:
    return urllib.parse.urlsplit(s).scheme in ("http", "https", "file")


def join_base(base: str, name: str) -> str:
    """``name`` under a mirror ``base``: a directory path, a file:// URL or an http(s) base URL."""
    if _is_url(base):
        return base.rstrip("/") + "/" + urllib.parse.quote(name)
    return str(Path(base).expanduser() / name)


def resolve_url(source: Source, file: RemoteFile, mirror: str | None) -> str:
    """Where to fetch ``file`` from: ``mirror``/name if a mirror is given, else the official URL."""
    if mirror is not None and str(mirror) != "":
        return join_base(str(mirror), file.name)
    if file.url is None:
        raise NoURLError(f"{source.name}/{file.name} has no public URL and no mirror was given. "
                         f"{source.how_to_obtain}")
    return file.url


def file_names(source: Source) -> list[str]:
    return [f.name for f in source.files]


def archives(source: Source) -> list[RemoteFile]:
    return [f for f in source.files if f.role == "archive"]


# --------------------------------------------------------------------------- test-only registry

TEST_REGISTRY_ENV = "CHEXFLOW_TEST_REGISTRY"


class RegistryOverrideError(ValueError):
    """The test registry file named by CHEXFLOW_TEST_REGISTRY is malformed; names the file and key."""


def load_test_registry(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The test-only registry override named by ``$CHEXFLOW_TEST_REGISTRY`` (None when unset).

    A JSON object ``{source: {"files": {name: {"sha256": hex, "size": int}}, "content": {...}}}``:
    ``files`` replaces the pinned checksums of those files (their md5 pins are dropped), and
    ``content`` replaces the published content a source's tables are checked against (for
    ``nih``: the fields of ``chexflow.data.nih.ReleaseCounts``). For tests that serve a generated
    mirror of a real source; a warning naming the file goes to stderr whenever it is used.
    """
    path = (os.environ if environ is None else environ).get(TEST_REGISTRY_ENV)
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RegistryOverrideError(f"{TEST_REGISTRY_ENV}={path}: cannot read the test registry ({exc})") from exc
    if not isinstance(data, dict):
        raise RegistryOverrideError(f"{path}: expected a JSON object {{source: {{files, content}}}}")
    for name, entry in data.items():
        if name not in _REGISTRY:
            raise RegistryOverrideError(f"{path}: unknown source {name!r}; known: {', '.join(SOURCE_NAMES)}")
        if not isinstance(entry, dict) or set(entry) - {"files", "content"}:
            raise RegistryOverrideError(f"{path}: {name}: expected an object with keys 'files' and/or 'content'")
    print(f"WARNING: {TEST_REGISTRY_ENV}={path}: pinned checksums / published contents of "
          f"{', '.join(sorted(data))} are replaced by this test registry", file=sys.stderr)
    return data


def with_test_pins(source: Source, registry: Mapping[str, Any] | None) -> Source:
    """``source`` with the checksums of ``registry[source.name]["files"]`` (unchanged without one)."""
    files = ((registry or {}).get(source.name) or {}).get("files") or {}
    known = set(file_names(source))
    unknown = sorted(set(files) - known)
    if unknown:
        raise RegistryOverrideError(f"test registry: source {source.name!r} has no file(s) {unknown}")
    out = []
    for f in source.files:
        pin = files.get(f.name)
        if pin is None:
            out.append(f)
            continue
        if not isinstance(pin, dict) or set(pin) - {"sha256", "size"} or "sha256" not in pin:
            raise RegistryOverrideError(f"test registry: {source.name}/{f.name}: expected {{sha256, size}}, got {pin!r}")
        out.append(dataclasses.replace(f, md5=None, sha256=str(pin["sha256"]).lower(), size=pin.get("size")))
    return dataclasses.replace(source, files=tuple(out))


def registry_content(registry: Mapping[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The published-content override of source ``name`` in the test registry, if any."""
    return ((registry or {}).get(name) or {}).get("content")
