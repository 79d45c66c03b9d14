"""What a dataset's release is made of: its files, official URLs, pinned checksums, roles.

A ``Source`` (each dataset module defines its own; ``chexflow.data.registry.get_source`` finds it) names
the files of one dataset as they lie under ``data/raw/<dataset>/``, each with its role. Each file
has its official URL (or ``None`` where the data sit behind a registration or a folder link, in
which case the user gives a *mirror*: a local directory, a ``file://`` URL or an ``http(s)``
base URL holding the files under the same names) and, where known, its published checksums.

Tests that serve a *generated* mirror of a real source (e.g. a tiny ChestX-ray14 in the exact
release layout) cannot match the pinned checksums or the published table sizes. For them only,
the environment variable ``CHEXFLOW_TEST_REGISTRY`` may name a JSON file that replaces those pins
and expectations (``chexflow.data.registry.load_test_registry``). Nothing in ``config.yaml`` can set it; the CLI stages
that use it print a warning naming the file.
"""
from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

ROLES = ("archive", "images", "labels", "split_list", "boxes", "checksums", "devkit", "data")


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


# For a mirror whose local copies differ from the official files only in their first bytes (e.g. a
# rewritten gzip header): (file, path of the local copy) -> (the official first bytes, how many bytes
# of the copy they replace), or None where the copy is the official file. Checked by the pins as usual.
LocalHeader = Callable[[RemoteFile, Path], "tuple[bytes, int] | None"]


@dataclass(frozen=True)
class Source:
    name: str
    title: str
    files: tuple[RemoteFile, ...]
    checksums_file: str | None = None  # sha256sum-format file at the same base giving sums for unpinned files
    synthetic: bool = False
    how_to_obtain: str = ""            # shown when a URL is None and no mirror is given
    local_header: LocalHeader | None = None   # how a local mirror's copies differ (see LocalHeader)

    def file(self, name: str) -> RemoteFile:
        for f in self.files:
            if f.name == name:
                return f
        raise UnknownFileError(f"dataset {self.name!r} has no file {name!r}; its files: "
                               f"{', '.join(file_names(self))}")


class UnknownSourceError(KeyError):
    """The registry was asked for a dataset it does not know."""

    def __str__(self) -> str:  # KeyError would show the repr of the message
        return str(self.args[0]) if self.args else ""


class UnknownFileError(UnknownSourceError):
    """A dataset was asked for a file it does not have (``chexflow download --file``)."""


class NoURLError(ValueError):
    """A file has no official URL and no mirror was given."""


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
