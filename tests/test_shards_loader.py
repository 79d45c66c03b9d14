"""Shards and streaming: patient-wise splits, manifests, resume, exactly-once per epoch."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import webdataset as wds

from chexflow.data import augment as AU
from chexflow.data import epoch_plan as EP
from chexflow.data import loader as LD
from chexflow.data import manifest as MF
from chexflow.data import shard_reader as SR
from chexflow.data import shards as S
from conftest import REPO, cli_env


def test_manifest_counts_and_patient_disjoint(demo_manifest):
    m = json.loads(demo_manifest.read_text())
    assert m["synthetic"] is True and m["task"] == "multilabel" and len(m["labels"]) == 14
    assert set(m["splits"]) == {"train", "val", "test"}
    assert sum(s["n_images"] for s in m["splits"].values()) == 240
    splits = pd.read_csv(demo_manifest.parent / "splits.csv", dtype=str)
    assert splits.groupby("patient")["split"].nunique().max() == 1
    # every shard exists with the recorded checksum and count
    from chexflow.fsutil import sha256_file
    for split in m["splits"].values():
        for sh in split["shards"]:
            p = demo_manifest.parent / sh["path"]
            assert sha256_file(p) == sh["sha256"]
            assert sum(1 for _ in SR.iter_shard(str(p))) == sh["count"]


def test_shard_samples_match_labels(demo_manifest):
    raw = demo_manifest.parent.parent / "raw"
    from chexflow.data import nih
    table = nih.read_labels(raw / "Data_Entry_2017_v2020.csv")
    shards = MF.split_shards(demo_manifest, "test")
    for sample in SR.iter_shard(shards[0].path):
        img, target, key = SR.decode(sample)
        patient, image = key
        assert img.dtype == torch.uint8 and img.shape == (32, 32)
        assert np.array_equal(target.numpy(), table.loc[image, list(nih.LABELS)].to_numpy(np.float32))
        assert table.loc[image, "patient"] == patient


@pytest.mark.parametrize("world, workers", [(2, 2), (3, 1), (1, 2)])
def test_each_sample_at_most_once_per_epoch_in_full_batches(demo_manifest, world, workers):
    shards = MF.split_shards(demo_manifest, "train")
    total = sum(s.count for s in shards)
    steps = EP.epoch_steps(shards, world=world, batch_size=7)
    for epoch in (0, 1):
        keys = []
        for rank in range(world):
            stream = LD.ShardStream(shards, rank=rank, world=world, seed=3, batch_size=7, epoch=epoch,
                                   shuffle=True, shuffle_buffer=16)
            batches = [k for _, _, k in LD.make_loader(stream, batch_size=7, workers=workers, pin_memory=False)]
            assert len(batches) == steps and all(len(k) == 7 for k in batches)
            keys += [x for k in batches for x in k]
        assert len(set(keys)) == len(keys) == world * steps * 7 > total - world * 7


def test_epochs_reshuffle_and_seed_determinism(demo_manifest):
    shards = MF.split_shards(demo_manifest, "train")

    def order(epoch, seed=3):
        s = LD.ShardStream(shards, rank=0, world=1, seed=seed, batch_size=4, epoch=epoch, shuffle_buffer=16)
        return [k for _, _, k in s]
    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0, seed=4) != order(0)


def test_gpu_augment_shapes_and_determinism():
    from chexflow.data.config import AugmentConfig
    x = torch.randint(0, 255, (4, 40, 40), dtype=torch.uint8)
    a = AU.gpu_augment(x, out_size=32, train=True, cfg=AugmentConfig(rotate_deg=5),
                      generator=torch.Generator().manual_seed(1))
    b = AU.gpu_augment(x, out_size=32, train=True, cfg=AugmentConfig(rotate_deg=5),
                      generator=torch.Generator().manual_seed(1))
    assert a.shape == (4, 1, 32, 32) and torch.equal(a, b)
    e = AU.gpu_augment(x, out_size=40, train=False, cfg=None, generator=None)
    assert torch.allclose(e[:, 0], (x.float() / 255 - 0.5) / 0.25)


def test_write_part_resumes_only_missing_shards(tmp_path, demo_manifest):
    """A crash after some shards: the rerun keeps finished shards and writes only the rest."""
    from chexflow.data.config import ShardConfig
    raw = demo_manifest.parent.parent / "raw"
    cfg = ShardConfig(dataset="nih_demo", image_size=32, samples_per_shard=10, val_fraction=0.2,
                      max_reject_fraction=0.0)
    ref = S.write_part("nih_demo", "images_001", raw, demo_manifest.parent / "splits.csv", tmp_path / "ref", cfg,
                       n_archives=3)

    out = tmp_path / "crash"
    calls = {"n": 0}
    real = S.images.decode_grey

    def crashing(data, *, name, **kw):
        calls["n"] += 1
        if calls["n"] == 45:
            raise KeyboardInterrupt("simulated crash")
        return real(data, name=name, **kw)
    S.images.decode_grey = crashing
    try:
        with pytest.raises(KeyboardInterrupt):
            S.write_part("nih_demo", "images_001", raw, demo_manifest.parent / "splits.csv", out, cfg, n_archives=3)
    finally:
        S.images.decode_grey = real
    assert not (out / "manifest.json").exists()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    assert before, "some shards were finished before the crash"
    decoded = {"n": 0}

    def counting(data, *, name, **kw):
        decoded["n"] += 1
        return real(data, name=name, **kw)
    S.images.decode_grey = counting
    try:
        resumed = S.write_part("nih_demo", "images_001", raw, demo_manifest.parent / "splits.csv", out, cfg,
                               n_archives=3)
    finally:
        S.images.decode_grey = real
    assert decoded["n"] == 80 - sum(s["count"] for s in resumed["shards"] if s["file"] in before)
    for name, mtime in before.items():
        assert (out / name).stat().st_mtime_ns == mtime   # untouched
    assert [(s["file"], s["sha256"]) for s in resumed["shards"]] == [(s["file"], s["sha256"]) for s in ref["shards"]]


def test_reject_fraction_fails_with_names(tmp_path, demo_manifest):
    import io
    import tarfile
    from chexflow.data.config import ShardConfig
    raw = demo_manifest.parent.parent / "raw"
    bad_raw = tmp_path / "raw"
    bad_raw.mkdir()
    for f in ("Data_Entry_2017_v2020.csv", "train_val_list.txt", "test_list.txt"):
        (bad_raw / f).write_bytes((raw / f).read_bytes())
    # rewrite images_001 with one corrupt PNG
    from chexflow.data import nih
    members = list(nih.iter_archive(raw / "images_001.tar.gz"))
    with tarfile.open(bad_raw / "images_001.tar.gz", "w:gz") as tar:
        for i, (name, data) in enumerate(members):
            data = b"not a png" if i == 3 else data
            info = tarfile.TarInfo(f"images/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cfg = ShardConfig(dataset="nih_demo", image_size=32, samples_per_shard=10, max_reject_fraction=0.0)
    with pytest.raises(S.ShardError, match=members[3][0]):
        S.write_part("nih_demo", "images_001", bad_raw, demo_manifest.parent / "splits.csv", tmp_path / "o", cfg,
                     n_archives=3)
    cfg = ShardConfig(dataset="nih_demo", image_size=32, samples_per_shard=10, max_reject_fraction=0.05)
    m = S.write_part("nih_demo", "images_001", bad_raw, demo_manifest.parent / "splits.csv", tmp_path / "o2", cfg,
                     n_archives=3)
    assert [r["image"] for r in m["rejects"]] == [members[3][0]]
    assert sum(s["count"] for s in m["shards"]) == len(members) - 1


def test_shard_tar_is_byte_for_byte_webdatasets_and_the_job_imports_no_torch(tmp_path):
    """chexflow writes a shard with tarfile (write_tar), not webdataset's TarWriter, whose module imports torch
    (2 CPU s of a 3.7 s shard job): the same bytes as TarWriter(encoder=False, mtime=0) for samples of every
    encoding (PNG or raw image, target, meta), so shards written before and after are one format and the
    loader (webdataset's grouping by key) reads them as before. The shard command imports no torch."""
    rng = np.random.default_rng(5)
    samples = []
    for i, encoding in enumerate(("png", "raw", "png")):
        smp = S.Sample(key=f"000{i:02d}_000.png", patient=str(i), split="train",
                       image=rng.integers(0, 256, (8, 8), np.uint8), target=rng.integers(0, 2, 14).astype(np.float32))
        samples.append(S._encode(smp, encoding))
    S.write_tar(tmp_path / "chexflow.tar", iter(samples))
    with wds.TarWriter(str(tmp_path / "webdataset.tar"), encoder=False, mtime=0) as sink:
        for sample in samples:
            sink.write(sample)
    assert (tmp_path / "chexflow.tar").read_bytes() == (tmp_path / "webdataset.tar").read_bytes()
    read = list(SR.iter_shard(str(tmp_path / "chexflow.tar")))
    assert [{k: v for k, v in r.items() if not k.startswith("_")} for r in read] == \
        [{k: v for k, v in smp.items() if not k.startswith("_")} for smp in samples]
    assert [r["__key__"] for r in read] == [smp["__key__"] for smp in samples]
    program = "import sys, chexflow.data.shards, chexflow.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", program], env=cli_env(), capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
