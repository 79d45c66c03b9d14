"""ImageNet ILSVRC2012: devkit parsing, labels, parts, rejects and the DAG, on a tiny fake release
built in the real layout (per-class tars inside the train tar, flat val tar, devkit with meta.mat)."""
from __future__ import annotations

import io
import re
import tarfile

import numpy as np
import pytest
import scipy.io as sio
import yaml
from PIL import Image

from chexflow.data.config import ShardConfig
from chexflow.data import imagenet as I
from chexflow.data import manifest as MF
from chexflow.data import shard_reader as SR
from chexflow.data import shards as S
from conftest import REPO

# ILSVRC2012_IDs deliberately not in WNID order, plus a non-leaf synset that must be ignored
SYNSETS = [(1, "n02000002", "goose, anser", 0), (2, "n01000001", "tench, Tinca tinca", 0),
           (3, "n03000003", "crane", 0), (4, "n00000009", "animal", 2)]
WNIDS = sorted(w for _, w, _, kids in SYNSETS if kids == 0)          # class index = sorted position
ID_TO_WNID = {i: w for i, w, _, kids in SYNSETS if kids == 0}
VAL_GT = [3, 1, 2, 2, 3, 1]                                           # ILSVRC2012_IDs of val 1..6
CORRUPT = "n02000002_3.JPEG"
SIZE = 16


def _jpeg(value: int, mode: str = "L", size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    if mode == "L":
        Image.new("L", size, value).save(buf, format="JPEG", quality=95)
    elif mode == "RGB":
        Image.new("RGB", size, (value, 0, 0)).save(buf, format="JPEG", quality=95)
    elif mode == "CMYK":
        Image.new("CMYK", size, (0, 0, 0, 255 - value)).save(buf, format="JPEG", quality=95)
    elif mode == "P":   # a PNG under a .JPEG name, as one file of the real train set
        img = Image.new("P", size, 1)
        img.putpalette([0, 0, 0, value, value, value] + [0] * 762)
        img.save(buf, format="PNG")
    return buf.getvalue()


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _meta_mat() -> bytes:
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    arr = np.zeros((len(SYNSETS), 1), dtype=[(f, "O") for f in fields])
    for k, (idx, wnid, words, kids) in enumerate(SYNSETS):
        arr[k, 0] = (np.array([[idx]], np.uint16), np.array([wnid]), np.array([words]), np.array(["gloss"]),
                     np.array([[kids]], np.uint8), np.array([[1, 2]]) if kids else np.zeros((1, 0)),
                     np.array([[0]], np.uint8), np.array([[4]], np.uint16))
    buf = io.BytesIO()
    sio.savemat(buf, {"synsets": arr})
    return buf.getvalue()


def make_release(raw, *, extra_val: list[tuple[str, bytes]] = ()) -> dict[str, int]:
    """The fake release under ``raw``; returns image name -> value drawn (for pixel checks)."""
    raw.mkdir(parents=True, exist_ok=True)
    drawn = {}
    class_tars = []
    for c, wnid in enumerate(reversed(WNIDS)):          # outer order is not the sorted order
        members = []
        for j in range(4):
            name = f"{wnid}_{j}.JPEG"
            mode = {("n01000001", 1): "RGB", ("n01000001", 2): "CMYK", ("n03000003", 0): "P"}.get((wnid, j), "L")
            value = 40 + 50 * c + 10 * j
            data = b"\xff\xd8\xff\xe0 truncated" if name == CORRUPT else _jpeg(value, mode)
            members.append((name, data))
            drawn[name] = (value, mode)
        class_tars.append((f"{wnid}.tar", _tar_bytes(members)))
    (raw / I.TRAIN_TAR).write_bytes(_tar_bytes(class_tars))
    val = [(I.val_image_name(i + 1), _jpeg(100 + 10 * i)) for i in range(len(VAL_GT))]
    (raw / I.VAL_TAR).write_bytes(_tar_bytes(val + list(extra_val)))
    devkit = [(I.META_MAT, _meta_mat()),
              (I.VAL_GROUND_TRUTH, "".join(f"{g}\n" for g in VAL_GT).encode()),
              ("ILSVRC2012_devkit_t12/readme.txt", b"fake devkit\n")]
    with tarfile.open(raw / I.DEVKIT, "w:gz") as tar:
        for name, data in devkit:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return drawn


def _cfg(**kw) -> ShardConfig:
    return ShardConfig(**{"dataset": "imagenet", "image_size": SIZE, "samples_per_shard": 3, "val_fraction": 0.0,
                          "max_reject_fraction": 0.2, "train_parts": 2, **kw})


def _build(root, cfg):
    raw, out = root / "raw", root / "shards"
    S.split_dataset("imagenet", raw, cfg, out / "splits.csv")
    parts = []
    for part in S.parts_of("imagenet", cfg):
        m = S.write_part("imagenet", part, raw, out / "splits.csv", out / "parts" / part, cfg)
        parts.append((part, m))
    gathered = S.gather("imagenet", [out / "parts" / p / "manifest.json" for p, _ in parts], out / "manifest.json", cfg)
    return out, dict(parts), gathered


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    drawn = make_release(root / "raw")
    out, parts, gathered = _build(root, _cfg())
    return root, drawn, out, parts, gathered


def test_devkit_parsed_like_torchvision(built):
    root = built[0]
    dk = I.read_devkit(root / "raw" / I.DEVKIT)
    assert dk.wnids == tuple(WNIDS)                                   # leaves only, sorted
    assert dk.words[WNIDS.index("n01000001")] == "tench, Tinca tinca"
    assert dk.val_wnids == tuple(ID_TO_WNID[g] for g in VAL_GT)


def test_parts_split_train_by_class_range():
    assert I.part_names(2) == ["train_000", "train_001", "val"]
    assert I.train_part_classes("train_000", 2, tuple(WNIDS)) + I.train_part_classes("train_001", 2, tuple(WNIDS)) \
        == tuple(WNIDS)
    assert len(I.part_names(16)) == 17 and I.part_names(1000)[-2] == "train_999"
    with pytest.raises(ValueError, match="train_parts"):
        I.part_names(1001)
    with pytest.raises(I.ImageNetError, match="no part 'train_007'"):
        I.train_part_classes("train_007", 2, tuple(WNIDS))


def test_labels_counts_and_rejects(built):
    _, drawn, out, parts, m = built
    assert m["task"] == "multiclass" and m["labels"] == WNIDS and m["image_size"] == SIZE
    assert set(m["splits"]) == {"train", "val"}
    assert m["splits"]["train"]["n_images"] == 3 * 4 - 1 and m["splits"]["val"]["n_images"] == 6
    assert m["n_rejects"] == 1
    rejects = [r for p in parts.values() for r in p["rejects"]]
    assert [r["image"] for r in rejects] == [CORRUPT]
    assert "cannot decode" in rejects[0]["reason"] and CORRUPT in rejects[0]["reason"]
    assert m["splits"]["train"]["label_counts"] == {"n01000001": 4, "n02000002": 3, "n03000003": 4}
    assert m["splits"]["val"]["label_counts"] == {"n01000001": 2, "n02000002": 2, "n03000003": 2}

    seen = {}
    for split in ("train", "val"):
        for ref in MF.split_shards(out / "manifest.json", split):
            for sample in SR.iter_shard(ref.path):
                img, target, key = SR.decode(sample)
                seen[key.image] = (split, int(target), img.numpy())
    assert len(seen) == 17
    for name, (split, label, img) in seen.items():
        assert img.shape == (SIZE, SIZE) and img.dtype == np.uint8
        if split == "train":
            assert label == WNIDS.index(name.split("_")[0])
        else:
            i = int(name[len("ILSVRC2012_val_"):-len(".JPEG")])
            assert label == WNIDS.index(ID_TO_WNID[VAL_GT[i - 1]])
    # grey conversion: RGB (value, 0, 0) -> luma 0.299 * value; CMYK K = 255 - value -> value;
    # palette PNG -> its palette grey; plain grey JPEG -> its value
    for name, (value, mode) in drawn.items():
        if name == CORRUPT:
            continue
        expect = round(0.299 * value) if mode == "RGB" else value
        assert abs(float(seen[name][2].mean()) - expect) <= 3, (name, mode, seen[name][2].mean(), expect)


def test_train_part_interleaves_its_classes(built):
    """Part train_000 holds two classes; its stream alternates between them, not class after class."""
    root = built[0]
    classes = I.train_part_classes("train_000", 2, tuple(WNIDS))
    order = [w for w, *_ in I.iter_train_part(root / "raw" / I.TRAIN_TAR, classes, seed=0, on_skip=pytest.fail)]
    assert sorted(order) == sorted([w for w in classes for _ in range(4)])
    runs = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert runs >= 2
    again = [w for w, *_ in I.iter_train_part(root / "raw" / I.TRAIN_TAR, classes, seed=0, on_skip=pytest.fail)]
    assert order == again


def test_too_many_rejects_fail_naming_the_file(built, tmp_path):
    root = built[0]
    cfg = _cfg(max_reject_fraction=0.0)
    out = tmp_path / "shards"
    S.split_dataset("imagenet", root / "raw", cfg, out / "splits.csv")
    with pytest.raises(S.ShardError, match=re.escape(CORRUPT)):
        S.write_part("imagenet", "train_000", root / "raw", out / "splits.csv", out / "parts" / "train_000", cfg)
    assert not (out / "parts" / "train_000" / "manifest.json").exists()


def test_unsafe_and_unknown_val_members_rejected(tmp_path):
    raw = tmp_path / "raw"
    make_release(raw, extra_val=[("../evil.JPEG", _jpeg(10)), ("ILSVRC2012_val_00000099.JPEG", _jpeg(10))])
    cfg = _cfg(max_reject_fraction=0.5)
    S.split_dataset("imagenet", raw, cfg, tmp_path / "splits.csv")
    m = S.write_part("imagenet", "val", raw, tmp_path / "splits.csv", tmp_path / "val", cfg)
    reasons = {r["image"]: r["reason"] for r in m["rejects"]}
    assert "'data' filter" in reasons["../evil.JPEG"]
    assert "ground truth" in reasons["ILSVRC2012_val_00000099.JPEG"]
    assert sum(s["count"] for s in m["shards"]) == 6
    assert not list(tmp_path.rglob("evil.JPEG"))


def test_val_fraction_must_be_zero(built, tmp_path):
    with pytest.raises(S.ShardError, match=r"shards\.imagenet\.val_fraction: 0\.1 is not 0"):
        S.split_dataset("imagenet", built[0] / "raw", _cfg(val_fraction=0.1), tmp_path / "splits.csv")


def test_dry_run_dag_with_imagenet_pretraining(tmp_path):
    from conftest import job_counts, snakemake
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["study"]["pretrain_dataset"] = "imagenet"
    cfg["datasets"]["imagenet"]["mirror"] = str(mirror)
    cfg["shards"]["imagenet"]["train_parts"] = 5
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    dry = snakemake(tmp_path, "-n", "--configfile", str(tmp_path / "config.yaml"))
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["write_shards"] == 5 + 1 + 3          # imagenet train_000..train_004 + val, 3 demo archives
    assert counts["download_file"] == 3 + 7            # the ImageNet release + the demo release files (with its box list)
    assert counts["split_dataset"] == counts["gather_shards"] == 2
    assert "data/raw/fashion_mnist" not in dry.stdout and "data/shards/fashion_mnist" not in dry.stdout
    assert "data/shards/imagenet/parts/train_004/manifest.json" in dry.stdout
    assert "data/shards/imagenet/parts/val/manifest.json" in dry.stdout
