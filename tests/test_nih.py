"""chexflow.data.nih: label table, split assignment, archive streaming."""
from __future__ import annotations

import gzip
import io
import logging
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from chexflow.data import nih

HEADER = ("Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
          "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]\n")


def _csv(tmp_path: Path, rows: list[tuple[str, str, str]], name: str = "labels.csv") -> Path:
    text = HEADER + "".join(f"{img},{lab},0,{pat},50,M,PA,1024,1024,0.14,0.14\n" for img, lab, pat in rows)
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    (Image.fromarray(arr, mode) if mode else Image.fromarray(arr)).save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- labels

def test_labels_and_display_names():
    assert len(nih.LABELS) == 14 and nih.LABELS[0] == "Atelectasis" and nih.LABELS[-1] == "Hernia"
    assert nih.display_name("Pleural_Thickening") == "Pleural Thickening"
    with pytest.raises(KeyError, match="unknown NIH label"):
        nih.display_name("Covid")


def test_finding_names_with_spaces_around_the_separator_are_the_findings_they_name():
    """A hand-edited label file: the names are checked stripped, so they are read stripped (one column each)."""
    y = nih.labels_from_findings(pd.Series(["Mass", " Mass", "Mass | Nodule ", "No Finding"]))
    assert list(y.columns) == list(nih.LABELS)
    assert y["Mass"].tolist() == [1.0, 1.0, 1.0, 0.0] and y["Nodule"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert y.to_numpy().sum() == 4

@pytest.mark.parametrize("name", ["labels.csv", "labels.csv.gz"])
def test_read_labels_small(tmp_path, name):
    path = _csv(tmp_path, [("00000001_000.png", "Cardiomegaly|Effusion", "1"),
                           ("00000001_001.png", "No Finding", "1"),
                           ("00000002_000.png", "Hernia", "2")], name)
    df = nih.read_labels(path)
    assert list(df.columns) == ["patient", *nih.LABELS]
    assert df.index.name == "image" and list(df.index) == ["00000001_000.png", "00000001_001.png", "00000002_000.png"]
    assert df["patient"].tolist() == ["1", "1", "2"]
    assert all(df[label].dtype == np.float32 for label in nih.LABELS)
    assert df.loc["00000001_000.png", ["Cardiomegaly", "Effusion"]].tolist() == [1.0, 1.0]
    assert df.loc["00000001_000.png", nih.LABELS].sum() == 2
    assert df.loc["00000001_001.png", nih.LABELS].sum() == 0
    assert df.loc["00000002_000.png", "Hernia"] == 1.0


def test_read_labels_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("Image Index,Labels\nx.png,Hernia\n")
    with pytest.raises(nih.NIHError, match=r"bad\.csv.*missing column.*Finding Labels.*Patient ID"):
        nih.read_labels(bad)
    unknown = _csv(tmp_path, [("a.png", "Covid", "1")], "unknown.csv")
    with pytest.raises(nih.NIHError, match=r"unknown\.csv: line 2 \(Image Index a\.png\): unknown finding\(s\) \['Covid'\]"):
        nih.read_labels(unknown)
    dup = _csv(tmp_path, [("a.png", "Hernia", "1"), ("a.png", "Mass", "1")], "dup.csv")
    with pytest.raises(nih.NIHError, match="dup.csv.*duplicate"):
        nih.read_labels(dup)
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        nih.read_labels(tmp_path / "nope.csv")


@pytest.mark.parametrize("name", ["labels.csv", "labels.csv.gz"])
def test_a_bad_finding_is_named_by_its_line_and_image(tmp_path, name):
    """The line counts as a text editor does: past a blank line and a quoted field over two lines."""
    rows = [("00000001_000.png", "Hernia", "1"), ("00000002_000.png", "Mass", "2"),
            ("00000003_000.png", "Effusion|Covid", "3"), ("00000004_000.png", "Covid", "4")]
    text = _csv(tmp_path, rows).read_text().splitlines(keepends=True)
    text[1] = text[1].replace(",M,PA,", ',"M\nF",PA,')     # the first row spans lines 2-3
    text.insert(3, "\n")                                   # a blank line 5: the third row is on line 6
    path = tmp_path / name
    data = "".join(text).encode()
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert data.decode().splitlines()[5].startswith("00000003_000.png,")
    with pytest.raises(nih.NIHError) as exc:
        nih.read_labels(path)
    assert str(exc.value).startswith(f"{path}: line 6 (Image Index 00000003_000.png): unknown finding(s) ['Covid'] "
                                     "(and 1 more row(s) like it); known: ['Atelectasis'")
    data = data.replace(b"Effusion|Covid", b"Effusion").replace(b",Covid,", b",,")
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(nih.NIHError, match=r"line 7 \(Image Index 00000004_000\.png\): empty 'Finding Labels';"):
        nih.read_labels(path)


def test_real_label_csv_from_torchxrayvision():
    path = nih.find_label_csv()
    assert path.name == "Data_Entry_2017_v2020.csv.gz" and "torchxrayvision" in str(path)
    df = nih.read_labels(path)
    assert len(df) == 112_120
    assert df["patient"].nunique() == 30_805
    # the published content the split stage checks a release's tables against
    assert nih.PUBLISHED == nih.ReleaseCounts(n_images=len(df), n_patients=30_805, n_train_val=86_524, n_test=25_596)
    assert nih.PUBLISHED.n_train_val + nih.PUBLISHED.n_test == nih.PUBLISHED.n_images
    assert list(df.columns[1:]) == list(nih.LABELS)
    prevalence = df[list(nih.LABELS)].mean()
    assert prevalence["Infiltration"] == pytest.approx(0.1774, abs=0.001)
    assert prevalence["Hernia"] == pytest.approx(0.0020, abs=0.0005)
    assert (df[list(nih.LABELS)].sum(axis=1) == 0).mean() == pytest.approx(0.5384, abs=0.001)  # No Finding


def test_find_label_csv_without_torchxrayvision(monkeypatch):
    monkeypatch.setattr(nih.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="torchxrayvision is not installed"):
        nih.find_label_csv()


def test_read_split_list(tmp_path):
    p = tmp_path / "test_list.txt"
    p.write_text("a.png\nb.png\n\n")
    assert nih.read_split_list(p) == ["a.png", "b.png"]
    p.write_text("a.png\na.png\n")
    with pytest.raises(nih.NIHError, match="test_list.txt.*duplicate"):
        nih.read_split_list(p)


# --------------------------------------------------------------------------- splits

def _table(n_patients: int = 200, per: int = 3) -> pd.DataFrame:
    rows = [(f"{p:08d}_{k:03d}.png", "No Finding", str(p)) for p in range(1, n_patients + 1) for k in range(per)]
    df = pd.DataFrame(rows, columns=["Image Index", "Finding Labels", "Patient ID"])
    out = pd.DataFrame({"patient": df["Patient ID"].to_numpy()}, index=df["Image Index"].to_numpy())
    return out


def test_assign_splits_patient_wise_and_seeded():
    labels = _table()
    test = [i for i in labels.index if int(labels.loc[i, "patient"]) % 5 == 0]
    train_val = [i for i in labels.index if i not in set(test)]
    split = nih.assign_splits(labels, train_val, test, val_fraction=0.2, seed=1)
    assert set(split.index) == set(labels.index)
    assert (split.loc[test] == "test").all()
    per_patient = pd.DataFrame({"split": split, "patient": labels.loc[split.index, "patient"]})
    assert (per_patient.groupby("patient")["split"].nunique() == 1).all()
    n_val_patients = per_patient[per_patient.split == "val"]["patient"].nunique()
    assert n_val_patients == round(0.2 * 160)
    again = nih.assign_splits(labels, train_val, test, val_fraction=0.2, seed=1)
    assert again.equals(split)
    other = nih.assign_splits(labels, train_val, test, val_fraction=0.2, seed=2)
    assert not other.equals(split)
    assert (other.loc[test] == "test").all()


def test_assign_splits_errors():
    labels = _table(10, 2)
    names = list(labels.index)
    # patient 1 has one image in each list
    with pytest.raises(nih.NIHError, match="patient.*both.*'1'"):
        nih.assign_splits(labels, names[1:], names[:1], val_fraction=0.1, seed=0)
    with pytest.raises(nih.NIHError, match="in both train_val and test"):
        nih.assign_splits(labels, names, names[:2], val_fraction=0.1, seed=0)
    with pytest.raises(nih.NIHError, match="no label row.*ghost.png"):
        nih.assign_splits(labels, names + ["ghost.png"], [], val_fraction=0.1, seed=0)
    with pytest.raises(nih.NIHError, match="2 labelled image.*neither split list"):
        nih.assign_splits(labels, names[2:-2], names[:2], val_fraction=0.1, seed=0)
    split = nih.assign_splits(labels, names[2:], names[:2], val_fraction=0.1, seed=0)
    assert len(split) == 20
    loose = nih.assign_splits(labels, names[:-2], [], val_fraction=0.1, seed=0, strict=False)
    assert len(loose) == 18 and names[-1] not in loose.index


# --------------------------------------------------------------------------- archives

def _tar_gz(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with gzip.open(path, "wb") as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = kind, target
    return ti


def test_iter_archive_yields_pngs_and_rejects_unsafe_members(tmp_path):
    png = _png(np.full((4, 4), 7, np.uint8))
    d = tarfile.TarInfo("images")
    d.type = tarfile.DIRTYPE
    dev = tarfile.TarInfo("images/dev.png")
    dev.type = tarfile.CHRTYPE
    path = _tar_gz(tmp_path / "images_001.tar.gz", [
        (d, None),
        (_file("images/00000001_000.png"), png),
        (_file("../evil.png"), png),
        (_file("/abs/evil2.png"), png),
        (_link("images/link.png", "00000001_000.png"), None),         # symlink inside: still refused
        (_link("images/out.png", "../../etc/passwd"), None),
        (_link("images/hard.png", "images/00000001_000.png", tarfile.LNKTYPE), None),
        (dev, None),
        (_file("images/readme.txt"), b"hello"),
        (_file("images/00000002_000.png"), png),
    ])
    skipped: list[tuple[str, str]] = []
    got = list(nih.iter_archive(path, on_skip=lambda name, why: skipped.append((name, why))))
    assert [name for name, _ in got] == ["00000001_000.png", "00000002_000.png"]
    assert all(data == png for _, data in got)
    names = [name for name, _ in skipped]
    assert names == ["../evil.png", "/abs/evil2.png", "images/link.png", "images/out.png",
                     "images/hard.png", "images/dev.png"]
    assert "data" in dict(skipped)["../evil.png"]


def test_iter_archive_default_reports_via_logging(tmp_path, caplog):
    png = _png(np.zeros((2, 2), np.uint8))
    path = _tar_gz(tmp_path / "a.tar.gz", [(_file("../evil.png"), png), (_file("images/ok.png"), png)])
    with caplog.at_level(logging.WARNING, logger="chexflow.data.nih"):
        got = list(nih.iter_archive(path))
    assert [n for n, _ in got] == ["ok.png"]
    assert "../evil.png" in caplog.text


def test_iter_archive_truncated_and_corrupt(tmp_path):
    rng = np.random.default_rng(0)
    members = [(_file(f"images/{i:08d}_000.png"), _png(rng.integers(0, 255, (64, 64), dtype=np.uint8)))
               for i in range(5)]
    full = _tar_gz(tmp_path / "full.tar.gz", members).read_bytes()
    for cut in (len(full) // 2, len(full) - 4):  # mid-member; only the gzip trailer missing
        bad = tmp_path / f"images_cut{cut}.tar.gz"
        bad.write_bytes(full[:cut])
        with pytest.raises(nih.ArchiveError, match=f"images_cut{cut}.tar.gz"):
            list(nih.iter_archive(bad))
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not gzip at all")
    with pytest.raises(nih.ArchiveError, match="junk.tar.gz"):
        list(nih.iter_archive(junk))
    assert len(list(nih.iter_archive(tmp_path / "full.tar.gz"))) == 5
