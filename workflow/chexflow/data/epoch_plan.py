"""The epoch's data order: which samples each rank and each loader worker reads, in which order
(:func:`plan_epoch`), every sample at most once per epoch and every batch full; a worker's shuffle
buffer (:func:`buffer_order`). Pure computation: nothing here reads a file.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from chexflow.data.manifest import ManifestError, ShardRef


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


def buffer_order(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
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
