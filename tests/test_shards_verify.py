"""Shards are checked where they are read: a manifest's shard paths stay inside its folder (refused
before anything is opened), and every shard is checked against the manifest's sha256 before its
samples are used, by training (TrainData, its streams, node-local staging), evaluation and export.
The datasets are made by the real shard stage (conftest); each hostile case is its own test, on a
copy of the dataset."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from chexflow.data import loader as LD
from chexflow.data import shard_reader as SR
from chexflow.data import staging as ST
from chexflow.data import manifest as M
from chexflow.data import shards as S
from chexflow.evaluate import run as evaluate
from chexflow.settings import from_dict
from chexflow.train.config import TrainConfig
from chexflow.train.inputs import TrainData
from chexflow.train.models import build_model
from conftest import build_demo_dataset, cli_env
from test_distributed import train_cfg


@pytest.fixture(autouse=True)
def _fresh_checks():
    """Each test starts with no shard checked in this process (the cache is per process)."""
    M.forget_verified()
    yield
    M.forget_verified()


def _copy(demo_manifest: Path, dest: Path) -> Path:
    """A copy of the demo dataset's shards and manifest; returns the copy's manifest."""
    shutil.copytree(demo_manifest.parent, dest, ignore=shutil.ignore_patterns("*.png"))
    return dest / "manifest.json"


def _first_train(manifest: Path) -> tuple[dict, Path]:
    m = json.loads(manifest.read_text())
    entry = m["splits"]["train"]["shards"][0]
    return entry, manifest.parent / entry["path"]


def _set_train_path(manifest: Path, path: str) -> None:
    m = json.loads(manifest.read_text())
    m["splits"]["train"]["shards"][0]["path"] = path
    manifest.write_text(json.dumps(m))


def _samples(shards) -> list[str]:
    stream = LD.ShardStream(shards, rank=0, world=1, seed=0, batch_size=8, shuffle=False)
    return [sid.image for _, _, sid in stream]


# --------------------------------------------------------------------------- the honest dataset

def test_every_shard_is_checked_once_per_process_and_then_read(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    shards = M.split_shards(manifest, "train")
    m = json.loads(manifest.read_text())
    # the refs carry the manifest's sha256, computed here independently from the files
    for ref, entry in zip(shards, m["splits"]["train"]["shards"]):
        assert ref.sha256 == entry["sha256"] == hashlib.sha256(Path(ref.path).read_bytes()).hexdigest()
        assert ref.name == entry["path"] and ref.manifest == str(manifest)
    names = _samples(shards)
    assert len(names) == m["splits"]["train"]["n_images"] == sum(s.count for s in shards)
    assert set(M._VERIFIED) == {s.path for s in shards}
    # checked once: a second stream over the same unchanged files hashes nothing
    calls = []
    real = hashlib.file_digest
    try:
        hashlib.file_digest = lambda *a, **k: calls.append(a) or real(*a, **k)
        assert _samples(shards) == names
    finally:
        hashlib.file_digest = real
    assert calls == []


# --------------------------------------------------------------------------- paths out of the folder

@pytest.mark.parametrize("path, why", [("/etc/passwd", "is absolute"), ("/dev/zero", "is absolute"),
                                       ("../../x", r"climbs out of the manifest's folder \('\.\.'\)"),
                                       ("parts/../../../x", r"climbs out")])
def test_a_shard_path_out_of_the_manifests_folder_is_refused_before_open(demo_manifest, tmp_path, path, why):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    _set_train_path(manifest, path)
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from chexflow.data import manifest as M\n"
            "try:\n    M.split_shards(sys.argv[1], 'train')\nexcept M.ManifestError as e:\n    print(e); sys.exit(3)")
    # a subprocess with a timeout: /dev/zero opened would hash forever
    proc = subprocess.run([sys.executable, "-c", code, str(manifest), str(Path(M.__file__).parents[2])],
                          capture_output=True, text=True, timeout=60, env=cli_env())
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith(f"{manifest}: shard path {path!r} ")
    import re
    assert re.search(why, proc.stdout), proc.stdout


def test_a_symbolic_link_out_of_the_folder_is_refused(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    entry, shard = _first_train(manifest)
    outside = tmp_path / "elsewhere.tar"
    shutil.copyfile(shard, outside)      # even the right bytes: a link out of the folder is refused
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(M.ManifestError) as ei:
        M.split_shards(manifest, "train")
    assert str(ei.value) == (f"{manifest}: shard path {entry['path']!r} leads out of the manifest's folder "
                             f"{os.path.realpath(manifest.parent)} (resolves to {outside})")


def test_a_symbolic_link_inside_the_folder_is_followed_and_checked(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    entry, shard = _first_train(manifest)
    moved = manifest.parent / "moved.tar"
    shard.rename(moved)
    shard.symlink_to(moved)
    shards = M.split_shards(manifest, "train")
    assert shards[0].path == str(moved) and len(_samples(shards)) == sum(s.count for s in shards)


def test_a_fifo_under_a_shards_name_is_refused_without_blocking(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    entry, shard = _first_train(manifest)
    shard.unlink()
    os.mkfifo(shard)
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from chexflow.data import loader as LD, manifest as M\n"
            "try:\n    LD.ShardStream(M.split_shards(sys.argv[1], 'train'), rank=0, world=1, seed=0, batch_size=4)\n"
            "except M.ManifestError as e:\n    print(e); sys.exit(3)")
    proc = subprocess.run([sys.executable, "-c", code, str(manifest), str(Path(M.__file__).parents[2])],
                          capture_output=True, text=True, timeout=60, env=cli_env())
    assert proc.returncode == 3, proc.stderr
    assert f"shard {entry['path']!r} of {manifest}: cannot be read" in proc.stdout
    assert "a FIFO (named pipe), not a regular file; not read" in proc.stdout


# --------------------------------------------------------------------------- shards that are not the manifest's

def _refusal(manifest: Path, entry: dict) -> str:
    return f"{manifest.parent / entry['path']}: shard {entry['path']!r} of {manifest}: its sha256 "


def test_another_datasets_shard_is_refused(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    other = build_demo_dataset(tmp_path / "other", n_images=80, per_archive=80, samples_per_shard=20)
    entry, shard = _first_train(manifest)
    foreign = other.parent / json.loads(other.read_text())["splits"]["train"]["shards"][0]["path"]
    shutil.copyfile(foreign, shard)
    assert len(list(SR.iter_shard(str(shard)))) == 20     # a well-formed shard: only its checksum tells
    with pytest.raises(M.ShardVerifyError) as ei:
        _samples(M.split_shards(manifest, "train"))
    assert str(ei.value).startswith(_refusal(manifest, entry))
    assert "another dataset's shard; refused" in str(ei.value)


def test_a_tampered_shard_is_refused(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    entry, shard = _first_train(manifest)
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:          # one pixel of the first image: the tar stays well-formed
        member = next(m for m in tar if m.name.endswith(".img.npy"))
    data[member.offset_data + 200] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert len(list(SR.iter_shard(str(shard)))) == entry["count"]
    with pytest.raises(M.ShardVerifyError, match="changed, cut short, or another dataset's shard") as ei:
        _samples(M.split_shards(manifest, "train"))
    assert str(ei.value).startswith(_refusal(manifest, entry))


def test_a_truncated_shard_is_refused(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    entry, shard = _first_train(manifest)
    with tarfile.open(shard) as tar:          # cut before its last sample: the reader alone would not notice
        last = [m for m in tar][-3]
    shard.write_bytes(shard.read_bytes()[:last.offset])
    assert len(list(SR.iter_shard(str(shard)))) == entry["count"] - 1
    with pytest.raises(M.ShardVerifyError) as ei:
        _samples(M.split_shards(manifest, "train"))
    assert str(ei.value).startswith(_refusal(manifest, entry))
    assert f"({last.offset:,} bytes)" in str(ei.value)


def test_a_shard_changed_after_its_check_is_checked_again_by_the_worker(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    entry, shard = _first_train(manifest)
    stream = LD.ShardStream(M.split_shards(manifest, "train"), rank=0, world=1, seed=0, batch_size=8, shuffle=False)
    data = bytearray(shard.read_bytes())
    data[-2000] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(M.ShardVerifyError, match="its sha256"):
        list(stream)


def test_a_manifest_entry_without_a_checksum_is_refused(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    m = json.loads(manifest.read_text())
    del m["splits"]["val"]["shards"][0]["sha256"]
    manifest.write_text(json.dumps(m))
    with pytest.raises(M.ManifestError, match="has no sha256"):
        M.split_shards(manifest, "val")


# --------------------------------------------------------------------------- every reader

def _tampered(demo_manifest: Path, root: Path, split: str = "train") -> Path:
    manifest = _copy(demo_manifest, root)
    entry = json.loads(manifest.read_text())["splits"][split]["shards"][-1]
    shard = manifest.parent / entry["path"]
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0x01
    shard.write_bytes(bytes(data))
    return manifest


def test_training_refuses_it_naming_shard_and_manifest(demo_manifest, tmp_path):
    manifest = _tampered(demo_manifest, tmp_path / "ds")
    cfg = from_dict(TrainConfig, train_cfg("single", data={"crop": 32, "workers": 0}))
    data = TrainData.build(cfg, manifest, rank=0, world=1)
    with pytest.raises(M.ShardVerifyError, match=f"of {manifest}: its sha256"):
        data.train_stream()


def test_training_cli_refuses_it(demo_manifest, tmp_path):
    manifest = _tampered(demo_manifest, tmp_path / "ds")
    cfg = train_cfg("single", epochs=1, channels_last="auto", data={"crop": 32, "workers": 0, "samples_per_epoch": 16})
    proc = subprocess.run([sys.executable, "-m", "chexflow", "train", "--config-json", json.dumps(cfg), "--manifest",
                           str(manifest), "--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")],
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert f"of {manifest}: its sha256" in proc.stderr
    assert not (tmp_path / "out" / "model.pt").exists()


def test_staging_checks_the_node_local_copies(demo_manifest, tmp_path):
    manifest = _copy(demo_manifest, tmp_path / "ds")
    shards = M.split_shards(manifest, "train")
    staged = ST.stage_shards(shards, tmp_path / "local")
    assert [hashlib.sha256(Path(s.path).read_bytes()).hexdigest() for s in staged] == [s.sha256 for s in shards]
    # a stale copy of the same size on the node is replaced, not read
    data = bytearray(Path(staged[0].path).read_bytes())
    data[700] ^= 0x10
    Path(staged[0].path).write_bytes(bytes(data))
    M.forget_verified()
    again = ST.stage_shards(shards, tmp_path / "local")
    assert hashlib.sha256(Path(again[0].path).read_bytes()).hexdigest() == shards[0].sha256
    assert len(_samples(again)) == sum(s.count for s in shards)


def test_staging_refuses_a_tampered_source(demo_manifest, tmp_path):
    manifest = _tampered(demo_manifest, tmp_path / "ds")
    shards = M.split_shards(manifest, "train")
    with pytest.raises(M.ShardVerifyError) as ei:
        ST.stage_shards(shards, tmp_path / "local")
    assert f"(copied from {shards[-1].path})' of {manifest}: its sha256" in str(ei.value)
    # the ranks that only map the paths check the copies when they build their streams
    with pytest.raises(M.ShardVerifyError):
        LD.ShardStream(ST.stage_shards(shards, tmp_path / "local", copy=False), rank=0, world=1, seed=0, batch_size=4)


def test_evaluation_refuses_it(demo_manifest, tmp_path):
    manifest = _tampered(demo_manifest, tmp_path / "ds", "test")
    net = build_model("resnet18", in_channels=1, num_outputs=14)
    with pytest.raises(M.ShardVerifyError, match=f"of {manifest}: its sha256"):
        evaluate.predict(net, M.split_shards(manifest, "test"), crop=32, batch_size=8, device=torch.device("cpu"))


def test_gather_refuses_a_part_manifest_listing_a_file_out_of_its_folder(demo_manifest, tmp_path):
    ds = tmp_path / "ds"
    _copy(demo_manifest, ds)
    part = ds / "parts" / "images_001" / "manifest.json"
    m = json.loads(part.read_text())
    m["shards"][0]["file"] = "../../../../etc/passwd"
    part.write_text(json.dumps(m))
    cfg = S.ShardConfig(dataset="nih_demo", image_size=32, samples_per_shard=20, val_fraction=0.2)
    with pytest.raises(S.ShardError, match=r"lists shard '\.\./\.\./\.\./\.\./etc/passwd', which is not a regular "
                                           "file in its folder"):
        S.gather("nih_demo", [part], ds / "again.json", cfg)
