"""Reading a dataset manifest (``data/shards/<dataset>/manifest.json``) and checking its shards.

Every shard a split lists is a path relative to the manifest's folder and stays inside it: an
absolute path, a ``..`` component or a symbolic link that leads out of the folder is refused before
anything is opened. Every shard is checked against the sha256 the manifest records before its
samples are used (:func:`verify_shards`): once per process and file (a shard whose size, inode or
change time differs from when it was checked is checked again), in the process that builds the
stream, before the loader's workers fork (they inherit what was checked). A shard that is not
what the manifest lists (another dataset's, changed, cut short) is a :class:`ShardVerifyError`
naming the shard and the manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from chexflow.fsutil import open_regular, read_regular

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A dataset manifest is missing, malformed, or lacks the split asked for."""


class ShardVerifyError(ManifestError):
    """A shard is not the file its manifest lists (checksum, kind or place); names both."""


@dataclass(frozen=True)
class ShardRef:
    """One shard to read: ``path`` (opened), ``count`` samples; from a manifest also the ``sha256``
    it must have, its ``name`` there and the ``manifest`` (refs without ``sha256`` are not checked)."""
    path: str
    count: int
    sha256: str | None = None
    name: str = ""
    manifest: str = ""


def read_manifest(path: Path) -> dict:
    """The JSON object of a dataset manifest (a regular file, bounded in size)."""
    path = Path(path)
    try:
        m = json.loads(read_regular(path, what="dataset manifest"))
    except (OSError, ValueError) as exc:     # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{path}: cannot read dataset manifest ({exc})") from exc
    if not isinstance(m, dict):
        raise ManifestError(f"{path}: not a dataset manifest (a JSON {type(m).__name__}, not an object)")
    return m


def contained(root: Path, rel: object, *, where: str) -> str:
    """The real path of ``root/rel`` if ``rel`` is a relative path that stays inside ``root`` (symbolic
    links resolved); else :class:`ManifestError` saying why (``where``: the manifest). Opens nothing."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise ManifestError(f"{where}: shard path {rel!r} is not a file name")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or os.path.isabs(rel):
        raise ManifestError(f"{where}: shard path {rel!r} is absolute; shards are listed relative to the "
                            "manifest's folder and stay inside it")
    if ".." in pure.parts:
        raise ManifestError(f"{where}: shard path {rel!r} climbs out of the manifest's folder ('..')")
    top = os.path.realpath(root)
    real = os.path.realpath(os.path.join(top, rel))
    if os.path.commonpath([top, real]) != top or real == top:
        raise ManifestError(f"{where}: shard path {rel!r} leads out of the manifest's folder {top} (resolves "
                            f"to {real})")
    return real


def split_shards(manifest_path: Path, split: str) -> list[ShardRef]:
    """The shards of ``split``, their paths checked to stay in the manifest's folder (nothing opened)."""
    manifest_path = Path(manifest_path)
    m = read_manifest(manifest_path)
    splits = m.get("splits")
    if not isinstance(splits, dict) or split not in splits:
        raise ManifestError(f"{manifest_path}: no split {split!r} "
                            f"(has {sorted(splits) if isinstance(splits, dict) else 'no splits'})")
    entries = splits[split].get("shards") if isinstance(splits[split], dict) else None
    if not isinstance(entries, list):
        raise ManifestError(f"{manifest_path}: split {split!r} lists no shards")
    refs = []
    for i, s in enumerate(entries):
        if not isinstance(s, dict):
            raise ManifestError(f"{manifest_path}: split {split!r} shard {i} is not an object")
        count, digest = s.get("count"), s.get("sha256")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ManifestError(f"{manifest_path}: shard {s.get('path')!r} count {count!r} is not a count")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ManifestError(f"{manifest_path}: shard {s.get('path')!r} has no sha256 (rebuild the shards "
                                "with this chexflow)")
        real = contained(manifest_path.parent, s.get("path"), where=str(manifest_path))
        refs.append(ShardRef(real, count, digest, s["path"], str(manifest_path)))
    return refs


# (path) -> (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns, sha256) of shards checked in this process
_VERIFIED: dict[str, tuple] = {}


def _identity(st: os.stat_result, digest: str) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest


def _what(ref: ShardRef) -> str:
    return f"{ref.path}: shard {ref.name or os.path.basename(ref.path)!r} of {ref.manifest or 'its manifest'}"


def verify_shard(ref: ShardRef) -> None:
    """Check one shard against its manifest's sha256 (a no-op when this process already checked the
    same unchanged file, or for a ref without ``sha256``); :class:`ShardVerifyError` when it differs."""
    if ref.sha256 is None:
        return
    try:
        with open_regular(ref.path, follow_symlinks=False) as fh:
            st = os.fstat(fh.fileno())
            if _VERIFIED.get(ref.path) == _identity(st, ref.sha256):
                return
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError as exc:
        raise ShardVerifyError(f"{_what(ref)}: cannot be read ({exc})") from exc
    if digest != ref.sha256:
        raise ShardVerifyError(
            f"{_what(ref)}: its sha256 {digest[:16]}... is not the manifest's {ref.sha256[:16]}... ({st.st_size:,} "
            "bytes): changed, cut short, or another dataset's shard; refused. Rebuild the dataset's shards "
            "(delete them and rerun the workflow's shard jobs)")
    _VERIFIED[ref.path] = _identity(st, ref.sha256)


def verify_shards(shards: list[ShardRef]) -> None:
    """:func:`verify_shard` for each of ``shards``."""
    for ref in shards:
        verify_shard(ref)


def forget_verified() -> None:
    """Forget which shards this process checked (the next use checks them again; for benchmarks)."""
    _VERIFIED.clear()
