"""Reading chexflow's shards: an uncompressed tar reader that passes over unwanted samples unread,
and the decoding of one sample into ``(uint8 image, target, SampleId)``."""
from __future__ import annotations

import io
import json
import os
from typing import Collection, Iterator, NamedTuple

import numpy as np
import torch
import webdataset as wds

from chexflow.data.manifest import ShardRef, ShardVerifyError, verify_shards
from chexflow.data.stamps import Stamp
from chexflow.fsutil import open_regular


class SampleId(NamedTuple):
    """Who a sample is: its patient (the unit of splits and of bootstrap resampling) and its image."""
    patient: str
    image: str



_NPY_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int, int]] = {}


def _load_npy(buf: bytes) -> np.ndarray:
    """``np.load`` of one ``.npy`` payload, with the header parse cached.

    ``np.load`` parses every header with ``ast.literal_eval`` (a ``compile`` per sample, the
    largest single cost of reading raw shards); all images of a dataset share one header.
    """
    if buf[:6] == b"\x93NUMPY" and buf[6:7] in (b"\x01", b"\x02"):   # 3.0 (utf-8 header): np.load
        major = buf[6]
        start = 10 + int.from_bytes(buf[8:10], "little") if major == 1 else 12 + int.from_bytes(buf[8:12], "little")
        header = buf[:start]
        parsed = _NPY_HEADERS.get(header)
        if parsed is None:
            fp = io.BytesIO(header)
            version = np.lib.format.read_magic(fp)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(fp)
            if dtype.hasobject or fp.tell() != start:
                return np.load(io.BytesIO(buf), allow_pickle=False)
            if len(_NPY_HEADERS) > 256:
                _NPY_HEADERS.clear()
            parsed = _NPY_HEADERS[header] = (shape, fortran, dtype, start, int(np.prod(shape, dtype=np.int64)))
        shape, fortran, dtype, start, count = parsed
        if len(buf) - start < count * dtype.itemsize:
            raise ValueError(f"truncated .npy payload: {len(buf) - start} bytes for shape {shape} {dtype}")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
        return arr.reshape(shape, order="F" if fortran else "C").copy()
    return np.load(io.BytesIO(buf), allow_pickle=False)


def decode(sample: dict) -> tuple[torch.Tensor, torch.Tensor, SampleId]:
    if "img.npy" in sample:
        img = _load_npy(sample["img.npy"])
    else:
        from PIL import Image
        img = np.asarray(Image.open(io.BytesIO(sample["img.png"])).convert("L"))
    target = _load_npy(sample["target.npy"])
    meta = json.loads(sample["meta.json"])
    return (torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.asarray(target)),
            SampleId(meta["patient"], meta["image"]))


class ShardReadError(ValueError):
    """A shard is not a readable tar; the message names the file and the offset."""


class ShardChangedError(ShardVerifyError):
    """A shard read for a step is not the file its check against the manifest's sha256 described."""


_ZERO_BLOCK = bytes(512)


def _tar_number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:                       # GNU base-256
        return int.from_bytes(field[1:], "big")
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _pax_records(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8")
        pos += length
    return out


def _tar_members(fh, path: str) -> Iterator[tuple[str, int]]:
    """``(name, size)`` of the regular files of an uncompressed tar (ustar, pax, GNU long names),
    read with one ``read`` per header: several times faster than ``tarfile``'s streaming mode for
    shards of many small members. While the caller holds an item, ``fh`` stands at the start of
    that member's bytes, which it may read; the next item seeks past them either way, so members
    the caller does not want cost no I/O. Header checksums are verified."""
    end = os.fstat(fh.fileno()).st_size
    pending: dict[str, str] = {}
    offset = 0
    while True:
        fh.seek(offset)
        hdr = fh.read(512)
        if not hdr or hdr == _ZERO_BLOCK:
            return
        if len(hdr) < 512:
            raise ShardReadError(f"{path}: truncated tar header at byte {offset}")
        try:
            stored = _tar_number(hdr[148:156])
            size = _tar_number(hdr[124:136])
        except ValueError:
            raise ShardReadError(f"{path}: not a tar header at byte {offset}") from None
        if stored != sum(hdr) - sum(hdr[148:156]) + 8 * 32:
            raise ShardReadError(f"{path}: tar header checksum mismatch at byte {offset}")
        kind = hdr[156:157]
        name = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if hdr[257:263] == b"ustar\0" and hdr[345:346] != b"\0":   # POSIX prefix (GNU keeps atime there)
            name = hdr[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape") + "/" + name
        if "size" in pending:
            size = int(pending["size"])
        padded = size + (-size) % 512
        if offset + 512 + padded > end:
            raise ShardReadError(f"{path}: truncated tar member {name!r} at byte {offset}")
        offset += 512 + padded
        if kind == b"x":                                    # pax header of the next member
            pending = _pax_records(fh.read(size))
            continue
        if kind == b"g":
            continue
        if kind == b"L":                                    # GNU long name of the next member
            pending = {**pending, "path": fh.read(size).rstrip(b"\0").decode("utf-8", "surrogateescape")}
            continue
        name = pending.get("path", name)
        pending = {}
        if kind in (b"0", b"\0", b"7"):
            yield name, size


def _sample_key(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a tar member as ``webdataset`` groups them (the file name up to its
    first dot), or None for members that belong to no sample."""
    base = name.rsplit("/", 1)[-1]
    stem, dot, ext = base.partition(".")
    if base.startswith("__") or not dot:
        return None
    return name[:len(name) - len(base)] + stem, ext


def iter_shard(path: str, keep: Collection[int] | None = None, checked: Stamp | None = None) -> Iterator[dict]:
    """The samples of one shard: dicts ``{"__key__", "__url__", "<ext>": bytes, ...}`` grouped by
    key, as ``webdataset``'s ``group_by_keys`` does. ``keep``: only the samples with these indices
    (0-based, stored order); the others are passed over unread, and reading stops after the last
    kept one. Compressed shards (not written by chexflow) are read through ``webdataset``.

    ``checked``: what the shard's check against its manifest's sha256 found
    (``chexflow.data.manifest.verify_shard``). The shard is then read through one descriptor that
    must describe that same file (inode, size, mtime, ctime) when it is opened and after the kept
    samples are read, and the samples are released only then: the bytes used are the bytes the check
    hashed (``chexflow.data.stamps``: no write leaves ctime as it was). ``ShardChangedError`` names a
    shard changed since, before any of its samples is used."""
    keep = None if keep is None else frozenset(keep)
    last = max(keep, default=-1) if keep is not None else None
    with open_regular(path) as fh:
        if checked is None:
            yield from _samples(fh, path, keep, last)
            return
        _unchanged_since(fh, path, checked)
        samples = list(_samples(fh, path, keep, last))
        _unchanged_since(fh, path, checked)
    yield from samples


def _unchanged_since(fh, path: str, checked: Stamp) -> None:
    st = os.fstat(fh.fileno())
    if not checked.describes(st, checked.sha256):
        raise ShardChangedError(
            f"{path}: changed after it was checked against its manifest's sha256 (inode {st.st_ino}, "
            f"{st.st_size:,} bytes, ctime {st.st_ctime_ns} now; inode {checked.ino}, {checked.size:,} bytes, ctime "
            f"{checked.ctime_ns} when checked); none of its samples was used. Restore or rebuild the shard")


def _samples(fh, path: str, keep: frozenset | None, last: int | None) -> Iterator[dict]:
    magic = fh.read(6)
    fh.seek(0)
    if magic[:2] == b"\x1f\x8b" or magic[:3] == b"BZh" or magic == b"\xfd7zXZ\x00":
        files = ({**f, "__url__": path} for f in wds.tariterators.tar_file_iterator(fh))
        index = -1
        for index, sample in enumerate(wds.tariterators.group_by_keys(files)):
            if last is not None and index > last:
                return
            if keep is None or index in keep:
                yield sample
    else:
        current, key_now, index = None, None, -1
        for name, size in _tar_members(fh, path):
            parsed = _sample_key(name)
            if parsed is None:
                continue
            key, ext = parsed
            if key != key_now:
                if current is not None:
                    yield current
                current, key_now, index = None, key, index + 1
                if last is not None and index > last:
                    return
                if keep is None or index in keep:
                    current = {"__key__": key, "__url__": path}
            if current is None:
                continue
            if ext in current:
                raise ShardReadError(f"{path}: duplicate file {name!r} in sample {key!r}")
            current[ext] = fh.read(size)
        if current is not None:
            yield current
    if last is not None and index < last:
        raise ShardReadError(f"{path}: {index + 1} samples, but sample {last} was asked for "
                             "(the manifest's count for this shard is wrong)")


def shard_patients(shards: list[ShardRef]) -> set[str]:
    """The patients of ``shards``, each shard checked against its manifest's sha256 first, from the
    samples' ``meta.json`` alone: in chexflow's (uncompressed) shards the images are passed over unread."""
    verify_shards(shards)
    found: set[str] = set()
    for ref in shards:
        for meta in _meta_members(ref.path):
            try:
                found.add(str(json.loads(meta)["patient"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ShardReadError(f"{ref.path}: a sample's meta.json names no patient ({exc!r})") from None
    return found


def _meta_members(path: str) -> Iterator[bytes]:
    with open_regular(path) as fh:
        if not fh.read(6).startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")):      # as iter_shard tells them
            fh.seek(0)
            for name, size in _tar_members(fh, path):
                if (_sample_key(name) or ("", ""))[1] == "meta.json":
                    yield fh.read(size)
            return
    yield from (sample["meta.json"] for sample in iter_shard(path) if "meta.json" in sample)
