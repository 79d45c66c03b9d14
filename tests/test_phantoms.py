"""chexflow.data.phantoms: the synthetic "mini-NIH" release and its phantoms."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from chexflow.data import images, nih
from chexflow.data.phantoms.anatomy import sample_anatomy
from chexflow.data.phantoms.draw import render, render_phantom
from chexflow.data.phantoms.release import (GENERATOR_VERSION, ReleaseError, ReleaseInfo, image_rng, make_release,
                                            patient_anatomy, patient_pool, pool_rows, sample_rows, split_patients)

SEED = 3
N_IMAGES = 200


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, ReleaseInfo]:
    out = tmp_path_factory.mktemp("rel") / "nih_demo"
    info = make_release(out, n_images=N_IMAGES, image_size=48, images_per_archive=80,
                        test_fraction=0.25, seed=SEED)
    return out, info


def _render_row(seed: int, image: str, patient: str, findings: np.ndarray, size: int) -> np.ndarray:
    """The phantom of one label row, as make_release renders it."""
    return render_phantom(findings, size=size, rng=image_rng(seed, image), anatomy=patient_anatomy(seed, patient))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_release_layout_and_contents(release):
    out, info = release
    expected = {"images_001.tar.gz", "images_002.tar.gz", "images_003.tar.gz", "Data_Entry_2017_v2020.csv",
                "train_val_list.txt", "test_list.txt", "BBox_List_2017.csv", "release.json", "SHA256SUMS"}
    assert set(p.name for p in out.iterdir()) == expected      # no temp files left behind
    assert info.archives == ("images_001.tar.gz", "images_002.tar.gz", "images_003.tar.gz")

    labels = nih.read_labels(out / "Data_Entry_2017_v2020.csv")
    assert len(labels) == N_IMAGES == info.n_images
    seen: list[str] = []
    for name, count in zip(info.archives, (80, 80, 40)):
        members = list(nih.iter_archive(out / name, on_skip=lambda m, why: pytest.fail(f"{m}: {why}")))
        assert len(members) == count
        for image, data in members:
            img = images.decode_grey(data, name=image)
            assert img.shape == (48, 48) and img.dtype == np.uint8 and img.std() > 10
        seen += [m for m, _ in members]
    assert seen == list(labels.index)                            # CSV rows == archive members, same order

    train_val = nih.read_split_list(out / "train_val_list.txt")
    test = nih.read_split_list(out / "test_list.txt")
    assert sorted(train_val + test) == sorted(labels.index)
    assert not set(labels.loc[train_val, "patient"]) & set(labels.loc[test, "patient"])
    n_pat = labels["patient"].nunique()
    assert info.n_patients == n_pat
    assert abs(labels.loc[test, "patient"].nunique() - 0.25 * n_pat) <= 1
    split = nih.assign_splits(labels, train_val, test, val_fraction=0.2, seed=0)  # the reader accepts it
    assert set(split) == {"train", "val", "test"}

    meta = json.loads((out / "release.json").read_text())
    assert meta["synthetic"] is True and meta["seed"] == SEED and meta["n_images"] == N_IMAGES
    assert meta["generator_version"] == GENERATOR_VERSION and meta["archives"] == list(info.archives)
    assert meta["n_test_images"] == len(test) and meta["n_train_val_images"] == len(train_val)
    assert meta["label_counts"] == {k: int(labels[k].sum()) for k in nih.LABELS}

    # where each finding was drawn, in the release's box-list format, in pixels of its 48 px images
    boxes = nih.read_box_list(out / nih.BOX_LIST_NAME, frame=48)
    assert meta["n_boxes"] == len(boxes) and meta["box_frame"] == 48
    positive = {(img, lab) for img, row in labels[list(nih.LABELS)].iterrows() for lab in nih.LABELS if row[lab] == 1}
    boxed = set(zip(boxes["image"], boxes["label"]))
    assert boxed <= positive and len(boxed) >= 0.9 * len(positive)   # a finding that changed no pixel has none
    first = boxes.iloc[0]
    row = pd.read_csv(out / nih.LABEL_CSV_NAME, dtype=str).set_index("Image Index").loc[first["image"]]
    again = render(labels.loc[first["image"], list(nih.LABELS)].to_numpy(float), size=48,
                   rng=image_rng(SEED, first["image"]), anatomy=patient_anatomy(SEED, row["Patient ID"]))
    assert [tuple(r[1:]) for r in again.regions if r.label == first["label"]][0] == \
        tuple(first[["x", "y", "w", "h"]])


def test_release_rows_are_real_whole_patients(release):
    out, _ = release
    src = nih.read_label_table(nih.find_label_csv())
    rows = pd.read_csv(out / "Data_Entry_2017_v2020.csv", dtype=str, keep_default_na=False)
    assert list(rows.columns) == list(nih.CSV_COLUMNS) == list(src.columns)
    real = src.set_index("Image Index").loc[rows["Image Index"]].reset_index()
    pd.testing.assert_frame_equal(rows, real[rows.columns], check_dtype=False)
    # whole patients, except that the last sampled patient may be cut short
    full = src.groupby("Patient ID").size()
    got = rows.groupby("Patient ID").size()
    assert (got != full.loc[got.index]).sum() <= 1


def test_release_checksums_verify(release):
    out, info = release
    lines = (out / "SHA256SUMS").read_text().splitlines()
    listed = {}
    for line in lines:
        digest, name = line.split("  ", 1)
        listed[name] = digest
    assert set(listed) == set(info.files) == {p.name for p in out.iterdir()} - {"SHA256SUMS"}
    for name, digest in listed.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=out, check=True)


def test_release_is_deterministic_and_rerun_replaces_stale_files(release, tmp_path):
    out, _ = release
    again = tmp_path / "again"
    make_release(again, n_images=N_IMAGES, image_size=48, images_per_archive=80,
                 test_fraction=0.25, seed=SEED)
    assert _files(again) == _files(out)
    # another seed: other patients, other pictures
    other = tmp_path / "other"
    make_release(other, n_images=N_IMAGES, image_size=48, images_per_archive=80,
                 test_fraction=0.25, seed=SEED + 1)
    assert _files(other)["Data_Entry_2017_v2020.csv"] != _files(out)["Data_Entry_2017_v2020.csv"]
    # a smaller release written over it: the stale third archive disappears
    info = make_release(again, n_images=100, image_size=48, images_per_archive=80,
                        test_fraction=0.25, seed=SEED)
    assert sorted(p.name for p in again.glob("images_*.tar.gz")) == ["images_001.tar.gz", "images_002.tar.gz"]
    assert info.n_images == 100 and len(nih.read_labels(again / "Data_Entry_2017_v2020.csv")) == 100


def test_release_workers_give_same_bytes(tmp_path):
    kw = dict(n_images=150, image_size=32, images_per_archive=100, test_fraction=0.2, seed=9)
    make_release(tmp_path / "one", **kw)
    make_release(tmp_path / "two", workers=2, **kw)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_release_argument_errors(tmp_path):
    ok = dict(n_images=10, image_size=32, images_per_archive=5, test_fraction=0.2, seed=0)
    for bad in ({"n_images": 0}, {"image_size": 4}, {"images_per_archive": 0}, {"test_fraction": 1.0},
                {"n_images": 200_000}):
        with pytest.raises(ReleaseError):
            make_release(tmp_path / "x", **{**ok, **bad})
    assert not (tmp_path / "x" / "SHA256SUMS").exists()


# --------------------------------------------------------------------------- phantoms

def test_render_deterministic_and_validated():
    f = np.zeros(14)
    a = render_phantom(f, size=64, rng=np.random.default_rng(1))
    b = render_phantom(f, size=64, rng=np.random.default_rng(1))
    c = render_phantom(f, size=64, rng=np.random.default_rng(2))
    assert a.dtype == np.uint8 and a.shape == (64, 64)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(ValueError, match="14 entries"):
        render_phantom(np.zeros(13), size=64, rng=np.random.default_rng(1))
    for size in (16, 100, 257):
        assert render_phantom(np.ones(14), size=size, rng=np.random.default_rng(0)).shape == (size, size)


@pytest.mark.parametrize("label", nih.LABELS)
def test_regions_hold_where_the_finding_changed_the_image(label):
    """The independent measure: the image with the finding minus the same exposure without it (the
    other findings kept). Its strongest changes lie in the finding's boxes, and the boxes are small."""
    i = nih.LABELS.index(label)
    shown = 0
    for k in range(8):
        f = np.zeros(14)
        f[[i, (i + 3 + k) % 14]] = 1
        anatomy = sample_anatomy(np.random.default_rng(200 + k))
        got = render(f, size=96, rng=np.random.default_rng(k), anatomy=anatomy)
        assert np.array_equal(got.image, render_phantom(f, size=96, rng=np.random.default_rng(k), anatomy=anatomy))
        f[i] = 0
        diff = np.abs(got.image.astype(int) - render_phantom(f, size=96, rng=np.random.default_rng(k),
                                                             anatomy=anatomy).astype(int))
        inside = np.zeros(diff.shape, bool)
        for r in got.regions:
            if r.label == label:
                inside[int(r.y):int(r.y + r.h), int(r.x):int(r.x + r.w)] = True
        if diff.max() == 0:
            assert not inside.any()                                # invisible: no box
            continue
        shown += 1
        strong = diff >= 0.5 * diff.max()
        assert (strong & inside).sum() >= 0.95 * strong.sum()
        assert inside.mean() < 0.5, f"{label}: boxes cover {inside.mean():.0%} of the image"
    assert shown >= 6


def test_patient_anatomy_is_shared_by_follow_ups():
    f = np.zeros(14)
    a1 = _render_row(5, "00000042_000.png", "42", f, 64).astype(float)
    a2 = _render_row(5, "00000042_001.png", "42", f, 64).astype(float)
    b = _render_row(5, "00000043_000.png", "43", f, 64).astype(float)
    assert np.abs(a1 - a2).mean() < np.abs(a1 - b).mean()


@pytest.mark.parametrize("label", nih.LABELS)
def test_each_finding_changes_the_image_locally(label):
    """Same patient, same exposure: adding one finding changes pixels, but not everywhere."""
    i = nih.LABELS.index(label)
    changed_any = 0
    for k in range(6):
        anatomy = sample_anatomy(np.random.default_rng(100 + k))
        without = render_phantom(np.zeros(14), size=96, rng=np.random.default_rng(k), anatomy=anatomy)
        f = np.zeros(14)
        f[i] = 1
        with_ = render_phantom(f, size=96, rng=np.random.default_rng(k), anatomy=anatomy)
        diff = np.abs(with_.astype(int) - without.astype(int))
        changed = (diff > 2).mean()
        assert changed < 0.5, f"{label}: {changed:.0%} of the image changed"
        assert diff[:4, :4].max() == 0 and diff[-4:, :4].max() == 0   # the corners (air) stay
        changed_any += (diff > 4).sum() >= 8
    assert changed_any >= 5, f"{label}: visible in only {changed_any}/6 renders"


def test_patient_pools_partition_the_label_file_and_releases_of_two_pools_are_disjoint(release, tmp_path):
    """The demo's pretraining corpus (pool "pretrain") never holds a patient of the demo release
    (pool "finetune"), whatever the seeds: the pools split the label file's patients by a fixed hash."""
    table = nih.read_label_table(nih.find_label_csv())
    pid = table["Patient ID"].astype(str)
    fine, pre = pool_rows(table, "finetune"), pool_rows(table, "pretrain")
    assert len(fine) + len(pre) == len(table)
    fine_p, pre_p = set(fine["Patient ID"].astype(str)), set(pre["Patient ID"].astype(str))
    assert not fine_p & pre_p and fine_p | pre_p == set(pid)
    assert 0.45 < len(pre_p) / pid.nunique() < 0.55                 # about half each
    assert {patient_pool(p) for p in list(pre_p)[:50]} == {"pretrain"}

    from chexflow.data import registry                               # the workflow's two releases
    assert registry.get("nih_demo").patient_pool == "finetune"
    assert registry.get("nih_demo_pretrain").patient_pool == "pretrain"
    assert registry.get("nih_demo_pretrain").stage == "pretrain"
    out, _ = release                                                 # pool "finetune" (the default)
    corpus = make_release(tmp_path / "corpus", n_images=120, image_size=16, images_per_archive=60,
                                   test_fraction=0.1, seed=SEED, pool="pretrain")
    demo_patients = set(nih.read_labels(out / "Data_Entry_2017_v2020.csv")["patient"])
    corpus_patients = set(nih.read_labels(tmp_path / "corpus" / "Data_Entry_2017_v2020.csv")["patient"])
    assert corpus.n_images == 120 and len(corpus_patients) > 10
    assert demo_patients and not demo_patients & corpus_patients
    assert json.loads((tmp_path / "corpus" / "release.json").read_text())["patient_pool"] == "pretrain"
    with pytest.raises(ReleaseError, match="patient pool must be one of"):
        make_release(tmp_path / "x", n_images=10, image_size=16, images_per_archive=10,
                              test_fraction=0.1, seed=SEED, pool="both")


def test_findings_are_learnable_by_a_linear_model():
    """1,500 phantoms at 64 px from real label rows; per label, a logistic regression on 16x16
    mean-pooled pixels, patient-wise 70/30 split. Measured (seed 7): mean held-out AUROC ~0.70 with plain patient sampling, 0.625 with the rare-finding stratified sampling
    over the ~10 labels with >= 10 test positives (per label ~0.53 Mass .. ~0.93 Emphysema)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    seed, n = 7, 1500
    table = nih.read_label_table(nih.find_label_csv())
    rows = sample_rows(table, n, seed)
    y = nih.labels_from_findings(rows["Finding Labels"]).to_numpy()
    names, patients = rows["Image Index"].tolist(), rows["Patient ID"].tolist()
    imgs = np.stack([_render_row(seed, im, p, t, 64) for im, p, t in zip(names, patients, y)])
    x = imgs.reshape(n, 16, 4, 16, 4).mean(axis=(2, 4)).reshape(n, -1) / 255.0
    test_patients = split_patients(patients, 0.3, seed)
    te = np.array([p in test_patients for p in patients])
    scaler = StandardScaler().fit(x[~te])
    x_tr, x_te = scaler.transform(x[~te]), scaler.transform(x[te])
    aurocs = {}
    with threadpool_limits(1):   # multithreaded BLAS on a tiny problem only adds overhead
        for i, label in enumerate(nih.LABELS):
            if y[te, i].sum() >= 10 and y[~te, i].sum() >= 10:
                clf = LogisticRegression(C=0.05, max_iter=2000, class_weight="balanced").fit(x_tr, y[~te, i])
                aurocs[label] = roc_auc_score(y[te, i], clf.decision_function(x_te))
    assert len(aurocs) >= 8, aurocs
    mean = float(np.mean(list(aurocs.values())))
    assert mean > 0.6, aurocs
    assert max(aurocs.values()) < 0.999, aurocs   # not trivially separable
