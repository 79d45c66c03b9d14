"""Node-local staging: shards copied to a node's disk and checked as they are copied
(:func:`stage_shards`)."""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path

from chexflow.data.manifest import ManifestError, ShardRef, ShardVerifyError, verify_shard
from chexflow.data.stamps import Stamp, StampStore
from chexflow.fsutil import atomic_path, open_regular


def _staged_path(s: ShardRef, dest: Path) -> str:
    src = Path(s.path)
    return str(dest / f"{hashlib.sha1(str(src.parent).encode()).hexdigest()[:10]}-{src.name}")


def stage_shards(shards: list[ShardRef], dest: Path, *, copy: bool = True, start: str = "",
                 log=print) -> list[ShardRef]:
    """Copy shards to node-local disk (the PRACE guide's advice), each checked against the
    manifest's sha256 as it is copied (one read of the shared file system); returns the copies.

    A copy already there is kept when its stamp in ``dest`` vouches for it (nothing read) or, failing
    that, when it hashes right (a local read). The copies' stamps are written in ``dest``: they live
    and die with the copies, and are ``copied`` stamps (the hash made while copying), so the node's
    other ranks of this start (:func:`verify_staged`) and a requeue on the same node use the copies
    without reading them.
    ``copy=False`` only maps the paths: the other ranks of a node wait for the one that copies.
    """
    dest = Path(os.path.expandvars(str(dest)))
    staged = [replace(s, path=_staged_path(s, dest)) for s in shards]
    if not copy or not shards:
        return staged
    dest.mkdir(parents=True, exist_ok=True)
    store = StampStore(dest, shards[0].manifest or dest, log=log)
    known, fresh = store.load(), {}
    for src, dst in zip(shards, staged):
        stamp = _kept_copy(dst, known.get(dst.path), start)
        fresh[dst.path] = stamp or _copy_checked(src, dst, start)
    store.save({path: stamp for path, stamp in fresh.items() if stamp is not None})
    return staged


def _kept_copy(staged: ShardRef, stamp: Stamp | None, start: str) -> Stamp | None:
    """The stamp of a copy already there that checks out against the manifest's sha256 (by its stamp,
    or hashed), else None (missing, stale or broken: copied again)."""
    if staged.sha256 is None or not os.path.lexists(staged.path):
        return None
    try:
        return verify_shard(staged, stamp=stamp, start=start)
    except ManifestError:
        return None


def _copy_checked(src: ShardRef, staged: ShardRef, start: str) -> Stamp | None:
    """Copy ``src`` to ``staged.path``, hashing the bytes as they pass; the copy takes its name only
    when they are the manifest's (else :class:`ShardVerifyError` naming both)."""
    h = hashlib.sha256()
    with atomic_path(staged.path) as tmp, open_regular(src.path, follow_symlinks=False) as fin:
        with open(tmp, "wb") as fout:
            while block := fin.read(1 << 20):
                h.update(block)
                fout.write(block)
        if src.sha256 is not None and h.hexdigest() != src.sha256:
            name = f"{src.name or os.path.basename(src.path)} (copied from {src.path})"
            raise ShardVerifyError(
                f"{staged.path}: shard {name!r} of {src.manifest or 'its manifest'}: its sha256 "
                f"{h.hexdigest()[:16]}... is not the manifest's {src.sha256[:16]}...: changed, cut short, or another "
                "dataset's shard; refused")
    if src.sha256 is None:
        return None
    checked_ns = time.time_ns()
    # the proof of the hash made while copying: a later start trusts the copy by this stamp alone
    # (chexflow.data.stamps: "copied"), with no local read
    return Stamp.of(os.stat(staged.path, follow_symlinks=False), src.sha256, checked_ns=checked_ns, start=start,
                    copied=True)


def verify_staged(staged: list[ShardRef], dest: Path, *, start: str, log=print) -> None:
    """Check the node-local copies a node's copying rank made (:func:`stage_shards`): by the stamps it
    wrote in ``dest`` for this ``start``, nothing read; a copy without a stamp that vouches for it is
    hashed."""
    dest = Path(os.path.expandvars(str(dest)))
    known = StampStore(dest, staged[0].manifest or dest, log=log).load() if staged else {}
    for ref in staged:
        verify_shard(ref, stamp=known.get(ref.path), start=start)
