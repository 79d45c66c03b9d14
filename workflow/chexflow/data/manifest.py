"""Reading a dataset manifest (``data/shards/<dataset>/manifest.json``) and checking its shards.

Every shard a split lists is a path relative to the manifest's folder and stays inside it: an
absolute path, a ``..`` component or a symbolic link that leads out of the folder is refused before
anything is opened. Every shard is checked against the sha256 the manifest records before its
samples are used, in the process that builds the stream, before the loader's workers start (they
receive what was checked): a shard whose inode, size, mtime or ctime differs from when it was
checked is checked again. A shard that is not what the manifest lists (another dataset's, changed,
cut short) is a :class:`ShardVerifyError` naming the shard and the manifest.

What a check costs does not grow with the number of ranks: :func:`verify_on_world` has each shard
checked by one rank (the one that reads it first), the ranks exchange what they found, and a
stamp (:mod:`chexflow.data.stamps`) lets the next start use an unchanged shard without reading it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from chexflow.data.stamps import Stamp, StampStore
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


# real path -> Stamp of the shards this process checked, or that another rank of this start checked and
# this process saw described the same (verify_on_world)
_VERIFIED: dict[str, Stamp] = {}


def _what(ref: ShardRef) -> str:
    return f"{ref.path}: shard {ref.name or os.path.basename(ref.path)!r} of {ref.manifest or 'its manifest'}"


def _check(ref: ShardRef, stamp: Stamp | None = None, start: str = "") -> tuple[Stamp, bool]:
    """(what ``ref``'s file is now, whether it was hashed for it). Not hashed: this process checked
    the same unchanged file already, or ``stamp`` vouches for it (:mod:`chexflow.data.stamps`).
    :class:`ShardVerifyError` when it is not the manifest's."""
    try:
        with open_regular(ref.path, follow_symlinks=False) as fh:
            st = os.fstat(fh.fileno())
            seen = _VERIFIED.get(ref.path)
            if seen is not None and seen.describes(st, ref.sha256):
                return seen, False
            if stamp is not None and stamp.vouches(st, ref.sha256, start=start):
                _VERIFIED[ref.path] = stamp
                return stamp, False
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
            checked_ns = time.time_ns()          # before the description it stands for (stamps.Stamp.settled)
            after = os.fstat(fh.fileno())
    except OSError as exc:
        raise ShardVerifyError(f"{_what(ref)}: cannot be read ({exc})") from exc
    if digest != ref.sha256:
        raise ShardVerifyError(
            f"{_what(ref)}: its sha256 {digest[:16]}... is not the manifest's {ref.sha256[:16]}... ({st.st_size:,} "
            "bytes): changed, cut short, or another dataset's shard; refused. Rebuild the dataset's shards "
            "(delete them and rerun the workflow's shard jobs)")
    if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (after.st_size, after.st_mtime_ns, after.st_ctime_ns):
        raise ShardVerifyError(f"{_what(ref)}: changed while it was being checked; refused (is a shard job "
                               "still writing it?)")
    _VERIFIED[ref.path] = checked = Stamp.of(after, digest, checked_ns=checked_ns, start=start)
    return checked, True


def verify_shard(ref: ShardRef, *, stamp: Stamp | None = None, start: str = "") -> Stamp | None:
    """Check one shard against its manifest's sha256: hashed unless this process already checked the
    same unchanged file or ``stamp`` vouches for it; a no-op for a ref without ``sha256``.
    :class:`ShardVerifyError` when it differs. Returns what was found."""
    return None if ref.sha256 is None else _check(ref, stamp, start)[0]


def verify_shards(shards: list[ShardRef]) -> None:
    """:func:`verify_shard` for each of ``shards``."""
    for ref in shards:
        verify_shard(ref)


class World(Protocol):
    """What checking shards together needs of a world of ranks (``chexflow.train.backends.Backend``)."""
    rank: int
    size: int

    def broadcast_object(self, obj: Any) -> Any: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...


class Alone:
    """The world of one process."""
    rank, size = 0, 1

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]


@dataclass(frozen=True)
class Checked:
    """What :func:`verify_on_world` did: shards checked, how many of them were hashed (by any rank),
    their bytes, and the bytes this rank hashed."""
    shards: int
    hashed: int
    hashed_bytes: int
    hashed_here: int

    def __str__(self) -> str:
        return (f"{self.shards} shards checked against the manifest's sha256: {self.hashed} hashed "
                f"({self.hashed_bytes / 2**20:.1f} MiB, each by one rank), {self.shards - self.hashed} unchanged "
                "since their stamps")


def verify_on_world(shards: list[ShardRef], owners: list[int], world: World,
                    store: StampStore | None = None) -> Checked:
    """Check ``shards`` with every rank of ``world`` (a collective: each rank calls it with the same
    arguments): rank ``owners[i]`` checks shard ``i`` (hashing it unless the stamps in ``store``
    vouch for it), the ranks exchange what they found, and each keeps every shard's description
    (its workers then hash only a shard changed since). Rank 0 reads the stamps and broadcasts them,
    and writes the new ones. A refusal on any rank is a :class:`ShardVerifyError` on every rank (the
    first shard's, in ``shards`` order), so none waits in a later collective."""
    known = world.broadcast_object(store.load() if store is not None and world.rank == 0 else None) or {}
    mine = []
    for i, (ref, owner) in enumerate(zip(shards, owners, strict=True)):
        if owner != world.rank or ref.sha256 is None:
            continue
        try:
            stamp, hashed = _check(ref, known.get(ref.path))
            mine.append((i, ref.path, stamp, hashed, None))
        except ShardVerifyError as exc:
            mine.append((i, ref.path, None, False, str(exc)))
    found = sorted(r for part in world.allgather_object(mine) for r in part)
    errors = [r[4] for r in found if r[4]]
    if errors:
        more = f" (and {len(errors) - 1} more shard(s) refused)" if len(errors) > 1 else ""
        raise ShardVerifyError(errors[0] + more)
    for _, path, stamp, _, _ in found:
        _VERIFIED[path] = stamp
    fresh = {path: stamp for _, path, stamp, hashed, _ in found if hashed}
    if fresh and store is not None and world.rank == 0:
        store.save(fresh)
    return Checked(shards=len(found), hashed=len(fresh), hashed_bytes=sum(s.size for s in fresh.values()),
                   hashed_here=sum(stamp.size for _, _, stamp, hashed, _ in mine if hashed))


def checked_stamps(paths: list[str]) -> dict[str, Stamp]:
    """What this process found when it checked these shards (for a loader worker, another process)."""
    return {path: _VERIFIED[path] for path in paths if path in _VERIFIED}


def remember_checked(stamps: dict[str, Stamp]) -> None:
    """Take what the process that made this loader worker checked (:func:`checked_stamps`): a shard
    changed since is still hashed again, as in that process."""
    _VERIFIED.update(stamps)


def forget_verified() -> None:
    """Forget which shards this process checked (the next use checks them again; for benchmarks)."""
    _VERIFIED.clear()
