"""Atomic writes: the final name holds the old file or the whole new one, never a part."""
from __future__ import annotations

import pytest

from chexflow.fsutil import atomic_path, sha256_file, write_bytes_atomic, write_text_atomic


@pytest.mark.parametrize("fsync", [False, True])
def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path, fsync):
    target = tmp_path / "sub" / "out.bin"
    write_bytes_atomic(target, b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(target, fsync=fsync) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert [p.name for p in target.parent.iterdir()] == ["out.bin"]
    with atomic_path(target, fsync=fsync) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".out.bin.tmp")
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["out.bin"]


def test_write_text_and_checksum(tmp_path):
    write_text_atomic(tmp_path / "a" / "b.txt", "hello\n")
    assert (tmp_path / "a" / "b.txt").read_text() == "hello\n"
    assert sha256_file(tmp_path / "a" / "b.txt", chunk=2) == \
        "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"


def test_two_writers_of_one_file_get_their_own_temporary_names(tmp_path):
    """Two writers of one file with one pid (ranks or jobs on two nodes of a shared file system
    have the same pids often enough) never share a temporary file: each rename moves a whole file."""
    target = tmp_path / "stamps.json"
    with atomic_path(target) as a, atomic_path(target) as b:
        assert a != b and a.parent == b.parent == tmp_path
        a.write_bytes(b"first writer")
        b.write_bytes(b"second writer")
    assert target.read_bytes() == b"first writer"       # the last to finish (the outer block) wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["stamps.json"]
