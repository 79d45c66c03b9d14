"""Your own radiographs, all the way: docs/datasets.md's CSV example run as written (its paths pointed at a
hospital export generated here) by Snakemake to the shards, a model fine-tuned and evaluated on them, and
that model predicting and exporting from its model file alone in fresh ``chexflow`` processes that know no
declaration. The export has what hospitals export: a split column of train and test only, DICOM ages
("045Y"), an age that is none, a missing image file, PNG, JPEG and DICOM, a folder with a space, a lateral
every fifth patient. Besides, fast: ages as hospitals write them, the carving of validation out of train,
refusals that name the user's file and key, config.yaml's commented examples."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from chexflow import config as C
from chexflow.data import registry, tables
from chexflow.data.config import ShardConfig, TableSpec
from chexflow.evaluate import run as evaluate
from chexflow.evaluate.config import EvaluateConfig
from chexflow.report.run_view import release_text
from chexflow.settings import ConfigError, from_dict
from chexflow.train import trainer as T
from chexflow.train.backends import Backend
from chexflow.train.checkpoint import load_model_file
from chexflow.train.config import TrainConfig
from conftest import REPO, cli_env, module_scratch, snakemake
from folder_datasets import CSV_COLUMNS, make_csv_folder, write_csv
from test_distributed import train_cfg

# the columns of docs/datasets.md's example <- those make_csv_folder writes
DOCS_NAMES = {"file": "path", "patient_id": "patient_id", "sex": "sex", "age_years": "age", "projection": "view",
              "subset": "split", "effusion": "effusion", "cardio": "cardiomegaly"}
N_PATIENTS = 36          # one image each: 0..17 train (val in make_csv_folder's table made train), 18..35 test
AGES = {3: "045Y", 5: "006M", 7: "abc"}     # patient -> the age the export holds


def docs_block(heading: str) -> str:
    """The first ```yaml block after ``heading`` in docs/datasets.md."""
    text = (REPO / "docs/datasets.md").read_text()
    return text.split(heading, 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]


def hospital_export(root: Path) -> tuple[Path, Path, list[dict], int]:
    """A hospital's export in the docs' column names: the table, the image folder, its rows and the
    patient whose image file is missing (a train patient: the two carved for validation, found here by
    the split's own seeded carving, are given one Effusion positive and one negative, so that validation
    has a defined AUROC)."""
    folder = make_csv_folder(root, n_patients=N_PATIENTS, size=64)
    rows = []
    for p, r in enumerate(folder.rows):
        r = {**r, "subset": "test" if r["subset"] == "test" else "train", "age_years": AGES.get(p, r["age_years"])}
        rows.append({DOCS_NAMES[k]: v for k, v in r.items() if k in DOCS_NAMES})
    train = sorted(r["patient_id"] for r in rows if r["split"] == "train" and r["view"] != "LL")
    val = sorted(tables.carve(train, 0.1, 0))
    for patient, cell in zip(val, ("1.0", "0.0")):
        next(r for r in rows if r["patient_id"] == patient)["effusion"] = cell
    missing = next(p for p, r in enumerate(rows) if r["patient_id"] in set(train) - set(val) and p not in AGES)
    (folder.images / folder.rows[missing]["file"]).unlink()
    table = root / "export" / "labels.csv"
    write_csv(table, list(DOCS_NAMES.values()), rows)
    folder.table.unlink()
    return table, folder.images, rows, missing


def example_with(table: Path, images: Path) -> dict:
    """docs/datasets.md's CSV example with its two paths pointed at ``table`` and ``images``."""
    example = yaml.safe_load(docs_block("## Your own radiographs: a CSV-described folder"))
    assert example["datasets"]["hospital_b"]["table"] == "/data/hospital_b/labels.csv"
    example["datasets"]["hospital_b"].update(table=str(table), images=str(images))
    return example


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """A fresh ``chexflow`` process: it declares nothing, so it knows no CSV dataset."""
    proc = subprocess.run([sys.executable, "-m", "chexflow", *args], env=cli_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.fixture(scope="module")
def chain(tmp_path_factory, request):
    with module_scratch(tmp_path_factory, request, "csv_chain") as root:
        table, images, rows, missing = hospital_export(root)
        work = root / "work"
        work.mkdir()
        shutil.copy(REPO / "config.yaml", work / "config.yaml")           # the checkout's, as a user has it
        (work / "example.yaml").write_text(yaml.safe_dump(example_with(table, images), sort_keys=False))
        proc = snakemake(work, "data/shards/hospital_b/manifest.json", "--configfile", str(work / "example.yaml"))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        manifest = work / "data/shards/hospital_b/manifest.json"
        cfg = from_dict(TrainConfig, train_cfg("single", epochs=1, dataset="hospital_b", seed=1,
                                               checkpoint={"every_steps": 100}))
        paths = T.TrainPaths(manifest=manifest, out_dir=root / "finetune", ckpt_dir=root / "finetune" / "ckpt")
        assert T.Trainer(cfg, paths, Backend()).fit() == 0
        evaluate.run(EvaluateConfig(batch_size=16, bootstrap_resamples=20), model_path=root / "finetune/model.pt",
                     manifest=manifest, out_dir=root / "evaluate", heatmaps=False,
                     label_table=work / "data/shards/hospital_b/splits.csv")
        yield {"root": root, "work": work, "table": table, "images": images, "rows": rows, "manifest": manifest,
               "model": root / "evaluate/model.pt", "missing": missing}


@pytest.mark.slow
def test_docs_csv_example_runs_as_written_to_shards(chain):
    """The split column's train and test get val carved out of train by patient; DICOM ages read, the one
    that is none named in the split log; one missing file of 30 is a reject the default limit lets pass."""
    work, rows = chain["work"], chain["rows"]
    split_log = (work / "logs/shards/hospital_b/split.log").read_text()
    frontal_train = {r["patient_id"] for r in rows if r["split"] == "train" and r["view"] != "LL"}
    n_val = int(round(0.1 * len(frontal_train)))          # shards' default val_fraction of 15 patients: 2
    assert (len(frontal_train), n_val) == (15, 2)
    assert (f"hospital_b: column 'split' of {chain['table']} has no 'val' rows: {n_val} of 15 train patients "
            "carved out for validation by patient (val_fraction 0.1, split_seed 0)") in split_log
    assert (f"hospital_b: 1 age(s) not read in {chain['table']}, column 'age' (first: 'abc' on line "
            f"{7 + 2})") in split_log
    splits = pd.read_csv(work / "data/shards/hospital_b/splits.csv", dtype=str, keep_default_na=False)
    assert splits.groupby("patient")["split"].nunique().max() == 1
    per = splits.drop_duplicates("patient")["split"].value_counts().to_dict()
    assert per == {"train": 15 - n_val, "val": n_val, "test": 18 - 4}       # 4 test patients' images are lateral
    age = dict(zip(splits["patient"], splits["age"]))
    assert (age["B0003"], age["B0005"], age["B0007"]) == ("45", "0.5", "")
    m = json.loads(chain["manifest"].read_text())
    assert m["n_rejects"] == 1 and m["labels"] == ["Effusion", "Cardiomegaly"]
    assert sum(s["n_images"] for s in m["splits"].values()) == len(splits) - 1
    # what the report and the model card say of the release: the rejected image is not counted as used
    n = len(splits)
    assert (m["coverage"]["n_found"], m["coverage"]["n_rejected"], m["coverage"]["n_used"]) == (n, 1, n - 1)
    assert release_text(m) == f"{n - 1} of {n} listed images, 1 rejected, read from the image folder by 1 shard job(s)"
    part_log = (work / "logs/shards/hospital_b/part_001.log").read_text()
    assert f"{chain['table']}: line {chain['missing'] + 2}" in part_log and rows[chain["missing"]]["path"] in part_log


@pytest.mark.slow
def test_a_model_of_a_csv_dataset_predicts_and_exports_from_its_model_file_alone(chain, tmp_path):
    """``chexflow predict`` in a process that knows no hospital_b: the record's decoding reads the test
    split's PNG, JPEG and DICOM files to evaluation's probabilities; ``chexflow export`` checks its file."""
    info = load_model_file(chain["model"])
    assert (info["dataset"], info["predict"]["decoding"]) == ("hospital_b", "grey")
    assert info["labels"] == ["Effusion", "Cardiomegaly"]
    evaluation = pd.read_csv(chain["root"] / "evaluate/predictions.csv").set_index("image")
    files = [chain["images"] / name for name in evaluation.index]
    assert {f.suffix for f in files} == {".png", ".jpg", ".dcm"}
    run_cli("predict", "--config-json", json.dumps({"workers": 0}), "--model", str(chain["model"]),
            "--out", str(tmp_path / "pred.csv"), *map(str, files))
    pred = pd.read_csv(tmp_path / "pred.csv", keep_default_na=False)
    assert (pred["error"] == "").all() and len(pred) == len(files)
    for label in info["labels"]:
        got = pred[f"{label}_score"].astype(float).to_numpy()
        np.testing.assert_allclose(got, evaluation[f"{label}_score"].to_numpy(), rtol=0, atol=2e-5)
    out = tmp_path / "export"
    run_cli("export", "--config-json", json.dumps({"formats": ["torchscript"], "check_images": 4}),
            "--model", str(chain["model"]), "--manifest", str(chain["manifest"]), "--out-dir", str(out))
    summary = json.loads((out / "export.json").read_text())
    assert summary["metadata"]["decoding"] == "grey" and summary["metadata"]["dataset"] == "hospital_b"
    assert summary["exports"]["torchscript"]["max_abs_diff"]["batch_1"] <= 1e-4


@pytest.mark.slow
def test_a_model_file_naming_a_decoding_this_chexflow_lacks_is_refused(chain, tmp_path):
    info = load_model_file(chain["model"])
    torch.save({**info, "predict": {**info["predict"], "decoding": "bmp"}}, tmp_path / "model.pt")
    proc = subprocess.run([sys.executable, "-m", "chexflow", "predict", "--model", str(tmp_path / "model.pt"),
                           "--out", str(tmp_path / "p.csv"), str(chain["images"])], env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and not (tmp_path / "p.csv").exists()
    assert f"{tmp_path / 'model.pt'}: refused: predict.decoding 'bmp' is not a way of reading image files" \
        in proc.stderr


# --------------------------------------------------------------------------- fast: the pieces

def test_ages_as_hospitals_write_them():
    cells = pd.Series(["45", "045Y", "006M", "052W", "014D", "90+", " 61 ", "45.5", "abc", "", "121", "-3", "+",
                       "45 years", "045y"])
    assert list(tables.ages(cells)) == ["45", "45", "0.5", "1", "0.04", "90", "61", "45.5", "", "", "", "", "", "",
                                        "45"]
    lines = pd.Series(range(2, 2 + len(cells)))
    assert tables.unread_ages(cells, tables.ages(cells), lines, "t.csv", "age", "hb") == (
        "hb: 5 age(s) not read in t.csv, column 'age' (first: 'abc' on line 10): in no age group; an age is "
        f"{tables.AGE_FORMATS}, 0 to 120 years")
    assert tables.unread_ages(cells[:3], tables.ages(cells[:3]), lines, "t.csv", "age", "hb") is None


def _declare(folder, **over) -> TableSpec:
    spec = from_dict(TableSpec, folder.declaration(**over))
    registry.declare({"hosp": spec})
    return spec


def test_validation_carved_from_train_of_a_train_test_column(tmp_path, capsys):
    folder = make_csv_folder(tmp_path, n_patients=12)
    rows = [dict(r, subset="train" if r["subset"] != "test" else "test") for r in folder.rows]
    write_csv(folder.table, CSV_COLUMNS, rows)
    cfg = ShardConfig(dataset="hosp", table=_declare(folder), views="all", val_fraction=0.34)
    split = registry.get("hosp").split(folder.table.parent, cfg)
    per = split.drop_duplicates("patient")["split"].value_counts().to_dict()
    assert per == {"test": 6, "val": 2, "train": 4}        # round(0.34 * 6) of the 6 train patients
    assert set(split.loc[split["split"] == "test", "patient"]) == {r["patient_id"] for r in rows[6:]}
    assert "has no 'val' rows: 2 of 6 train patients carved out" in capsys.readouterr().out
    assert split.equals(registry.get("hosp").split(folder.table.parent, cfg))         # seeded
    one = [dict(r, subset="test") for r in rows[1:]] + [rows[0]]                    # one train patient
    write_csv(folder.table, CSV_COLUMNS, one)
    with pytest.raises(tables.TableError, match=rf"^{re.escape(str(folder.table))}: column 'subset' has no 'val' "
                                                r"rows and its 1 train patient\(s\) leave none to carve"):
        registry.get("hosp").split(folder.table.parent, cfg)
    write_csv(folder.table, CSV_COLUMNS, [dict(r, subset="test") for r in rows])   # an external test set only
    assert set(registry.get("hosp").split(folder.table.parent, cfg)["split"]) == {"test"}


def test_refusals_name_the_users_table_and_key(tmp_path):
    """A bad row names the table the declaration gives, not its copy under data/raw/; a missing table, a
    FIFO and a file given as the image folder are refused before any job, naming the key."""
    folder = make_csv_folder(tmp_path, n_patients=6)
    rows = [dict(r) for r in folder.rows]
    rows[2]["effusion"] = "yes"
    write_csv(folder.table, CSV_COLUMNS, rows)
    raw = tmp_path / "data/raw/hosp"
    raw.mkdir(parents=True)
    shutil.copy(folder.table, raw / "labels.csv")
    spec = _declare(folder)
    with pytest.raises(tables.TableError) as err:
        registry.get("hosp").split(raw, ShardConfig(dataset="hosp", table=spec))
    assert str(err.value).startswith(f"{folder.table}: line 4 (site2/p002.dcm), column 'effusion': 'yes'")
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["datasets"]["gone"] = folder.declaration(table=str(tmp_path / "gone.csv"))
    cfg["datasets"]["pipe"] = folder.declaration(table=str(fifo), images=str(folder.table))
    with pytest.raises(ConfigError) as err:
        C.check_study(cfg)
    assert err.value.problems == [
        f"datasets.gone.table: {tmp_path / 'gone.csv'}: No such file or directory",
        f"datasets.pipe.table: {fifo}: a FIFO (named pipe), not a regular file",
        f"datasets.pipe.images: {folder.table}: a regular file, not a folder"]
    assert not any("mirror" in p for p in err.value.problems)


def uncommented(text: str) -> str:
    """config.yaml with its commented examples made live: a comment starting ``chexpert:``, ``hospital_b:``
    or ``external:``, and the comment lines after it that go on more deeply indented."""
    lines, live = [], False
    for line in text.splitlines():
        m = re.match(r"^(\s*)# (.*)$", line)
        key = bool(m) and re.match(r"(chexpert|hospital_b|external):", m.group(2)) is not None
        live = bool(m) and (key or (live and m.group(2).startswith("  ")))
        lines.append(m.group(1) + m.group(2) if live else line)
    return "\n".join(lines)


def test_config_yaml_carries_commented_chexpert_csv_and_external_examples(tmp_path):
    """Uncommented, config.yaml's examples are a study that passes every check (paths pointed here)."""
    from folder_datasets import make_chexpert
    cfg = yaml.safe_load(uncommented((REPO / "config.yaml").read_text()))
    assert cfg["datasets"]["hospital_b"]["format"] == "csv" and cfg["evaluate"]["external"] == ["chexpert"]
    assert set(cfg["shards"]["hospital_b"]) >= {"max_member_mb", "max_image_megapixels", "max_reject_fraction"}
    assert set(cfg["shards"]["chexpert"]) >= {"uncertain", "views", "train_parts"}
    folder = make_csv_folder(tmp_path / "hb", n_patients=6)
    table = tmp_path / "hb/labels_docs.csv"
    write_csv(table, list(DOCS_NAMES.values()), [{DOCS_NAMES[k]: v for k, v in r.items() if k in DOCS_NAMES}
                                                 for r in folder.rows])
    cfg["datasets"]["hospital_b"].update(table=str(table), images=str(folder.images))
    cfg["datasets"]["chexpert"]["mirror"] = str(make_chexpert(tmp_path / "cx", n_train=2, n_valid=1).root)
    study = C.check_study(cfg)
    assert study.evaluate.external == ("chexpert",) and study.tables["hospital_b"].findings == {"Effusion": "effusion"}


def test_an_external_test_set_shards_its_test_split_only(tmp_path, capsys):
    """A dataset only evaluate.external uses: CheXpert gets valid.csv's shard job alone, a CSV folder one
    job, and the split keeps their test rows (what the external validation scores), nothing else."""
    from folder_datasets import make_chexpert
    mirror = make_chexpert(tmp_path / "cx", n_train=6, n_valid=3, lateral_every=100)
    folder = make_csv_folder(tmp_path / "hb", n_patients=12)
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["datasets"].update(chexpert={"mirror": str(mirror.root)}, hosp=folder.declaration())
    cfg["shards"].update(chexpert={"image_size": 32, "train_parts": 4}, hosp={"image_size": 32, "train_parts": 3})
    cfg["evaluate"]["external"] = ["chexpert", "hosp"]
    study = C.check_study(cfg)
    chexpert_cfg, hosp_cfg = study.shards["chexpert"], study.shards["hosp"]
    assert chexpert_cfg.test_only and hosp_cfg.test_only and C.folder_settings(study, "hosp")["test_only"]
    assert registry.get("chexpert").parts(chexpert_cfg) == ["valid"]
    assert registry.get("hosp").parts(hosp_cfg) == ["part_001"]
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("train.csv", "valid.csv"):
        shutil.copy(mirror.root / name, raw / name)
    split = registry.get("chexpert").split(raw, chexpert_cfg)
    assert set(split["split"]) == {"test"} and len(split) == sum(r["Frontal/Lateral"] == "Frontal"
                                                                  for r in mirror.rows["valid"])
    split = registry.get("hosp").split(folder.table.parent, hosp_cfg)
    test_rows = [r for r in folder.rows if r["subset"] == "test" and r["projection"] != "LL"]
    assert sorted(split["image"]) == sorted(r["file"] for r in test_rows) and set(split["split"]) == {"test"}
    assert "an external test set (evaluate.external)" in capsys.readouterr().out
    cfg["shards"]["hosp"]["test_only"] = True                      # the workflow's to set, not the user's
    with pytest.raises(ConfigError, match=r"shards\.hosp\.test_only: not allowed here \(set by the workflow"):
        C.check_study(cfg)
    cfg["shards"]["hosp"].pop("test_only")
    cfg["evaluate"]["external"] = ["chexpert"]                     # fine-tuning data: every split sharded
    cfg["study"]["finetune_dataset"] = "hosp"
    study = C.check_study(cfg)
    assert not study.shards["hosp"].test_only and registry.get("hosp").parts(study.shards["hosp"]) == [
        "part_001", "part_002", "part_003"]
