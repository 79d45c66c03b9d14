"""Label-table datasets (``chexflow.data.tables``, ``chexpert``, ``csv_folder``) and the label map: the
uncertainty policy, views, the split, the audits' fields, and every refusal naming file, line and
column, on tables written here by hand; the readers against predict's."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from chexflow import config as C
from chexflow.data import chexpert, labelmap, nih, registry, shards, tables
from chexflow.data.config import ShardConfig, TableSpec
from chexflow.predict.files import Reader
from chexflow.settings import ConfigError, from_dict
from conftest import REPO
from folder_datasets import CSV_COLUMNS, jpeg, make_csv_folder, png, write_csv

FINDINGS = list(chexpert.LABELS)


@pytest.fixture(autouse=True)
def _no_declared_dataset_left():
    """A dataset declared by a test is undeclared after it (the registry is the process's)."""
    yield
    registry.declare({})


def _row(path: str, view: str = "Frontal", appa: str = "PA", sex: str = "Female", age: str = "50", **obs) -> dict:
    return {"Path": f"CheXpert-v1.0-small/{path}", "Sex": sex, "Age": age, "Frontal/Lateral": view, "AP/PA": appa,
            chexpert.NO_FINDING: "", **{f: obs.get(f.replace(" ", "_"), "") for f in FINDINGS}}


def _chexpert(root: Path, train: list[dict], valid: list[dict]) -> Path:
    for name, rows in (("train.csv", train), ("valid.csv", valid)):
        write_csv(root / name, chexpert.COLUMNS, rows)
    return root


def _cfg(**kw) -> ShardConfig:
    return ShardConfig(**{"dataset": "chexpert", "image_size": 16, "val_fraction": 0.5, "max_reject_fraction": 0.0,
                          "train_parts": 1, **kw})


# --------------------------------------------------------------------------- the policy

def test_uncertain_and_blank_become_targets_by_the_policy():
    """1 and 0 stay; -1 follows the finding's policy (its own entry, else default); a blank follows ``blank``."""
    obs = np.array([[1, 0, -1, np.nan],
                    [-1, -1, 0, 1],
                    [np.nan, np.nan, -1, -1]])
    names = ["A", "B", "C", "D"]
    got = tables.targets(obs, names, {"default": "zeros", "A": "ones", "C": "ignore"}, "negative")
    want = np.array([[1, 0, np.nan, 0],
                     [1, 0, 0, 1],
                     [0, 0, np.nan, 0]], np.float32)
    np.testing.assert_array_equal(got, want)       # NaN where unknown, compared as NaN
    got = tables.targets(obs, names, {"D": "ones"}, "ignore")      # no default: ignore
    want = np.array([[1, 0, np.nan, np.nan],
                     [np.nan, np.nan, 0, 1],
                     [np.nan, np.nan, np.nan, 1]], np.float32)
    np.testing.assert_array_equal(got, want)
    assert tables.resolve_policy(names, {"B": "ones"}) == {"A": "ignore", "B": "ones", "C": "ignore", "D": "ignore"}
    assert tables.policy_problems(names, {"default": "ones", "E": "zeros"}, "shards.x.uncertain") == [
        "shards.x.uncertain.E: not a finding of this dataset (its findings: A, B, C, D; 'default' covers the others)"]


def test_a_policy_naming_no_finding_or_no_policy_is_refused_before_any_job():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["datasets"]["chexpert"] = {"mirror": "/data/CheXpert-v1.0-small"}
    cfg["study"]["finetune_dataset"] = "chexpert"
    for policy, problem in (({"Atelectasis": "maybe"}, "shards.chexpert.uncertain.Atelectasis: 'maybe' is not one "
                                                      "of ['ones', 'zeros', 'ignore']"),
                            ({"Atelectasys": "ones"}, "shards.chexpert.uncertain.Atelectasys: not a finding of this "
                                                      f"dataset (its findings: {', '.join(chexpert.LABELS)}; 'default' "
                                                      "covers the others)")):
        cfg["shards"]["chexpert"] = {"image_size": 64, "uncertain": policy}
        with pytest.raises(ConfigError) as err:
            C.check_study(cfg)
        assert err.value.problems == [problem]


# --------------------------------------------------------------------------- CheXpert's tables

def test_chexpert_tables_targets_fields_and_split(tmp_path):
    """Targets by the policy, the patient from the path, sex/age/view for the audits (Age 0 and 90,
    Sex Unknown), laterals left out with views: frontal and kept as 'lateral' with all, valid.csv the
    test split, validation carved from train.csv by patient."""
    train = [_row("train/patient00001/study1/view1_frontal.jpg", Atelectasis="-1.0", Edema="-1.0", Cardiomegaly="1.0",
                  age="0", sex="Male"),
             _row("train/patient00001/study1/view2_lateral.jpg", view="Lateral", appa="", Atelectasis="1.0"),
             _row("train/patient00002/study1/view1_frontal.jpg", appa="AP", age="90", sex="Unknown", Edema="0.0"),
             _row("train/patient00003/study2/view1_frontal.jpg", appa="", Pleural_Effusion="1.0")]
    valid = [_row("valid/patient00004/study1/view1_frontal.jpg", Cardiomegaly="0.0", Edema="1.0")]
    raw = _chexpert(tmp_path, train, valid)
    cfg = _cfg(uncertain={"default": "ignore", "Atelectasis": "ones"}, blank="negative")
    t = chexpert.read_targets(raw / "train.csv", "train", cfg)
    first = t.iloc[0]
    assert first["image"] == "train/patient00001/study1/view1_frontal.jpg" and first["patient"] == "patient00001"
    assert (first["Atelectasis"], first["Cardiomegaly"], first["Pneumonia"]) == (1.0, 1.0, 0.0)   # U-Ones, 1, blank
    assert np.isnan(first["Edema"])                                                            # U-Ignore
    assert list(t["_line"]) == [2, 3, 4, 5]
    assert list(zip(t["sex"], t["age"], t["view"])) == [("M", "0", "PA"), ("F", "50", "lateral"), ("", "90", "AP"),
                                                         ("F", "50", "")]
    split = chexpert.ADAPTER.split(raw, cfg)
    assert "train/patient00001/study1/view2_lateral.jpg" not in set(split["image"])        # views: frontal
    assert split.set_index("image").loc["valid/patient00004/study1/view1_frontal.jpg", "split"] == "test"
    assert set(split["split"]) == {"train", "val", "test"} and split.groupby("patient")["split"].nunique().max() == 1
    both = chexpert.ADAPTER.split(raw, _cfg(views="all"))
    assert both.set_index("image").loc["train/patient00001/study1/view2_lateral.jpg", "view"] == "lateral"
    lab = chexpert.ADAPTER.labelling(cfg)
    assert lab["uncertain"]["Atelectasis"] == "ones" and lab["uncertain"]["Edema"] == "ignore"
    assert lab["views"] == "frontal" and any("valid.csv is the test split" in n for n in lab["notes"])


@pytest.mark.parametrize("change, where, problem", [
    ({"Path": "CheXpert-v1.0-small/train/../../../etc/passwd"}, "column 'Path'", "'..' in the image path"),
    ({"Path": "/etc/passwd"}, "column 'Path'", "'/etc/passwd': an absolute image path"),
    ({"Path": "CheXpert-v1.0-small/train/p2/x.png"}, "column 'Path'", "not in the CheXpert layout"),
    ({"Path": "CheXpert-v1.0-small/valid/patient00009/study1/view1_frontal.jpg"}, "column 'Path'",
     "is not under train/"),
    ({"Frontal/Lateral": "Lateral"}, "line 3 (CheXpert-v1.0-small/train/patient00002/study1/view1_frontal.jpg), "
     "column 'Frontal/Lateral'", "'Lateral' but the file name says otherwise"),
    ({"Edema": "2.0"}, "line 3 (CheXpert-v1.0-small/train/patient00002/study1/view1_frontal.jpg), column 'Edema'",
     "'2.0' is not an observation of 'Edema' (1, 0, -1 uncertain or blank)"),
    ({"Edema": "positive"}, "column 'Edema'", "'positive' is not an observation"),
])
def test_a_bad_row_is_refused_naming_file_line_and_column(tmp_path, change, where, problem):
    good = _row("train/patient00001/study1/view1_frontal.jpg")
    bad = {**_row("train/patient00002/study1/view1_frontal.jpg"), **change}
    raw = _chexpert(tmp_path, [good, bad], [_row("valid/patient00005/study1/view1_frontal.jpg")])
    with pytest.raises(tables.TableError) as err:
        chexpert.ADAPTER.split(raw, _cfg())
    msg = str(err.value)
    assert msg.startswith(f"{raw / 'train.csv'}: line 3") and where in msg and problem in msg, msg


def test_a_patient_in_train_and_valid_is_refused(tmp_path):
    raw = _chexpert(tmp_path, [_row("train/patient00001/study1/view1_frontal.jpg"),
                               _row("train/patient00002/study1/view1_frontal.jpg")],
                    [_row("valid/patient00002/study2/view1_frontal.jpg")])
    with pytest.raises(tables.TableError, match=r"patient 'patient00002' is in train.csv \(line 3, train/patient00002/"
                                                r"study1/view1_frontal.jpg\) and in valid.csv \(line 2, .*\), the test "
                                                r"split: a patient on both sides of the split"):
        chexpert.ADAPTER.split(raw, _cfg())


def test_missing_column_and_unreadable_table(tmp_path):
    (tmp_path / "train.csv").write_text("Path,Sex\nx,y\n")
    with pytest.raises(tables.TableError, match=r"train.csv: missing column\(s\) \['Age', 'Frontal/Lateral'"):
        chexpert.read(tmp_path / "train.csv", "train")
    (tmp_path / "train.csv").write_bytes(b"Path,Sex\n\xff\xfe,\n")
    with pytest.raises(tables.TableError, match="cannot read the CheXpert train as CSV"):
        chexpert.read(tmp_path / "train.csv", "train")
    # a record with a field too many or too few: pandas would shift or pad its cells
    for line in ("a,b,c", "a"):
        (tmp_path / "t.csv").write_text(f"x,y\n1,2\n\n{line}\n")
        with pytest.raises(tables.TableError, match=r"t.csv: line 4: \d fields, but the header names 2"):
            tables.read_table(tmp_path / "t.csv", ["x"])


# --------------------------------------------------------------------------- images under the folder

def test_image_files_inside_the_folder_only(tmp_path):
    """What a row's file turns out to be is a reject naming the table's line: missing, a link out of the
    folder, too large, not an image, an image declaring more pixels than allowed. A link inside the
    folder is read."""
    root = tmp_path / "CheXpert-v1.0-small"
    outside = tmp_path / "secret.jpg"
    img = np.tile(np.arange(32, dtype=np.uint8) * 8, (32, 1))
    outside.write_bytes(jpeg(img))
    rows = []
    for p, kind in enumerate(["ok", "link_out", "missing", "not_image", "huge", "link_in"], start=1):
        rel = f"train/patient{p:05d}/study1/view1_frontal.jpg"
        rows.append(_row(rel, Edema="1.0" if p % 2 else "0.0"))
        path = root / rel
        path.parent.mkdir(parents=True)
        if kind == "ok":
            path.write_bytes(jpeg(img))
        elif kind == "link_out":
            os.symlink(outside, path)
        elif kind == "not_image":
            path.write_bytes(b"GIF89a" + bytes(100))
        elif kind == "huge":
            path.write_bytes(png(np.zeros((1200, 1000), np.uint8)))     # 1.2 MP, above the 1 MP allowed below
        elif kind == "link_in":
            os.symlink(root / "train/patient00001/study1/view1_frontal.jpg", path)
    raw = _chexpert(tmp_path / "raw", rows, [_row("valid/patient00009/study1/view1_frontal.jpg")])
    (root / "valid/patient00009/study1").mkdir(parents=True)
    (root / "valid/patient00009/study1/view1_frontal.jpg").write_bytes(jpeg(img))
    cfg = _cfg(images=str(root), max_reject_fraction=1.0, max_image_megapixels=1.0, val_fraction=0.0)
    shards.split_dataset("chexpert", raw, cfg, tmp_path / "s/splits.csv")
    m = shards.write_part("chexpert", "train_001", raw, tmp_path / "s/splits.csv", tmp_path / "s/part", cfg)
    rejects = {r["image"]: r["reason"] for r in m["rejects"]}
    assert sum(s["count"] for s in m["shards"]) == 2                                 # ok and the link inside
    raw_csv = raw / "train.csv"
    assert rejects["train/patient00002/study1/view1_frontal.jpg"].startswith(f"{raw_csv}: line 3: a symbolic link "
                                                                             f"out of the image folder {root}")
    assert rejects["train/patient00003/study1/view1_frontal.jpg"].startswith(f"{raw_csv}: line 4: No such file")
    assert "not a PNG or JPEG" in rejects["train/patient00004/study1/view1_frontal.jpg"]
    assert "1.2 MP, more than the 1 MP allowed" in rejects["train/patient00005/study1/view1_frontal.jpg"]
    size = (root / "train/patient00001/study1/view1_frontal.jpg").stat().st_size
    with pytest.raises(OSError, match=rf"{size / 1e6:g} MB, more than max_member_mb \(1e-05 MB\); not read"):
        tables.image_file(root, "train/patient00001/study1/view1_frontal.jpg", 10)     # a file too large
    # with the default bound the first reject stops the part, naming the image and its line
    with pytest.raises(shards.ShardError, match="patient00002"):
        shards.write_part("chexpert", "train_001", raw, tmp_path / "s/splits.csv", tmp_path / "s/part2",
                          _cfg(images=str(root), val_fraction=0.0))


def test_shard_keys_of_paths_are_plain_and_distinct():
    keys = ["train/patient00001/study1/view1_frontal.jpg", "site one/p 1.png", "site_one/p_1.png", "a.b/c.d.png"]
    tar = [shards.tar_key(k) for k in keys]
    assert len(set(tar)) == len(tar) and all("." not in t and "/" not in t and " " not in t for t in tar)
    assert shards.tar_key("00000001_000.png") == "00000001_000"          # NIH's: as before


# --------------------------------------------------------------------------- CSV-described folders

def _declared(folder, **over) -> TableSpec:
    spec = from_dict(TableSpec, folder.declaration(**over))
    registry.declare({"hosp": spec})
    return spec


def test_csv_folder_reads_png_jpeg_and_dicom_as_predict_does(tmp_path):
    """Each format decodes to the pixels ``chexflow predict`` reads from the file; the audits' fields
    come from the declared columns ("90+" reads 90; LL is lateral, left out with views: frontal)."""
    folder = make_csv_folder(tmp_path, n_patients=6)
    spec = _declared(folder)
    cfg = ShardConfig(dataset="hosp", image_size=24, table=spec, images=str(folder.images))
    reader = Reader(cfg)
    for row in folder.rows[:3]:                    # PNG, JPEG, DICOM
        path = folder.images / row["file"]
        np.testing.assert_array_equal(tables.decode_any(path.read_bytes(), row["file"], cfg), reader.read(path)[0])
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "labels.csv").write_bytes(folder.table.read_bytes())
    split = registry.get("hosp").split(raw, cfg).set_index("image")
    assert list(split["split"]) == [r["subset"] for r in folder.rows if r["projection"] != "LL"]
    p1 = split.loc["site one/p001.jpg"]
    assert (p1["sex"], p1["age"], p1["view"], p1["patient"]) == ("F", "90", "AP", "B0001")
    assert split.loc["site2/p000.png", "age"] == "0"
    assert "site2/p004.png" not in split.index                    # LL
    assert registry.get("hosp").info().labels == ("Effusion", "Cardiomegaly", "Atelectasis", "Mass")


@pytest.mark.parametrize("edit, problem", [
    (lambda rows: rows[1].update(subset="val") or rows.append({**rows[1], "file": "site2/x.png", "subset": "test"}),
     r"patient 'B0001' is in more than one split: line 3 \(site one/p001.jpg\) in val; "
     r"line \d+ \(site2/x.png\) in test"),
    (lambda rows: rows[2].update(subset="holdout"), r"line 4 \(site2/p002.dcm\), column 'subset': 'holdout' is not one "
                                                    r"of \['train', 'val', 'test'\]"),
    (lambda rows: rows[2].update(projection=""), r"line 4 \(site2/p002.dcm\), column 'projection': '' is no view"),
    (lambda rows: rows[3].update(file="../outside.png"), r"line 5, column 'file': '../outside.png': '..' in the image"),
    (lambda rows: rows[3].update(file="C:/x.png"), r"line 5, column 'file': 'C:/x.png': an absolute image path"),
    (lambda rows: rows[3].update(patient_id=""), r"line 5 \(site one/p003.png\), column 'patient_id': no patient"),
    (lambda rows: rows.append(dict(rows[0])), r"line 8, column 'file': 'site2/p000.png' is listed twice"),
    (lambda rows: rows[0].update(effusion="yes"), r"line 2 \(site2/p000.png\), column 'effusion': 'yes' is not an "
                                                  r"observation of 'Effusion'"),
])
def test_csv_table_refusals_name_file_line_and_column(tmp_path, edit, problem):
    folder = make_csv_folder(tmp_path, n_patients=6)
    rows = [dict(r) for r in folder.rows]
    edit(rows)
    write_csv(folder.table, CSV_COLUMNS, rows)
    spec = _declared(folder)
    with pytest.raises(tables.TableError) as err:
        registry.get("hosp").split(folder.table.parent, ShardConfig(dataset="hosp", table=spec))
    assert str(err.value).startswith(f"{folder.table}: ") and pd.Series([str(err.value)]).str.contains(problem).all(), \
        str(err.value)


def test_csv_without_a_split_column_is_carved_by_patient(tmp_path):
    folder = make_csv_folder(tmp_path, n_patients=12)
    rows = [dict(r, patient_id=f"B{i // 2:04d}") for i, r in enumerate(folder.rows)]     # two images a patient
    write_csv(folder.table, CSV_COLUMNS, rows)
    spec = _declared(folder, columns={**folder.declaration()["columns"], "split": None})
    cfg = ShardConfig(dataset="hosp", table=spec, test_fraction=0.34, val_fraction=0.25, views="all")
    split = registry.get("hosp").split(folder.table.parent, cfg)
    assert len(split) == 12 and split.groupby("patient")["split"].nunique().max() == 1
    per = split.drop_duplicates("patient")["split"].value_counts()
    assert (per["test"], per["val"], per["train"]) == (2, 1, 3)        # round(0.34 * 6), round(0.25 * 4), the rest
    assert split.equals(registry.get("hosp").split(folder.table.parent, cfg))       # seeded
    assert "carved by patient" in registry.get("hosp").info().split_source


def test_csv_declarations_checked_before_any_job(tmp_path):
    folder = make_csv_folder(tmp_path, n_patients=6)
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["datasets"]["hosp"] = folder.declaration(columns={"image": "file", "patient": "patient_id"})
    cfg["datasets"]["other"] = {**folder.declaration(), "findings": {}, "columns": {"image": "file", "patient": "file"}}
    cfg["datasets"]["2bad"] = folder.declaration()
    cfg["datasets"]["nih"]["format"] = "csv"
    cfg["shards"]["hosp"] = {"image_size": 32, "views": "frontal"}
    cfg["shards"]["nih"]["images"] = "/elsewhere"
    with pytest.raises(ConfigError) as err:
        C.check_study(cfg)
    assert err.value.problems == [
        "datasets.nih.format: not allowed here (nih has archives, boxes, mirror)",
        "datasets.other.findings: name at least one finding and its column, e.g. {Effusion: effusion}",
        "datasets.other: column(s) ['file'] named for more than one use",
        "datasets.2bad: a dataset's name is letters, digits and _ (starting with a letter)",
        "shards.nih.images: not allowed here (set by the workflow: the section's name, datasets.<name> (archives, "
        "mirror, images, the table))",
        "shards.hosp.views: frontal needs datasets.hosp.columns.view (which rows are lateral); without a view column "
        "set views: all"]


# --------------------------------------------------------------------------- the label map

def test_label_map_between_nih_and_chexpert():
    m = labelmap.match(nih.LABELS, chexpert.LABELS)
    assert m.pairs == (("Atelectasis", "Atelectasis"), ("Cardiomegaly", "Cardiomegaly"),
                       ("Effusion", "Pleural Effusion"), ("Pneumonia", "Pneumonia"), ("Pneumothorax", "Pneumothorax"),
                       ("Consolidation", "Consolidation"), ("Edema", "Edema"))
    assert m.model_only == ("Infiltration", "Mass", "Nodule", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia")
    assert m.data_only == ("Enlarged Cardiomediastinum", "Lung Opacity", "Lung Lesion", "Pleural Other", "Fracture",
                           "Support Devices")
    assert [n[:2] for n in m.near] == [("Mass", "Lung Lesion"), ("Nodule", "Lung Lesion"),
                                       ("Infiltration", "Lung Opacity"), ("Pleural_Thickening", "Pleural Other")]
    # names compared without case, spaces, _ and -
    assert labelmap.match(["Pleural_Thickening", "pleural-effusion"], ["pleural thickening", "Effusion"]).pairs == (
        ("Pleural_Thickening", "pleural thickening"), ("pleural-effusion", "Effusion"))
    with pytest.raises(ValueError, match="matches \\['Effusion', 'Pleural Effusion'\\]"):
        labelmap.match(["Effusion"], ["Effusion", "Pleural Effusion"])


def test_external_validation_checked_before_any_job(tmp_path):
    folder = make_csv_folder(tmp_path, n_patients=6)
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["datasets"]["chexpert"] = {"mirror": "https://example.org/chexpert"}
    cfg["shards"]["chexpert"] = {"image_size": 64, "views": "all"}
    cfg["datasets"]["nofind"] = {**folder.declaration(), "findings": {"Tumour": "mass"}}
    cfg["shards"]["nofind"] = {"image_size": 64}
    cfg["evaluate"]["external"] = ["chexpert", "nofind", "nih_demo", "imagenet"]
    with pytest.raises(ConfigError) as err:
        C.check_study(cfg)
    assert err.value.problems == [
        "datasets.chexpert.mirror: 'https://example.org/chexpert': chexpert's images are read from a local folder, "
        "not a URL",
        "shards.chexpert.views: all would score lateral images with a model trained on frontal ones only (nih_demo): "
        "set frontal for evaluate.external[0]",
        "evaluate.external[1]: nofind shares no finding with nih_demo (['Tumour'] vs "
        f"{list(nih.LABELS)}; chexflow.data.labelmap lists the names that match)",
        "evaluate.external[2]: 'nih_demo' is not a dataset to test the fine-tuned model on (one of ['nih', 'chexpert', "
        "'nofind']: another fine-tuning dataset than study.finetune_dataset)",
        "evaluate.external[3]: 'imagenet' is not a dataset to test the fine-tuned model on (one of ['nih', 'chexpert', "
        "'nofind']: another fine-tuning dataset than study.finetune_dataset)"]
    cfg["datasets"]["chexpert"]["mirror"] = None
    cfg["shards"]["chexpert"]["views"] = "frontal"
    cfg["evaluate"]["external"] = ["chexpert"]
    with pytest.raises(ConfigError, match="datasets.chexpert.mirror: chexpert's images are read from its folder: "
                                          "set it"):
        C.check_study(cfg)
