"""The bytes a step uses are the bytes the manifest's sha256 covers: a shard changed in place during an
epoch (same size, same inode, mtime restored), after the epoch's check passed, is refused before any
of its samples is used, naming it (before, the rest of that epoch used it and only the next epoch's
check refused it). Real demo shards."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from chexflow.data import loader as LD
from chexflow.data import manifest as M
from chexflow.data import shard_reader as SR


@pytest.fixture(autouse=True)
def _fresh_checks():
    M.forget_verified()
    yield
    M.forget_verified()


def _change_in_place(path: Path) -> None:
    """256 bytes of the second sample's image changed through the same inode, size and mtime kept."""
    before = os.stat(path)
    data = path.read_bytes()
    at = data.index(b"\x93NUMPY", data.index(b"\x93NUMPY") + 1) + 200
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(255 - b for b in data[at:at + 256]), at)
    finally:
        os.close(fd)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert path.read_bytes() != data


def test_a_shard_changed_during_an_epoch_is_refused_before_its_samples_are_used(demo_manifest, tmp_path):
    shutil.copytree(demo_manifest.parent, tmp_path / "ds", ignore=shutil.ignore_patterns("*.png"))
    shards = M.split_shards(tmp_path / "ds/manifest.json", "train")
    assert len(shards) >= 2
    stream = LD.ShardStream(shards, rank=0, world=1, seed=0, batch_size=8, shuffle=False)
    first = [sid.image for _, _, sid in map(SR.decode, SR.iter_shard(shards[0].path))]
    samples = iter(stream)
    used = [next(samples)[2].image for _ in range(len(first))]          # the epoch is under way
    assert used == first
    _change_in_place(Path(shards[1].path))
    with pytest.raises(SR.ShardChangedError, match=rf"^{re.escape(shards[1].path)}: changed after it was checked .* none "):
        used += [sid.image for _, _, sid in samples]
    assert used == first                                                # not one sample of the changed shard
    # the reader without the digest hands the changed bytes on (what the epoch used before) ...
    assert len(list(SR.iter_shard(shards[1].path))) == shards[1].count
    # ... and the next epoch's check refuses the shard before any worker starts
    with pytest.raises(M.ShardVerifyError, match=re.escape(shards[1].path)):
        M.verify_shards(shards)


def test_the_reader_releases_nothing_of_a_shard_that_is_not_the_file_checked(demo_manifest, tmp_path):
    shutil.copytree(demo_manifest.parent, tmp_path / "ds", ignore=shutil.ignore_patterns("*.png"))
    ref = M.split_shards(tmp_path / "ds/manifest.json", "train")[0]
    checked = M.verify_shard(ref)
    assert len(list(SR.iter_shard(ref.path, keep=[0, 2], checked=checked))) == 2
    assert list(SR.iter_shard(ref.path, checked=checked)) == list(SR.iter_shard(ref.path))
    # the same bytes under the same name, but another file (a copy renamed over it): not the file checked
    Path(ref.path + ".new").write_bytes(Path(ref.path).read_bytes())
    os.replace(ref.path + ".new", ref.path)
    read = SR.iter_shard(ref.path, keep=[0], checked=checked)
    with pytest.raises(SR.ShardChangedError, match=rf"^{re.escape(ref.path)}: .* inode {checked.ino},"):
        next(read)
