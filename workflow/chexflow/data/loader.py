"""The stream of one rank's samples for one epoch, and the DataLoader that batches it (the plan it
follows: :mod:`chexflow.data.epoch_plan`)."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from chexflow.data import workers as _workers
from chexflow.data.epoch_plan import WorkerRun, buffer_order, plan_epoch
from chexflow.data.manifest import ShardRef, checked_stamps, remember_checked, verify_shard, verify_shards
from chexflow.data.shard_reader import decode, iter_shard
from chexflow.data.stamps import Stamp


def _read_run(run: WorkerRun, order: np.ndarray, checked: dict[str, Stamp | None]) -> Iterator[dict]:
    """The raw samples of ``run`` in ``order`` (indices into the run), from ``run.skip`` on. Samples
    before that are passed over unread; at most the lookahead of ``order`` and the kept samples of one
    shard are held in memory. Each shard is read as ``checked`` says it was when checked
    (``shard_reader.iter_shard``): one changed since is refused before any of its samples is used."""
    wanted = order[run.skip:]
    need = np.zeros(run.samples, bool)
    need[wanted] = True

    def read():
        start = 0
        for path, first, stop in run.pieces:
            idx = np.flatnonzero(need[start:start + stop - first])
            if len(idx):
                yield from zip((idx + start).tolist(), iter_shard(path, keep=(idx + first).tolist(),
                                                                           checked=checked.get(path)))
            start += stop - first

    pending, source = {}, read()
    for i in wanted.tolist():
        while i not in pending:
            j, sample = next(source)
            pending[j] = sample
        yield pending.pop(i)


class ShardStream(IterableDataset):
    """Samples ``(uint8 image HxW, target, SampleId)`` of one rank for one epoch, as :func:`plan_epoch`
    plans them (``shuffle``: training); ``set_epoch(e, skip_batches=k)`` starts at the rank's ``k``-th
    batch (resume). Its shards are checked here, before the loader's workers start
    (``chexflow.data.manifest``)."""

    def __init__(self, shards: list[ShardRef], *, rank: int, world: int, seed: int, batch_size: int,
                 backward_passes: int = 1, samples_per_epoch: int | None = None, epoch: int = 0,
                 shuffle: bool = True, shuffle_buffer: int = 1000):
        self.shards, self.rank, self.world, self.seed = shards, rank, world, seed
        self.batch_size, self.backward_passes, self.samples_per_epoch = batch_size, backward_passes, samples_per_epoch
        # (epoch, skip_batches) in shared memory: a persistent loader's workers, started once, read the
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

    def __getstate__(self) -> dict:
        # what a worker receives: the stream, and which of its shards this process has checked (a worker
        # does not share this process's memory, so it would otherwise hash them all again)
        return {**self.__dict__, "_checked": checked_stamps([s.path for s in self.shards])}

    def __setstate__(self, state: dict) -> None:
        remember_checked(state.pop("_checked"))
        self.__dict__.update(state)

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
        checked = {s.path: verify_shard(s) for s in self.shards if s.path in reads}
        order = np.arange(run.samples)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, run.index])
            order = buffer_order(run.samples, self.shuffle_buffer, rng)
        return (decode(s) for s in _read_run(run, order, checked))


def _collate(batch):
    images = torch.stack([b[0] for b in batch])
    targets = torch.stack([b[1] for b in batch])
    return images, targets, [b[2] for b in batch]


def make_loader(stream: ShardStream, *, batch_size: int, workers: int, pin_memory: bool,
                persistent: bool = False) -> DataLoader:
    """Batches in a fixed order: torch's DataLoader asks its workers for batches in turn (skipping
    exhausted ones) and returns them in the order asked, which :func:`plan_epoch` relies on. The worker
    processes: chexflow.data.workers. ``persistent``: the workers are started once and serve every pass
    (``iter(loader)`` after ``stream.set_epoch``), instead of being started and stopped around each one
    (about 0.4-0.7 s per epoch with 14 workers beside a GPU); :func:`close_loader` stops them."""
    if batch_size != stream.batch_size:
        raise ValueError(f"loader batch {batch_size} differs from the stream's planned batch {stream.batch_size}")
    return DataLoader(stream, batch_size=batch_size, num_workers=workers, collate_fn=_collate,
                      pin_memory=pin_memory, drop_last=False, persistent_workers=persistent and workers > 0,
                      prefetch_factor=4 if workers > 0 else None, **_workers.loader_processes(workers))


def close_loader(loader: DataLoader) -> None:
    """Stop a persistent loader's workers now (what torch does when the loader is collected, which an
    exception's traceback can put off for as long as it is kept)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None
