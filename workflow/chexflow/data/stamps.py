"""Verification stamps: what a check of a shard against its manifest's sha256 found, kept so that
the next start (a requeue, another stage on the same data) need not read the shard again.

A stamp says: the file at this real path had this sha256 when it was checked, and then the file
system described it as (inode, size, mtime_ns, ctime_ns). A later start trusts the stamp, without
reading a byte, only if the file is described the same way now and the sha256 is the one its
manifest wants. What that proves, and what it does not:

* Any write through the file system (``write``, ``truncate``, ``mmap``, a copy over it, a rename of
  another file to its name, ``chmod``, ``touch -d``) sets the file's ctime to the current time, and
  no unprivileged call can set ctime back. A new file under the name has another inode. So an
  unchanged (inode, size, mtime_ns, ctime_ns) means no such write, *provided* a write after the
  check cannot land in the same timestamp tick as the ctime recorded ("racy" stamps, as git calls
  its index entries): a stamp is trusted across starts only if the file's ctime was at least
  :data:`SETTLE_NS` older than the checker's clock when it checked (a later write then gets a later
  ctime). A stamp taken on a newer file is trusted only within the start that took it (its
  ``start`` token), and the next start hashes the file again. This assumes the file system's
  clock (the file server's, on NFS or Lustre) and the node's agree within :data:`SETTLE_NS`.
* A node-local copy (``chexflow.data.staging``) carries another proof: its stamp is ``copied``, taken
  by the process that wrote it from bytes it hashed as they passed (the bytes written are the bytes
  hashed), described right after it took its name. Its last change is that process's own write, so
  a later start trusts it as soon as the file is described the same way, settled or not: a write
  by someone else after the copy gets a later ctime, or a new inode, unless it lands in the same
  timestamp tick as the copy's last write, on a file that had a private temporary name until then.
* ``st_dev`` is left out: on network file systems it is the client's number for the mount and
  differs between nodes (and between boots); the real path stands for "which file system".
* It does not prove the bytes on the disk are still good (media errors, a restore of a block
  device, root writing to the raw device or moving the clock): those need the hash itself, which
  a store that is absent, unreadable or switched off (``CHEXFLOW_VERIFIED_DIR=off``) gives on
  every start.
* A stamp is itself a file that could be planted: the store is trusted only if it is a directory
  (not a link) owned by this user and writable by no one else, and a stamp file only if it is a
  regular file (not a link) with the same owner and mode; anything else is ignored with a message,
  and the shards are hashed. Whoever can write the store as this user can also rewrite the user's
  manifests and checkpoints: a stamp is a record, not a signature.

Stamps are written atomically (a temporary name, then ``rename``): ranks or jobs writing the same
stamp file at once leave one whole file, and an update lost that way only costs a hash later.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Callable

from chexflow.fsutil import ReplacedWhileOpening, atomic_path, open_regular

FORMAT = 1
SETTLE_NS = 2_000_000_000      # see the module docstring ("racy" stamps)
MAX_BYTES = 64 << 20           # a stamp file: ~150 bytes per shard
RENAMED_RETRIES = 5            # reads retried when a concurrent save renamed the file in between
_SHA256_HEX = 64


@dataclass(frozen=True)
class Stamp:
    """One shard as checked: its sha256, how the file system described it, when, and by which start."""
    sha256: str
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    checked_ns: int         # the checker's wall clock (time.time_ns) when it took the description
    start: str = ""         # the start that checked it (trusted by that start even when not settled)
    copied: bool = False    # written by the checker from the bytes it hashed (a node-local copy)

    @classmethod
    def of(cls, st: os.stat_result, sha256: str, *, checked_ns: int, start: str = "", copied: bool = False) -> "Stamp":
        """The stamp of a file described by ``st`` (taken after ``checked_ns``) that had ``sha256``."""
        return cls(sha256, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, checked_ns, start, copied)

    def describes(self, st: os.stat_result, sha256: str) -> bool:
        """Whether the file described by ``st`` is described as when checked, and ``sha256`` is what was found."""
        return (self.sha256, self.ino, self.size, self.mtime_ns, self.ctime_ns) == (
            sha256, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def settled(self) -> bool:
        """Whether the file's last change was at least SETTLE_NS older than the check."""
        return self.ctime_ns <= self.checked_ns - SETTLE_NS

    def vouches(self, st: os.stat_result, sha256: str, *, start: str = "") -> bool:
        """Whether this stamp lets a start (``start``) use the file described by ``st`` as having
        ``sha256`` without reading it."""
        return self.describes(st, sha256) and (self.settled or self.copied or bool(start) and self.start == start)


def _stamp(value: object) -> Stamp | None:
    """A stamp from its stored form (7 fields as written before copies were marked, or 8), or None
    when it is malformed."""
    if not isinstance(value, list) or len(value) not in (7, 8):
        return None
    digest, *numbers, start = value[:7]
    copied = value[7] if len(value) == 8 else False
    if not (isinstance(digest, str) and len(digest) == _SHA256_HEX and isinstance(start, str)
            and type(copied) is bool and all(type(n) is int and n >= 0 for n in numbers)):
        return None
    return Stamp(digest, *numbers, start, copied)


def _trusted(st: os.stat_result, kind: Callable[[int], bool], what: str) -> str | None:
    """Why a store entry of stat ``st`` is not trusted (None when it is)."""
    if not kind(st.st_mode):
        return f"not a {what}"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class StampStore:
    """The stamps of the shards of one dataset manifest, in ``root`` (one JSON file per manifest).

    ``log``: where a store that is ignored or cannot be written says so (once per reason)."""

    def __init__(self, root: Path | str, manifest: Path | str, *, log: Callable[[str], None] = print) -> None:
        self.root = Path(os.path.expandvars(os.path.expanduser(str(root))))
        real = os.path.realpath(manifest)
        self.path = self.root / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"
        self.manifest, self.log = real, log

    def _refused(self) -> str | None:
        """Why the store's folder is not to be trusted (None: trusted, or not there yet)."""
        try:
            reason = _trusted(os.stat(self.root, follow_symlinks=False), stat.S_ISDIR, "directory")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            return str(exc)
        return f"{self.root}: {reason}" if reason else None

    def _read(self) -> tuple[dict[str, Stamp], str | None]:
        """(the stamps kept, why none are taken: None when the store is trusted or empty)."""
        if (why := self._refused()) is not None:
            return {}, why
        try:
            for attempt in range(RENAMED_RETRIES + 1):   # another rank or job renaming its save into place
                try:
                    fh = open_regular(self.path, follow_symlinks=False, max_bytes=MAX_BYTES, what="stamp file")
                    break
                except ReplacedWhileOpening:
                    if attempt == RENAMED_RETRIES:
                        raise
            with fh:
                why = _trusted(os.fstat(fh.fileno()), stat.S_ISREG, "regular file")
                data = None if why else json.loads(fh.read(MAX_BYTES + 1))
        except (FileNotFoundError, NotADirectoryError):
            return {}, None
        except (OSError, ValueError) as exc:      # a link, a FIFO, too large, cut short, not JSON
            return {}, f"{self.path}: {exc}" if str(self.path) not in str(exc) else str(exc)
        if why is not None:
            return {}, f"{self.path}: {why}"
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("shards"), dict):
            return {}, f"{self.path}: not a stamp file of this chexflow"
        return {path: st for path, value in data["shards"].items()
                if isinstance(path, str) and (st := _stamp(value)) is not None}, None

    def load(self) -> dict[str, Stamp]:
        """The stamps kept (real shard path -> Stamp); empty when there are none or they are not
        to be trusted (said through ``log``). Malformed entries are left out."""
        stamps, why = self._read()
        if why is not None:
            self.log(f"verification stamps ignored, every shard is hashed: {why}")
        return stamps

    def save(self, stamps: dict[str, Stamp]) -> bool:
        """Merge ``stamps`` into the file (the newest stamp of each shard wins; another job's stamps
        of other shards are kept), atomically. A store that cannot be written, or whose folder is
        not to be trusted, is said through ``log`` and is not an error: the next start hashes
        again. Returns whether it was written."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if (why := self._refused()) is not None:
                raise PermissionError(why)
            kept = self._read()[0]
            kept.update(stamps)
            body = {"format": FORMAT, "manifest": self.manifest,
                    "shards": {p: list(astuple(s)) for p, s in sorted(kept.items())}}
            with atomic_path(self.path) as tmp:
                tmp.write_text(json.dumps(body, separators=(",", ":")), encoding="utf-8")
                os.chmod(tmp, 0o600)
        except OSError as exc:
            self.log(f"verification stamps not written ({exc}): the next start hashes these shards again")
            return False
        return True


def verified_dir() -> Path | None:
    """The folder of this user's verification stamps: ``$CHEXFLOW_VERIFIED_DIR``, else
    the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``, usually on the shared home file system of a
    cluster, so every node and every requeue sees it) ``/chexflow/verified``; ``off``: none kept."""
    chosen = os.environ.get("CHEXFLOW_VERIFIED_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "none") else Path(chosen)
    cache = os.environ.get("XDG_CACHE_HOME") or (os.path.join(os.environ["HOME"], ".cache") if os.environ.get("HOME")
                                                 else None)
    return Path(cache) / "chexflow" / "verified" if cache else None
