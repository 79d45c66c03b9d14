"""Training epochs over uneven shards: every rank the same number of full batches in every epoch,
every sample at most once per epoch and all but less than one global step of them used, and a
resume that continues the batch sequence exactly (plan_epoch, ShardStream, torch's DataLoader)."""
from __future__ import annotations

import itertools
import multiprocessing
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from chexflow.data import epoch_plan as EP
from chexflow.data import loader as LD
from chexflow.data import manifest as MF
from chexflow.data import shard_reader as SR
from chexflow.data import shards as S

NIH_LIKE = [2000] * 4 + [1343]          # one archive: ~9,343 images, 2,000 per shard, a partial last one


def _refs(counts: list[int]) -> list[MF.ShardRef]:
    return [MF.ShardRef(f"shard-{i:03d}.tar", c) for i, c in enumerate(counts)]


def _check_epoch(shards, *, world, batch, backward_passes, epoch, workers, cap=None) -> int:
    """Asserts the plan's invariants for one epoch; returns the samples it uses."""
    steps = EP.epoch_steps(shards, world=world, batch_size=batch, backward_passes=backward_passes, samples_per_epoch=cap)
    m = steps * backward_passes
    order = EP.epoch_order(shards, epoch=epoch, seed=5, shuffle=True)
    start = {}
    for s in order:                                  # position of each shard in the epoch's sequence
        start[s.path] = sum(x.count for x in order[:order.index(s)])
    used = []
    for rank in range(world):
        runs = EP.plan_epoch(shards, rank=rank, world=world, epoch=epoch, seed=5, batch_size=batch,
                            backward_passes=backward_passes, samples_per_epoch=cap, workers=workers)
        assert [r.index for r in runs] == list(range(workers))
        assert [r.samples // batch for r in runs] == [m // workers + (w < m % workers) for w in range(workers)]
        assert all(r.samples % batch == 0 and r.skip == 0 for r in runs)
        for r in runs:
            used += [(start[p] + a, start[p] + b) for p, a, b in r.pieces]
    used.sort()
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(used, used[1:])), "a sample twice in one epoch"
    n = sum(b - a for a, b in used)
    assert n == world * m * batch
    limit = EP.epoch_samples(shards, cap)
    assert used[-1][1] <= limit
    assert limit - n < world * batch * backward_passes
    return n


LAYOUTS = {
    "nih-like 12 archives": NIH_LIKE * 12,
    "3 archives, partial last shards": [20] * 3 + [7] + [20] * 2 + [13] + [20] + [1],
    "one shard": [50],
    "uneven": [13, 7, 20, 5, 9, 1, 31],
    "many tiny": [3] * 17 + [2],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_steps_every_epoch_and_rank_all_samples_used(layout):
    shards = _refs(LAYOUTS[layout])
    for world, batch, backward_passes in itertools.product(range(1, 9), (1, 3, 8, 32), (1, 2)):
        if sum(s.count for s in shards) < world * batch * backward_passes:
            with pytest.raises(MF.ManifestError, match=f"{sum(s.count for s in shards)} training samples"):
                EP.epoch_steps(shards, world=world, batch_size=batch, backward_passes=backward_passes)
            continue
        for epoch in range(5):
            _check_epoch(shards, world=world, batch=batch, backward_passes=backward_passes, epoch=epoch,
                         workers=1 + epoch % 3)


def test_samples_per_epoch_caps_the_epoch():
    shards = _refs([20] * 3 + [7])
    assert EP.epoch_steps(shards, world=2, batch_size=4, samples_per_epoch=30) == 3
    for epoch in range(4):
        assert _check_epoch(shards, world=2, batch=4, backward_passes=1, epoch=epoch, workers=2, cap=30) == 24
    with pytest.raises(MF.ManifestError, match=r"samples_per_epoch 7.*world 2 x batch 4"):
        EP.epoch_steps(shards, world=2, batch_size=4, samples_per_epoch=7)


@pytest.mark.parametrize("archive, share", [(NIH_LIKE, 0.997), ([2000] * 3 + [489], 0.999)])
def test_nih_like_layout_uses_all_but_a_global_step(archive, share):
    """12 archives, 8 ranks, batch 32: the old whole-shard deal used 81-95% (all images) or
    61-92% (a train split of ~6,500 per archive) depending on the seed."""
    shards = _refs(archive * 12)
    total = sum(s.count for s in shards)
    for epoch in range(3):
        used = _check_epoch(shards, world=8, batch=32, backward_passes=1, epoch=epoch, workers=4)
        assert total - used == total % 256 and used / total >= share


def test_resume_continues_the_turn_order():
    """Modelled DataLoader (one batch per worker in turn, exhausted workers dropped): after
    skip_batches=k the rotated runs give exactly the tail of the unskipped batch sequence."""
    shards = _refs([13, 7, 20, 5, 9])

    def sequence(workers, skip):
        runs = EP.plan_epoch(shards, rank=1, world=2, epoch=3, seed=5, batch_size=2, workers=workers,
                            skip_batches=skip)
        queues = [[(r.index, j) for j in range(r.skip // 2, r.samples // 2)] for r in runs]
        out = []
        while any(queues):
            for q in queues:
                if q:
                    out.append(q.pop(0))
        return out
    for workers in (1, 2, 3, 4, 5):
        full = sequence(workers, 0)
        assert len(full) == EP.epoch_steps(shards, world=2, batch_size=2)
        for k in range(len(full) + 1):
            assert sequence(workers, k) == full[k:]
    with pytest.raises(ValueError, match="skip_batches 14 outside the epoch's 13 batches"):
        EP.plan_epoch(shards, rank=0, world=2, epoch=0, seed=5, batch_size=2, skip_batches=14)


def test_shuffle_buffer_order_is_a_bounded_permutation():
    rng = np.random.default_rng(0)
    for n, size in ((0, 4), (1, 4), (5, 16), (100, 16), (1000, 1)):
        order = EP.buffer_order(n, size, rng)
        assert sorted(order.tolist()) == list(range(n))
        # the j-th emitted item has been read by then: lookahead bounded by the buffer
        assert all(i < j + max(size, 1) for j, i in enumerate(order.tolist()))


# ----------------------------------------------------------------------------- real shards


def _write_shards(root: Path, counts: list[int]) -> list[MF.ShardRef]:
    """Raw shards as the shard stage writes them; sample ``i``'s image is filled with ``i % 251``
    and its target is ``[i]``, so batches can be compared by content."""
    refs, i = [], 0
    for s, count in enumerate(counts):
        path = root / f"train-{s:05d}.tar"
        with wds.TarWriter(str(path), encoder=False, mtime=0) as sink:
            for _ in range(count):
                img = np.full((4, 5), i % 251, np.uint8)
                sink.write(S._encode(S.Sample(f"img{i:05d}.png", f"p{i // 3}", "train",
                                              np.array([float(i)], np.float32), img), "raw"))
                i += 1
        refs.append(MF.ShardRef(str(path), count))
    return refs


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> list[MF.ShardRef]:
    return _write_shards(tmp_path_factory.mktemp("uneven"), [13, 7, 20, 5, 9, 1])


def _batches(stream, workers, batch):
    return list(LD.make_loader(stream, batch_size=batch, workers=workers, pin_memory=False))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_real_loader_full_batches_once_per_epoch(uneven, workers):
    total, batch = sum(s.count for s in uneven), 3
    for world, backward_passes in ((1, 1), (2, 2), (3, 1)):
        m = EP.epoch_steps(uneven, world=world, batch_size=batch, backward_passes=backward_passes) * backward_passes
        stream = [LD.ShardStream(uneven, rank=r, world=world, seed=7, batch_size=batch, backward_passes=backward_passes,
                                shuffle_buffer=8) for r in range(world)]
        orders = []
        for epoch in range(4):
            keys = []
            for s in stream:
                s.set_epoch(epoch)
                got = _batches(s, workers, batch)
                assert len(got) == m and all(len(k) == batch for _, _, k in got)
                for images, targets, k in got:     # contents belong to the keys
                    ids = targets[:, 0].long()
                    assert torch.equal(images, (ids % 251).to(torch.uint8)[:, None, None].expand(-1, 4, 5))
                    assert [SR.SampleId(f"p{i // 3}", f"img{i:05d}.png") for i in ids.tolist()] == list(k)
                keys += [x for _, _, k in got for x in k]
            assert len(set(keys)) == len(keys) == world * m * batch > total - world * batch * backward_passes
            orders.append(keys)
        assert orders[0] != orders[1]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_real_loader_skip_gives_the_exact_tail(uneven, workers):
    batch = 2
    stream = LD.ShardStream(uneven, rank=1, world=2, seed=7, batch_size=batch, shuffle_buffer=6)
    for epoch in (0, 2):
        stream.set_epoch(epoch)
        full = _batches(stream, workers, batch)
        m = len(full)
        assert m == EP.epoch_steps(uneven, world=2, batch_size=batch)
        for k in sorted({1, max(workers, 1) - 1, max(workers, 1), max(workers, 1) + 1, 2 * max(workers, 1) + 1,
                         m - 1, m}):
            stream.set_epoch(epoch, skip_batches=k)
            tail = _batches(stream, workers, batch)
            assert len(tail) == m - k
            for (a, b, c), (x, y, z) in zip(tail, full[k:]):
                assert torch.equal(a, x) and torch.equal(b, y) and c == z


@pytest.mark.parametrize("workers", [1, 3])
def test_a_persistent_loader_serves_every_pass_as_a_fresh_loader_does(uneven, workers):
    """The trainer's loader forks its workers once: each pass (an epoch, a resume's tail, a pass left
    after two batches as a stop leaves it) gives exactly the batches a fresh loader gives for the
    same ``set_epoch``, from the same worker processes; ``close_loader`` stops them."""
    batch = 2
    fresh = LD.ShardStream(uneven, rank=1, world=2, seed=7, batch_size=batch, shuffle_buffer=6)
    stream = LD.ShardStream(uneven, rank=1, world=2, seed=7, batch_size=batch, shuffle_buffer=6)
    loader = LD.make_loader(stream, batch_size=batch, workers=workers, pin_memory=False, persistent=True)
    pids: set[int] | None = None
    try:
        for epoch, skip, take in ((0, 0, None), (1, 0, 2), (1, 3, None), (2, 0, None), (2, 0, None)):
            fresh.set_epoch(epoch, skip_batches=skip)
            want = _batches(fresh, workers, batch)
            stream.set_epoch(epoch, skip_batches=skip)
            got = list(itertools.islice(iter(loader), take))
            assert len(got) == (len(want) if take is None else take) > 0
            for (a, b, c), (x, y, z) in zip(got, want):
                assert torch.equal(a, x) and torch.equal(b, y) and c == z, (epoch, skip)
            now = {w.pid for w in loader._iterator._workers}
            assert len(now) == workers and (pids is None or now == pids), "workers started again"
            pids = now
    finally:
        LD.close_loader(loader)
    alive = {p.pid for p in multiprocessing.active_children()}
    assert pids and not pids & alive


def test_skipped_samples_are_not_decoded(tmp_path):
    """A sample whose payload is garbage breaks a full read, not a resume that skips past it."""
    refs = _write_shards(tmp_path, [6, 6])
    path = Path(refs[0].path)
    data = bytearray(path.read_bytes())
    at = data.index(b"\x93NUMPY")                   # the first sample's image payload
    data[at:at + 6] = b"garbag"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        list(LD.ShardStream(refs, rank=0, world=1, seed=0, batch_size=2, shuffle_buffer=1))
    kept = list(SR.iter_shard(str(path), keep=[2, 4]))
    assert [s["__key__"] for s in kept] == ["img00002", "img00004"]
    stream = LD.ShardStream(refs, rank=0, world=1, seed=0, batch_size=2, shuffle_buffer=1)
    stream.set_epoch(0, skip_batches=1)
    assert [k for _, _, k in stream][0] == SR.SampleId("p0", "img00002.png")
    with pytest.raises(SR.ShardReadError, match=r"train-00000\.tar: 6 samples, but sample 9 was asked for"):
        list(SR.iter_shard(str(path), keep=[9]))


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 3)])
def test_evaluation_stream_every_sample_once(uneven, world, workers):
    total = sum(s.count for s in uneven)
    keys, sizes = [], defaultdict(list)
    for rank in range(world):
        stream = LD.ShardStream(uneven, rank=rank, world=world, seed=0, batch_size=4, shuffle=False)
        for _, _, k in _batches(stream, workers, 4):
            keys += k
            sizes[rank].append(len(k))
    assert sorted(keys) == sorted(SR.SampleId(f"p{i // 3}", f"img{i:05d}.png") for i in range(total))
    for rank, s in sizes.items():           # one partial batch per rank at most
        assert sum(x < 4 for x in s) <= 1 and abs(sum(s) - total / world) < 1
    if world == 1 and workers == 0:
        assert keys == [SR.SampleId(f"p{i // 3}", f"img{i:05d}.png") for i in range(total)]
