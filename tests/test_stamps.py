"""Verification stamps (chexflow.data.stamps) and who checks which shard (verify_on_world,
first_readers): a start reads no shard its stamps vouch for, and every way a stamp can be wrong
makes it hash instead. Bytes are counted as the kernel counts them: ``rchar`` of /proc/self/io,
every byte read(2) returned to this process (page cache or not)."""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
from pathlib import Path

import pytest

from chexflow.data import epoch_plan as EP
from chexflow.data import manifest as MF
from chexflow.data import staging as ST
from chexflow.data import manifest as M
from chexflow.data import stamps as S
from test_shards_verify import _copy

# what this process may read besides the files a case names: /proc/self/io itself (~110 bytes a look)
# and a lazily imported module or two; far less than the smallest demo shard (20 KiB)
SLACK = 8192


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


@pytest.fixture(autouse=True)
def _fresh_checks():
    M.forget_verified()
    yield
    M.forget_verified()


@pytest.fixture
def settled(monkeypatch):
    """Stamps of files written seconds ago count as settled (the racy window has its own test)."""
    monkeypatch.setattr(S, "SETTLE_NS", 0)


class Dataset:
    def __init__(self, demo_manifest: Path, root: Path) -> None:
        self.manifest = _copy(demo_manifest, root / "ds")
        self.shards = MF.split_shards(self.manifest, "train") + MF.split_shards(self.manifest, "val")
        self.bytes = sum(os.path.getsize(s.path) for s in self.shards)
        self.log: list[str] = []
        self.store = S.StampStore(root / "verified", self.manifest, log=self.log.append)

    def check(self, store: S.StampStore | None = None) -> tuple[M.Checked, int]:
        """verify_on_world in a world of one, as a new process would (nothing checked yet); returns
        what it did and the bytes this process read meanwhile."""
        M.forget_verified()
        before = rchar()
        done = MF.verify_on_world(self.shards, [0] * len(self.shards), MF.Alone(), store or self.store)
        return done, rchar() - before


@pytest.fixture
def ds(demo_manifest, tmp_path) -> Dataset:
    return Dataset(demo_manifest, tmp_path)


# --------------------------------------------------------------------------- what a stamp saves

def test_a_requeue_reads_no_shard_its_stamps_vouch_for(ds, settled):
    done, read = ds.check()
    assert (done.shards, done.hashed, done.hashed_bytes) == (len(ds.shards), len(ds.shards), ds.bytes)
    assert ds.bytes <= read <= ds.bytes + SLACK
    stamp_file = ds.store.path.stat()
    assert oct(stamp_file.st_mode & 0o777) == "0o600" and oct(ds.store.root.stat().st_mode & 0o777) == "0o700"
    again, read = ds.check()
    assert (again.shards, again.hashed, again.hashed_bytes) == (len(ds.shards), 0, 0)
    assert read <= stamp_file.st_size + SLACK < min(os.path.getsize(s.path) for s in ds.shards)
    assert str(again) == f"{len(ds.shards)} shards checked against the manifest's sha256: 0 hashed (0.0 MiB, each by " \
                         f"one rank), {len(ds.shards)} unchanged since their stamps"
    assert ds.log == []


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_a_shard_changed_after_its_stamp_with_its_size_and_mtime_kept_is_refused(ds, settled, how):
    """The classic trap: the same size and mtime (``touch -d`` / ``cp -p`` put the old time back),
    other bytes. ctime (which no unprivileged call sets back) or the inode tells."""
    ds.check()
    shard = Path(ds.shards[0].path)
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[700] ^= 0x01
    if how == "in place":
        shard.write_bytes(bytes(data))
    else:
        other = shard.with_name("other.tar")
        other.write_bytes(bytes(data))
        other.rename(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = shard.stat()
    assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert (now.st_ino, now.st_ctime_ns) != (st.st_ino, st.st_ctime_ns)
    with pytest.raises(M.ShardVerifyError, match="changed, cut short, or another dataset's shard; refused"):
        ds.check()


def test_a_fresh_stamp_is_trusted_only_by_the_start_that_took_it(ds):
    """A stamp taken less than SETTLE_NS after the file's last change ("racy": a write in the same
    timestamp tick would not show) vouches only within its start; another start hashes again."""
    shard = ds.shards[0]
    Path(shard.path).write_bytes(Path(shard.path).read_bytes())      # changed just now
    stamp = M.verify_shard(shard, start="first")
    assert not stamp.settled and stamp.start == "first"
    st = os.stat(shard.path)
    assert stamp.vouches(st, shard.sha256, start="first")
    assert not stamp.vouches(st, shard.sha256, start="second") and not stamp.vouches(st, shard.sha256)
    aged = S.Stamp(stamp.sha256, stamp.ino, stamp.size, stamp.mtime_ns, stamp.ctime_ns,
                   stamp.ctime_ns + S.SETTLE_NS, "")
    assert aged.settled and aged.vouches(st, shard.sha256, start="second")
    # the store: this racy stamp, and stamps checked long after their files' last change for the others
    others = {}
    for ref in ds.shards[1:]:
        o = os.stat(ref.path)
        others[ref.path] = S.Stamp(ref.sha256, o.st_ino, o.st_size, o.st_mtime_ns, o.st_ctime_ns,
                                   o.st_ctime_ns + S.SETTLE_NS, "")
    ds.store.save({shard.path: stamp, **others})
    done, read = ds.check()          # another start: only the racy one is hashed
    assert (done.hashed, done.hashed_bytes) == (1, st.st_size)
    assert st.st_size <= read <= st.st_size + ds.store.path.stat().st_size + SLACK


def test_a_stamp_for_other_bytes_is_not_taken(ds, settled):
    ds.check()
    body = json.loads(ds.store.path.read_text())
    first = ds.shards[0].path
    body["shards"][first][0] = "0" * 64          # another manifest's sha256 for the same file description
    ds.store.path.write_text(json.dumps(body))
    done, read = ds.check()
    assert done.hashed == 1 and done.hashed_bytes == os.path.getsize(first)


def test_a_copied_stamp_is_kept_as_such_and_a_stamp_of_seven_fields_reads_as_not_copied(tmp_path):
    """A stamp is stored as 8 fields, the 8th saying it was taken by the writer of a copy; the 7 fields
    stamps were stored as before still load (not copied). A copied stamp vouches for a file described
    the same way however recent, and for nothing described otherwise."""
    store = S.StampStore(tmp_path / "store", tmp_path / "manifest.json")
    now = 10 * S.SETTLE_NS
    copied = S.Stamp("c" * 64, 5, 6, now, now, now, "job-1", True)
    assert store.save({"/copy": copied})
    body = json.loads(store.path.read_text())
    assert body["shards"]["/copy"] == ["c" * 64, 5, 6, now, now, now, "job-1", True]
    body["shards"]["/old"] = ["a" * 64, 1, 2, 3, 4, 5, "job-0"]
    body["shards"]["/bad"] = ["a" * 64, 1, 2, 3, 4, 5, "job-0", "yes"]
    store.path.write_text(json.dumps(body))
    loaded = store.load()
    assert loaded == {"/copy": copied, "/old": S.Stamp("a" * 64, 1, 2, 3, 4, 5, "job-0", False)}
    same = type("St", (), {"st_ino": 5, "st_size": 6, "st_mtime_ns": now, "st_ctime_ns": now})()
    assert not copied.settled and copied.vouches(same, "c" * 64, start="job-9")
    moved = type("St", (), {"st_ino": 5, "st_size": 6, "st_mtime_ns": now, "st_ctime_ns": now + 1})()
    assert not copied.vouches(moved, "c" * 64, start="job-9")
    assert not S.Stamp("c" * 64, 5, 6, now, now, now, "job-1").vouches(same, "c" * 64, start="job-9")


# --------------------------------------------------------------------------- a stamp store not to trust

def _group_writable_store(ds):
    os.chmod(ds.store.root, 0o770)
    return "writable by others (mode 770)"


def _group_writable_file(ds):
    os.chmod(ds.store.path, 0o620)
    return "writable by others (mode 620)"


def _other_owner(ds):
    os.chown(ds.store.path, 4242, -1)
    return f"owned by uid 4242, not by this user ({os.geteuid()})"


def _link(ds):
    planted = ds.store.root.parent / "planted.json"
    shutil.copyfile(ds.store.path, planted)
    ds.store.path.unlink()
    ds.store.path.symlink_to(planted)
    return "a symbolic link, not a regular file (links are not followed here); not read"


def _truncated(ds):
    data = ds.store.path.read_bytes()
    ds.store.path.write_bytes(data[:len(data) // 2])
    try:
        json.loads(data[:len(data) // 2])
    except ValueError as exc:
        return str(exc)


def _not_ours(ds):
    ds.store.path.write_text(json.dumps({"format": 99, "shards": {}}))
    return "not a stamp file of this chexflow"


@pytest.mark.parametrize("plant", [_group_writable_store, _group_writable_file, _other_owner, _link, _truncated,
                                   _not_ours], ids=lambda f: f.__name__.strip("_"))
def test_a_stamp_store_not_to_trust_is_ignored_and_every_shard_hashed(ds, settled, plant):
    ds.check()
    why = plant(ds)
    done, read = ds.check()
    assert done.hashed == len(ds.shards) and read >= ds.bytes
    assert ds.log[0].startswith("verification stamps ignored, every shard is hashed: ") and why in ds.log[0]
    if plant is _group_writable_store:      # not written either: a later start would ignore it the same way
        assert ds.log[1:] == [f"verification stamps not written ({ds.store.root}: {why}): the next start hashes "
                              "these shards again"]
        return
    assert len(ds.log) == 1
    if plant in (_link, _truncated, _not_ours, _group_writable_file, _other_owner):
        # the start rewrote a whole stamp file of its own, in place of the link (its target untouched)
        st = os.stat(ds.store.path, follow_symlinks=False)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600
        assert len(json.loads(ds.store.path.read_text())["shards"]) == len(ds.shards)
    if plant is _link:
        assert len(json.loads((ds.store.root.parent / "planted.json").read_text())["shards"]) == len(ds.shards)
        assert os.path.islink(ds.store.root.parent / "planted.json") is False


def test_a_store_that_cannot_be_written_is_said_and_is_not_an_error(ds, settled, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    store = S.StampStore(blocked / "verified", ds.manifest, log=ds.log.append)
    done, _ = ds.check(store)
    assert done.hashed == len(ds.shards)
    assert len(ds.log) == 1 and ds.log[0].startswith("verification stamps not written (") and \
        ds.log[0].endswith("): the next start hashes these shards again")


def _save_many(root: str, manifest: str, worker: int, n: int, bad: list) -> None:
    store = S.StampStore(root, manifest, log=bad.append)
    for i in range(n):
        store.save({f"/w{worker}/{i}": S.Stamp("a" * 64, i, i, i, i, i, f"w{worker}")})
        store.load()


def test_writers_at_once_leave_one_whole_stamp_file(ds):
    """Ranks or jobs saving one stamp file together: every load finds a whole file (an update lost
    to another writer costs a hash later, never a refusal or a half file)."""
    ctx = multiprocessing.get_context("fork")
    with ctx.Manager() as manager:
        bad = manager.list()
        procs = [ctx.Process(target=_save_many, args=(str(ds.store.root), str(ds.manifest), w, 40, bad))
                 for w in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        assert list(bad) == []
    kept = ds.store.load()
    assert ds.log == [] and any(path.startswith("/w") for path in kept)
    assert sorted(p.name for p in ds.store.root.iterdir()) == [ds.store.path.name]


def test_a_save_renamed_into_place_while_a_reader_opens_the_file_is_read_again(ds, monkeypatch):
    """The race the writers above hit at random, made to happen: between the reader's check of the
    stamp file and its open, another writer renames its save into place. The reader reads the new
    file (a whole one) instead of ignoring the store; a file that keeps changing is still ignored."""
    from chexflow import fsutil
    ds.store.save({"/a": S.Stamp("a" * 64, 1, 1, 1, 1, 1, "s")})
    real, renames, writing = fsutil.check_regular, [], []

    def renamed_after_the_check(path, **kw):
        st = real(path, **kw)
        if len(renames) < limit and not writing:
            renames.append(path)
            writing.append(True)             # the other writer's own read of the file is not raced
            other = S.StampStore(ds.store.root, ds.manifest, log=ds.log.append)
            other.save({f"/b{len(renames)}": S.Stamp("b" * 64, 2, 2, 2, 2, 2, "t")})     # a new inode
            writing.pop()
        return st

    monkeypatch.setattr(fsutil, "check_regular", renamed_after_the_check)
    limit = 1
    assert set(ds.store.load()) == {"/a", "/b1"} and ds.log == [] and len(renames) == 1
    limit, renames[:] = S.RENAMED_RETRIES + 1, []             # replaced at every attempt
    assert ds.store.load() == {}
    assert len(renames) == S.RENAMED_RETRIES + 1
    assert len(ds.log) == 1 and "replaced while being opened" in ds.log[0]


# --------------------------------------------------------------------------- who checks which shard

@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_each_shard_is_checked_by_a_rank_that_reads_it_in_the_first_epoch(demo_manifest, world):
    for split, shuffle in (("train", True), ("val", False)):
        shards = MF.split_shards(demo_manifest, split)
        owners = EP.first_readers(shards, world=world, seed=5, batch_size=4, shuffle=shuffle)
        reads = [{path for run in EP.plan_epoch(shards, rank=r, world=world, epoch=0, seed=5, batch_size=4,
                                                shuffle=shuffle) for path, _, _ in run.pieces}
                 for r in range(world)]
        unread = [i for i, s in enumerate(shards) if not any(s.path in mine for mine in reads)]
        for i, (s, owner) in enumerate(zip(shards, owners)):
            assert 0 <= owner < world
            assert i in unread or s.path in reads[owner], (split, world, i)
        # the shards no rank reads in the first epoch are spread over the ranks in turn
        assert [owners[i] for i in unread] == [k % world for k in range(len(unread))] or shuffle


def test_the_unread_remainder_goes_to_the_ranks_in_turn():
    """Six shards of 10 samples, 2 ranks, batch 8: a step takes 16 samples, 3 steps take 48, so
    the epoch's last 12 samples (the sixth shard and 2 of the fifth) wait for another epoch."""
    shards = [M.ShardRef(f"/s{i}", 10) for i in range(6)]
    owners = EP.first_readers(shards, world=2, seed=0, batch_size=8, shuffle=False)
    assert owners == [0, 0, 0, 1, 1, 1]          # evaluation: 30 samples each, every shard read
    order = EP.epoch_order(list(range(6)), epoch=0, seed=0, shuffle=True)
    owners = EP.first_readers(shards, world=2, seed=0, batch_size=8)
    # rank 0 reads samples 0-23 (shards order[0..2]), rank 1 24-47 (order[2..4]); order[5] is unread
    assert [owners[i] for i in order] == [0, 0, 0, 1, 1, 0]


# --------------------------------------------------------------------------- node-local copies

def test_a_nodes_other_ranks_use_the_fresh_copies_without_reading_them(ds, tmp_path, monkeypatch):
    local = tmp_path / "node" / "chexflow-shards"
    before = rchar()
    staged = ST.stage_shards(ds.shards, local, start="job-1")
    assert ds.bytes <= rchar() - before <= ds.bytes + SLACK           # each source read once: copied and hashed
    mapped = ST.stage_shards(ds.shards, local, copy=False)
    assert [s.path for s in mapped] == [s.path for s in staged]
    stamp_size = (local / S.StampStore(local, ds.manifest).path.name).stat().st_size
    M.forget_verified()
    before = rchar()
    ST.verify_staged(mapped, local, start="job-1")        # the node's other ranks of this start
    assert rchar() - before <= stamp_size + SLACK
    # a requeue on the same node (another start), seconds later, SETTLE_NS as it is: the copies carry
    # the proof of the hash made while copying, so nothing is read, neither copy nor source
    assert S.SETTLE_NS == 2_000_000_000
    kept = S.StampStore(local, ds.manifest).load()
    assert all(stamp.copied and not stamp.settled for stamp in kept.values())
    M.forget_verified()
    before = rchar()
    ST.verify_staged(mapped, local, start="job-2")
    assert rchar() - before <= stamp_size + SLACK
    M.forget_verified()
    before = rchar()
    assert [s.path for s in ST.stage_shards(ds.shards, local, start="job-3")] == [s.path for s in staged]
    assert rchar() - before <= stamp_size + SLACK
    # a copy changed in place (same size) after it was made is hashed and refused, the others are not read
    victim = Path(staged[0].path)
    data = bytearray(victim.read_bytes())
    data[-1024] ^= 0xFF
    victim.write_bytes(bytes(data))
    M.forget_verified()
    with pytest.raises(M.ShardVerifyError, match=re.escape(staged[0].path)):
        ST.verify_staged(mapped, local, start="job-4")
