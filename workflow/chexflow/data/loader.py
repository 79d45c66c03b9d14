"""Streaming shards per rank and per worker, without overlap, plus GPU-side augmentation.

Each epoch the shard list is shuffled with ``(seed, epoch)`` (the same on every rank) and read as
one sequence of samples; rank ``r`` takes the ``r``-th of ``world`` equal contiguous slices of it
(a whole number of optimizer steps, the same in every epoch; the remainder, fewer than one global
step, waits for another epoch) and its loader workers contiguous runs of whole batches of that
slice, so every sample is read at most once per epoch and every batch is full. Inside a worker a
shuffle buffer seeded with ``(seed, epoch, rank, run)`` mixes samples. A resume skips the batches
already consumed without reading them. Workers only unpack raw uint8 arrays (or decode PNG);
cropping, flipping and normalising run batched on the training device.
"""
from __future__ import annotations

import bisect
import hashlib
import io
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Iterator, NamedTuple

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from chexflow.data import workers as _workers
from chexflow.data.config import AugmentConfig
from chexflow.data.manifest import (Alone, Checked, ManifestError, ShardRef, ShardVerifyError, World, read_manifest,
                                    split_shards, verify_on_world, verify_shard, verify_shards)
from chexflow.data.stamps import Stamp, StampStore
from chexflow.fsutil import atomic_path, open_regular

__all__ = ["Alone", "Checked", "ManifestError", "ShardRef", "ShardVerifyError", "StampStore", "World", "read_manifest",
           "split_shards", "verify_on_world"]     # re-exported: read where shards are


class SampleId(NamedTuple):
    """Who a sample is: its patient (the unit of splits and of bootstrap resampling) and its image."""
    patient: str
    image: str


def _staged_path(s: ShardRef, dest: Path) -> str:
    src = Path(s.path)
    return str(dest / f"{hashlib.sha1(str(src.parent).encode()).hexdigest()[:10]}-{src.name}")


def stage_shards(shards: list[ShardRef], dest: Path, *, copy: bool = True, start: str = "",
                 log=print) -> list[ShardRef]:
    """Copy shards to node-local disk (the PRACE guide's advice), each checked against the
    manifest's sha256 as it is copied (one read of the shared file system); returns the copies.

    A copy already there is kept when its stamp in ``dest`` vouches for it (nothing read) or, failing
    that, when it hashes right (a local read). The copies' stamps are written in ``dest``: they live
    and die with the copies, and carry ``start`` (this start's token), so the node's other ranks of
    this start use the fresh copies without reading them (:func:`verify_staged`).
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
    return Stamp.of(os.stat(staged.path, follow_symlinks=False), src.sha256, checked_ns=checked_ns, start=start)


def verify_staged(staged: list[ShardRef], dest: Path, *, start: str, log=print) -> None:
    """Check the node-local copies a node's copying rank made (:func:`stage_shards`): by the stamps it
    wrote in ``dest`` for this ``start``, nothing read; a copy without a stamp that vouches for it is
    hashed."""
    dest = Path(os.path.expandvars(str(dest)))
    known = StampStore(dest, staged[0].manifest or dest, log=log).load() if staged else {}
    for ref in staged:
        verify_shard(ref, stamp=known.get(ref.path), start=start)


def first_readers(shards: list[ShardRef], *, world: int, seed: int, batch_size: int, backward_passes: int = 1,
                  samples_per_epoch: int | None = None, shuffle: bool = True) -> list[int]:
    """For each shard, the rank that checks it (``chexflow.data.manifest.verify_on_world``): the one
    whose slice of the first epoch (:func:`plan_epoch`, epoch 0) holds its first sample, so a rank
    hashes only shards it reads in that epoch. Shards no rank reads in the first epoch (the remainder
    under one global step, samples past ``samples_per_epoch``, empty shards) go to the ranks in turn."""
    order = epoch_order(list(range(len(shards))), epoch=0, seed=seed, shuffle=shuffle)
    if shuffle:
        per_rank = epoch_steps(shards, world=world, batch_size=batch_size, backward_passes=backward_passes,
                               samples_per_epoch=samples_per_epoch) * backward_passes * batch_size
        bounds = [r * per_rank for r in range(world + 1)]
    else:
        bounds = [_split(epoch_samples(shards), world, r)[0] for r in range(world)] + [epoch_samples(shards)]
    owners, unread, first = [0] * len(shards), [], 0
    for i in order:
        rank = bisect.bisect_right(bounds, first) - 1
        if shards[i].count and 0 <= rank < world and first < bounds[-1]:
            owners[i] = rank
        else:
            unread.append(i)
        first += shards[i].count
    for k, i in enumerate(unread):
        owners[i] = k % world
    return owners


def epoch_order(shards: list, *, epoch: int, seed: int, shuffle: bool) -> list:
    """The shards of one epoch in reading order: shuffled by ``(seed, epoch)``, the same on every rank."""
    order = np.arange(len(shards))
    if shuffle:
        np.random.default_rng([seed, epoch]).shuffle(order)
    return [shards[i] for i in order]


def epoch_samples(shards: list[ShardRef], samples_per_epoch: int | None = None) -> int:
    total = sum(s.count for s in shards)
    return total if samples_per_epoch is None else min(total, samples_per_epoch)


def epoch_steps(shards: list[ShardRef], *, world: int, batch_size: int, backward_passes: int = 1,
                samples_per_epoch: int | None = None) -> int:
    """Optimizer steps per epoch, the same on every rank and in every epoch: each step takes
    ``world x batch_size x backward_passes`` samples of the epoch's sequence, the remainder
    (fewer than one step's worth) is left out of that epoch."""
    n = epoch_samples(shards, samples_per_epoch)
    per_step = world * batch_size * backward_passes
    steps = n // per_step
    if steps == 0:
        capped = "" if samples_per_epoch is None else f" (samples_per_epoch {samples_per_epoch})"
        raise ManifestError(f"too little data for one step: {n} training samples in {len(shards)} shards{capped}, "
                            f"one step takes {per_step} (world {world} x batch {batch_size} x backward passes "
                            f"{backward_passes}); use fewer ranks or a smaller batch")
    return steps


@dataclass(frozen=True)
class WorkerRun:
    """What one loader worker reads in one epoch: samples ``pieces`` (``(path, first, stop)`` of
    shards, in order, the concatenation being the worker's run) and how many of its output samples
    (whole batches, already consumed before a resume) it leaves out."""
    index: int                                  # which run of the rank's epoch (seeds its shuffle)
    pieces: tuple[tuple[str, int, int], ...]
    skip: int = 0

    @property
    def samples(self) -> int:
        return sum(stop - first for _, first, stop in self.pieces)


def _pieces(order: list[ShardRef], lo: int, hi: int) -> tuple[tuple[str, int, int], ...]:
    """Samples ``[lo, hi)`` of the concatenation of ``order`` as ``(path, first, stop)`` per shard."""
    out, start = [], 0
    for s in order:
        a, b = max(lo, start), min(hi, start + s.count)
        if a < b:
            out.append((s.path, a - start, b - start))
        start += s.count
        if start >= hi:
            break
    return tuple(out)


def _split(n: int, parts: int, part: int) -> tuple[int, int]:
    """``[start, stop)`` of ``part`` when ``n`` items are cut into ``parts`` contiguous runs whose
    lengths differ by at most one, the longer ones first."""
    q, r = divmod(n, parts)
    start = part * q + min(part, r)
    return start, start + q + (part < r)


def plan_epoch(shards: list[ShardRef], *, rank: int, world: int, epoch: int, seed: int, batch_size: int,
               backward_passes: int = 1, samples_per_epoch: int | None = None, shuffle: bool = True,
               workers: int = 1, skip_batches: int = 0) -> list[WorkerRun]:
    """The reads of rank ``rank``'s ``workers`` loader workers (index = worker id) in one epoch.

    Training (``shuffle``): the epoch's sample sequence (:func:`epoch_order`, capped at
    ``samples_per_epoch``) gives every rank a contiguous slice of ``M = epoch_steps x
    backward_passes`` full batches; the slice's batches are cut into contiguous runs, one per
    worker, the longer runs first. The DataLoader takes one batch from each worker in turn, so the
    rank's ``k``-th batch is batch ``k // workers`` of run ``k % workers``. After ``skip_batches``
    consumed batches, worker ``w`` reads run ``(w + skip_batches) % workers`` less its batches
    among those consumed: the turn order then continues exactly where it stopped.

    Evaluation (``not shuffle``): stored order, every sample once, ranks' slices differing by at
    most one sample, each worker a run of whole batches (only the slice's last may be partial).
    """
    workers = max(workers, 1)
    order = epoch_order(shards, epoch=epoch, seed=seed, shuffle=shuffle)
    if not shuffle:
        if skip_batches:
            raise ValueError("skip_batches is for training streams (shuffle=True)")
        lo, hi = _split(epoch_samples(shards), world, rank)
        batches = -(-(hi - lo) // batch_size)
        runs = []
        for w in range(workers):
            a, b = _split(batches, workers, w)
            runs.append(WorkerRun(w, _pieces(order, lo + a * batch_size, min(lo + b * batch_size, hi))))
        return runs
    m = epoch_steps(shards, world=world, batch_size=batch_size, backward_passes=backward_passes,
                    samples_per_epoch=samples_per_epoch) * backward_passes
    if not 0 <= skip_batches <= m:
        raise ValueError(f"skip_batches {skip_batches} outside the epoch's {m} batches")
    base = rank * m * batch_size
    runs = []
    for w in range(workers):
        run = (w + skip_batches) % workers
        a, b = _split(m, workers, run)
        consumed = skip_batches // workers + (run < skip_batches % workers)
        runs.append(WorkerRun(run, _pieces(order, base + a * batch_size, base + b * batch_size),
                              skip=consumed * batch_size))
    return runs


def _buffer_order(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """The order in which a shuffle buffer of ``size`` emits ``n`` items read in order 0..n-1:
    once full, each new item takes the place of a random one, which is emitted; the rest are
    emitted shuffled at the end. Computed on indices, so a resume can skip items unread."""
    size = min(size, n)
    if size <= 1:
        return np.arange(n)
    out, buf = np.empty(n, np.int64), np.arange(size)
    for j, i in enumerate(rng.integers(size, size=n - size)):
        out[j], buf[i] = buf[i], size + j
    rng.shuffle(buf)
    out[n - size:] = buf
    return out


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


def _decode(sample: dict) -> tuple[torch.Tensor, torch.Tensor, SampleId]:
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


def iter_shard(path: str, keep: Collection[int] | None = None) -> Iterator[dict]:
    """The samples of one shard: dicts ``{"__key__", "__url__", "<ext>": bytes, ...}`` grouped by
    key, as ``webdataset``'s ``group_by_keys`` does. ``keep``: only the samples with these indices
    (0-based, stored order); the others are passed over unread, and reading stops after the last
    kept one. Compressed shards (not written by chexflow) are read through ``webdataset``."""
    keep = None if keep is None else frozenset(keep)
    last = max(keep, default=-1) if keep is not None else None
    with open_regular(path) as fh:
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


def _read_run(run: WorkerRun, order: np.ndarray) -> Iterator[dict]:
    """The raw samples of ``run`` in ``order`` (indices into the run), from ``run.skip`` on. Samples
    before that are passed over unread; at most the lookahead of ``order`` is held in memory."""
    wanted = order[run.skip:]
    need = np.zeros(run.samples, bool)
    need[wanted] = True

    def read():
        start = 0
        for path, first, stop in run.pieces:
            idx = np.flatnonzero(need[start:start + stop - first])
            if len(idx):
                yield from zip((idx + start).tolist(), iter_shard(path, keep=(idx + first).tolist()))
            start += stop - first

    pending, source = {}, read()
    for i in wanted.tolist():
        while i not in pending:
            j, sample = next(source)
            pending[j] = sample
        yield pending.pop(i)


class ShardStream(IterableDataset):
    """Samples ``(uint8 image HxW, target, SampleId)`` of one rank for one epoch.

    Training (``shuffle=True``): this rank's :func:`plan_epoch` slice, ``epoch_steps x
    backward_passes`` full batches in every epoch, each loader worker mixing its run in a shuffle
    buffer seeded with ``(seed, epoch, rank, run)``; ``set_epoch(e, skip_batches=k)`` starts at the
    rank's ``k``-th batch (resume) without reading the samples of the first ``k``.
    Evaluation (``shuffle=False``): stored order, every sample of the split once across ranks.
    Every shard is checked against its manifest's sha256 here, before the loader's workers fork, and
    a worker checks again only a shard changed since (``chexflow.data.manifest``).
    """

    def __init__(self, shards: list[ShardRef], *, rank: int, world: int, seed: int, batch_size: int,
                 backward_passes: int = 1, samples_per_epoch: int | None = None, epoch: int = 0,
                 shuffle: bool = True, shuffle_buffer: int = 1000):
        self.shards, self.rank, self.world, self.seed = shards, rank, world, seed
        self.batch_size, self.backward_passes, self.samples_per_epoch = batch_size, backward_passes, samples_per_epoch
        # (epoch, skip_batches) in shared memory: a persistent loader's workers, forked once, read the
        # epoch the trainer sets before each pass (they build their iterator when the pass starts)
        self._at = torch.tensor([epoch, 0], dtype=torch.int64).share_memory_()
        self.shuffle, self.shuffle_buffer = shuffle, shuffle_buffer
        verify_shards(shards)

    @property
    def epoch(self) -> int:
        return int(self._at[0])

    @property
    def skip_batches(self) -> int:
        return int(self._at[1])

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self._at[0], self._at[1] = epoch, skip_batches

    def plan(self, workers: int = 1) -> list[WorkerRun]:
        return plan_epoch(self.shards, rank=self.rank, world=self.world, epoch=self.epoch, seed=self.seed,
                          batch_size=self.batch_size, backward_passes=self.backward_passes,
                          samples_per_epoch=self.samples_per_epoch, shuffle=self.shuffle, workers=workers,
                          skip_batches=self.skip_batches)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        run = self.plan(workers)[worker]
        reads = {path for path, _, _ in run.pieces}
        verify_shards([s for s in self.shards if s.path in reads])
        order = np.arange(run.samples)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, run.index])
            order = _buffer_order(run.samples, self.shuffle_buffer, rng)
        return (_decode(s) for s in _read_run(run, order))


def _collate(batch):
    images = torch.stack([b[0] for b in batch])
    targets = torch.stack([b[1] for b in batch])
    return images, targets, [b[2] for b in batch]


def make_loader(stream: ShardStream, *, batch_size: int, workers: int, pin_memory: bool,
                persistent: bool = False) -> DataLoader:
    """Batches in a fixed order: torch's DataLoader asks its workers for batches in turn (skipping
    exhausted ones) and returns them in the order asked, which :func:`plan_epoch` relies on.
    The worker processes leave SIGTERM/SIGUSR1/SIGINT to this process (chexflow.data.workers).
    ``persistent``: the workers are forked once and serve every pass (``iter(loader)`` after
    ``stream.set_epoch``), instead of being started and stopped around each one (about 0.4-0.7 s
    per epoch with 14 workers beside a GPU); :func:`close_loader` stops them."""
    if batch_size != stream.batch_size:
        raise ValueError(f"loader batch {batch_size} differs from the stream's planned batch {stream.batch_size}")
    shielded = dict(multiprocessing_context=_workers.ShieldedForkContext(), worker_init_fn=_workers.shield_worker)
    return DataLoader(stream, batch_size=batch_size, num_workers=workers, collate_fn=_collate,
                      pin_memory=pin_memory, drop_last=False, persistent_workers=persistent and workers > 0,
                      prefetch_factor=4 if workers > 0 else None, **(shielded if workers > 0 else {}))


def close_loader(loader: DataLoader) -> None:
    """Stop a persistent loader's workers now (what torch does when the loader is collected, which an
    exception's traceback can put off for as long as it is kept)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None


# --------------------------------------------------------------------------- GPU-side augmentation

# The network's input normalisation, (pixel / 255 - MEAN) / STD: here once, read by gpu_augment and by
# the exports' metadata (chexflow.predict), which must tell a serving stack the same numbers.
MEAN, STD = 0.5, 0.25


def gpu_augment(images: torch.Tensor, *, out_size: int, train: bool, cfg: AugmentConfig,
                generator: torch.Generator | None, mean: float = MEAN, std: float = STD) -> torch.Tensor:
    """uint8 [B,H,W] on the device -> normalised float [B,1,S,S].

    Training: a random resized crop (area in [scale_min, 1], aspect 3/4..4/3), optional flip and
    rotation, all per sample in one batched ``affine_grid``/``grid_sample``. Evaluation: a resize
    to ``out_size`` (shards are stored square at the evaluation resolution's scale).
    """
    x = images.unsqueeze(1).float().div_(255.0)
    b = x.shape[0]
    if not train:
        if x.shape[-1] != out_size:
            x = torch.nn.functional.interpolate(x, size=(out_size, out_size), mode="bilinear",
                                                antialias=True, align_corners=False)
        return (x - mean) / std
    dev = x.device
    g = generator

    def rand(n):
        return torch.rand(n, generator=g, device=g.device if g is not None else "cpu").to(dev)

    area = cfg.scale_min + (1.0 - cfg.scale_min) * rand(b)
    log_ratio = math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * rand(b)
    ratio = torch.exp(log_ratio)
    sw = torch.sqrt(area * ratio).clamp(max=1.0)
    sh = torch.sqrt(area / ratio).clamp(max=1.0)
    tx = (1 - sw) * (2 * rand(b) - 1)
    ty = (1 - sh) * (2 * rand(b) - 1)
    flip = torch.where(rand(b) < 0.5, -1.0, 1.0) if cfg.flip else torch.ones(b, device=dev)
    angle = (2 * rand(b) - 1) * math.radians(cfg.rotate_deg)
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([
        torch.stack([sw * cos * flip, -sh * sin, tx], dim=1),
        torch.stack([sw * sin * flip, sh * cos, ty], dim=1),
    ], dim=1)
    grid = torch.nn.functional.affine_grid(theta, [b, 1, out_size, out_size], align_corners=False)
    x = torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return (x - mean) / std
