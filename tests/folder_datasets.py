"""Label-table datasets generated for the tests: a CheXpert mirror in the layout Stanford ships
(``CheXpert-v1.0-small/``: train.csv, valid.csv, train/patientNNNNN/studyN/viewN_frontal.jpg) and a
CSV-described folder of PNG, JPEG and DICOM radiographs, both phantoms (``chexflow.data.phantoms``)
showing the findings their tables give, with the quirks of real tables: blanks, -1.0 (uncertain),
Age 0 and 90 / "90+", lateral views, Sex "Unknown", a path with a space.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

import dicom_files
from chexflow.data import chexpert, nih
from chexflow.data.phantoms.draw import render_phantom

# which NIH finding a phantom draws for an observation (the phantoms know NIH's 14)
DRAWN = {"Cardiomegaly": "Cardiomegaly", "Edema": "Edema", "Consolidation": "Consolidation", "Pneumonia": "Pneumonia",
         "Atelectasis": "Atelectasis", "Pneumothorax": "Pneumothorax", "Pleural Effusion": "Effusion",
         "Effusion": "Effusion", "Lung Lesion": "Mass", "Mass": "Mass", "Lung Opacity": "Infiltration"}


def phantom(findings: dict[str, float], seed: int, size: int) -> np.ndarray:
    """A phantom showing the positive ones of ``findings`` (observation names)."""
    values = np.zeros(len(nih.LABELS))
    for name, v in findings.items():
        if v == 1.0 and name in DRAWN:
            values[nih.LABELS.index(DRAWN[name])] = 1.0
    return render_phantom(values, size=size, rng=np.random.default_rng(seed))


def jpeg(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img, mode="L").save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def _cell(v: float) -> str:
    return "" if np.isnan(v) else f"{v:.1f}"


@dataclass(frozen=True)
class CheXpertMirror:
    root: Path                    # the CheXpert-v1.0-small folder (datasets.chexpert.mirror)
    rows: dict[str, list[dict]]   # table -> its rows as written (Path, Sex, ..., observations)


def make_chexpert(parent: Path, *, n_train: int = 24, n_valid: int = 8, size: int = 64, seed: int = 3,
                  lateral_every: int = 4) -> CheXpertMirror:
    """A CheXpert-v1.0-small mirror: ``n_train`` / ``n_valid`` patients of one or two studies each,
    a frontal image per study and a lateral one for every ``lateral_every``-th patient; observations
    drawn at random, each finding positive in both tables; valid.csv without uncertain or blank
    observations (as Stanford's, radiologists' consensus)."""
    rng = np.random.default_rng(seed)
    root = parent / "CheXpert-v1.0-small"
    rows: dict[str, list[dict]] = {"train": [], "valid": []}
    number = 0
    for table, n in (("train", n_train), ("valid", n_valid)):
        for p in range(n):
            number += 1
            patient = f"patient{number:05d}"
            for study in range(1, 2 + (p % 3 == 0)):
                obs = rng.choice([1.0, 0.0, -1.0, np.nan], p=[0.35, 0.35, 0.15, 0.15], size=len(chexpert.LABELS))
                if table == "valid":
                    obs = np.where(np.isnan(obs) | (obs == -1.0), 0.0, obs)
                obs[(p + study) % len(chexpert.LABELS)] = 1.0     # every finding positive somewhere
                obs[(p + study + 5) % len(chexpert.LABELS)] = 0.0
                findings = dict(zip(chexpert.LABELS, obs))
                views = ["frontal"] + (["lateral"] if p % lateral_every == 1 else [])
                for v, view in enumerate(views, start=1):
                    rel = f"{table}/{patient}/study{study}/view{v}_{view}.jpg"
                    img = phantom(findings, seed * 100_000 + number * 10 + study, size)
                    (root / rel).parent.mkdir(parents=True, exist_ok=True)
                    (root / rel).write_bytes(jpeg(img))
                    age = {0: "0", 1: "90"}.get(p % 7, str(20 + (p * 7) % 60))
                    rows[table].append({
                        "Path": f"CheXpert-v1.0-small/{rel}", "Sex": ("Male", "Female", "Unknown")[p % 3],
                        "Age": age, "Frontal/Lateral": view.capitalize(),
                        "AP/PA": ("AP", "PA")[p % 2] if view == "frontal" else "",
                        chexpert.NO_FINDING: "1.0" if not (obs == 1.0).any() else "",
                        **{label: _cell(v) for label, v in findings.items()}})
    for table, table_rows in rows.items():
        write_csv(root / f"{table}.csv", chexpert.COLUMNS, table_rows)
    return CheXpertMirror(root, rows)


def write_csv(path: Path, columns, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)


# --------------------------------------------------------------------------- a CSV-described folder

CSV_FINDINGS = {"Effusion": "effusion", "Cardiomegaly": "cardio", "Atelectasis": "atelectasis", "Mass": "mass"}
CSV_COLUMNS = ("file", "patient_id", "sex", "age_years", "projection", "subset", *CSV_FINDINGS.values())


@dataclass(frozen=True)
class CSVFolder:
    table: Path
    images: Path
    rows: list[dict]

    def declaration(self, **over) -> dict:
        """``datasets.<name>`` of this folder."""
        return {"format": "csv", "table": str(self.table), "images": str(self.images), "title": "Hospital B (phantoms)",
                "columns": {"image": "file", "patient": "patient_id", "sex": "sex", "age": "age_years",
                            "view": "projection", "split": "subset"},
                "findings": dict(CSV_FINDINGS), **over}


def make_csv_folder(parent: Path, *, n_patients: int = 12, size: int = 64, seed: int = 5) -> CSVFolder:
    """A folder of PNG, JPEG and DICOM phantoms (one image per patient and format in turn, a lateral
    every fifth) and its table: patients 0..n/4 in train, the next quarter in val, the rest in test;
    one folder name with a space; ages 0 and "90+"."""
    rng = np.random.default_rng(seed)
    images = parent / "images"
    rows = []
    for p in range(n_patients):
        obs = rng.choice([1.0, 0.0, -1.0, np.nan], p=[0.4, 0.4, 0.1, 0.1], size=len(CSV_FINDINGS))
        obs[p % len(CSV_FINDINGS)], obs[(p + 1) % len(CSV_FINDINGS)] = 1.0, 0.0
        findings = dict(zip(CSV_FINDINGS, obs))
        img = phantom(findings, seed * 1000 + p, size)
        kind = ("png", "jpg", "dcm")[p % 3]
        rel = f"{'site one' if p % 2 else 'site2'}/p{p:03d}.{kind}"
        (images / rel).parent.mkdir(parents=True, exist_ok=True)
        if kind == "dcm":
            dicom_files.plain(img, images / rel)
        else:
            (images / rel).write_bytes(png(img) if kind == "png" else jpeg(img))
        subset = "train" if p < n_patients // 4 else "val" if p < n_patients // 2 else "test"
        rows.append({"file": rel, "patient_id": f"B{p:04d}", "sex": ("M", "F")[p % 2],
                     "age_years": {0: "0", 1: "90+"}.get(p % 6, str(30 + p)),
                     "projection": "LL" if p % 5 == 4 else ("PA", "AP")[p % 2], "subset": subset,
                     **{col: _cell(v) for col, v in zip(CSV_FINDINGS.values(), obs)}})
    table = parent / "labels.csv"
    write_csv(table, CSV_COLUMNS, rows)
    return CSVFolder(table, images, rows)
