"""The loader's own tar reader and .npy decoding give what webdataset/tarfile/numpy give."""
from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import webdataset as wds

from chexflow.data import shard_reader as SR


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _write(path, fmt, members, mtime):
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = mtime
            tar.addfile(info, io.BytesIO(data))


def _reference(path):
    with open(path, "rb") as fh:
        files = ({**f, "__url__": str(path)} for f in wds.tariterators.tar_file_iterator(fh))
        return list(wds.tariterators.group_by_keys(files))


@pytest.mark.parametrize("fmt, mtime", [(tarfile.PAX_FORMAT, 0.0), (tarfile.USTAR_FORMAT, 0),
                                        (tarfile.GNU_FORMAT, 0)])
def test_iter_shard_matches_webdataset(tmp_path, fmt, mtime):
    rng = np.random.default_rng(0)
    long_dir = "d" * 120 if fmt != tarfile.USTAR_FORMAT else "sub"   # > 100 chars: pax / GNU long names
    members = []
    for i in range(5):
        key = f"{long_dir}/sample_{i:03d}"
        members += [(f"{key}.img.npy", _npy(rng.integers(0, 255, (7, 5), dtype=np.uint8))),
                    (f"{key}.target.npy", _npy(np.array([1.0, np.nan, 0.0], np.float32))),
                    (f"{key}.meta.json", b'{"image": "x", "patient": "p"}')]
    path = tmp_path / "s.tar"
    _write(path, fmt, members, mtime)
    ours = list(SR.iter_shard(str(path)))
    ref = _reference(path)
    assert len(ours) == len(ref) == 5
    for a, b in zip(ours, ref):
        assert a == b
        img, target, key = SR.decode(a)
        assert np.array_equal(img.numpy(), np.load(io.BytesIO(b["img.npy"])))
        assert np.array_equal(target.numpy(), np.load(io.BytesIO(b["target.npy"])), equal_nan=True)
        assert key == ("p", "x") and img.numpy().flags.writeable


def test_load_npy_dtypes_and_fortran_order():
    for a in (np.arange(12, dtype=np.int64).reshape(3, 4), np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              np.int64(7), np.zeros((0, 3), np.float32)):
        out = SR._load_npy(_npy(a))
        assert out.dtype == np.asarray(a).dtype and np.array_equal(out, a)
    with pytest.raises(ValueError, match="truncated"):
        SR._load_npy(_npy(np.arange(100, dtype=np.uint8))[:-10])


def test_corrupt_and_truncated_shards_named(tmp_path):
    path = tmp_path / "s.tar"
    _write(path, tarfile.USTAR_FORMAT, [("a.img.npy", _npy(np.zeros((4, 4), np.uint8)))], 0)
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.tar"
    data[10] ^= 0xFF                                         # header byte: checksum no longer matches
    bad.write_bytes(bytes(data))
    with pytest.raises(SR.ShardReadError, match=r"bad\.tar.*checksum"):
        list(SR.iter_shard(str(bad)))
    short = tmp_path / "short.tar"
    short.write_bytes(path.read_bytes()[:600])
    with pytest.raises(SR.ShardReadError, match=r"short\.tar.*truncated"):
        list(SR.iter_shard(str(short)))
