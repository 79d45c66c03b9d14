"""AUROC by subgroup: sex, age band and view position, from the release's label table.

The table's rows (``Data_Entry_2017_v2020.csv``: Patient Gender, Patient Age, View Position; the
demo's phantoms carry the real rows' fields) are joined to the test predictions by image name, so the
fields reach evaluation without touching the split or the shards. Every value is checked: a sex other
than M/F, an age outside 0..MAX_AGE (the 2017 table had ages like 414) or a view other than PA/AP
puts the image in no group of that attribute ("unknown", counted).

A (subgroup, finding) gets a CI when at least ``min_count`` patients have a positive image of the
finding in the group and at least ``min_count`` patients a negative one: the bootstrap resamples
patients, so a cell of 7 positive images of one patient has one positive draw, not seven. A cell
below the rule shows its AUROC without a CI and says why (``intervals.too_few``: "too few: 1 positive / 53
negative patients (5 of each needed)"); the AUROC is
still shown where both classes occur. A patient with positive and negative images counts on both sides.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from chexflow.evaluate.config import EvaluateConfig
from chexflow.evaluate.intervals import too_few
from chexflow.evaluate.metrics import auroc_per_label, bootstrap_auroc
from chexflow.fsutil import read_regular

MAX_AGE = 120
COLUMNS = {"sex": "Patient Gender", "age": "Patient Age", "view": "View Position"}
# the same fields in the split table of a label-table dataset (chexflow.data.tables.split_frame): M / F,
# years, PA / AP / lateral (a lateral image is in no view group: the groups are PA and AP)
SPLIT_TABLE_COLUMNS = {"sex": "sex", "age": "age", "view": "view"}
SEXES = {"M": "male", "F": "female"}
VIEWS = ("PA", "AP")


class SubgroupError(ValueError):
    """The label table cannot give the subgroups; the message names the file and column."""


def age_band_names(edges: Sequence[int]) -> list[str]:
    """Names of the bands that ``edges`` (ascending) cut 0..MAX_AGE into: <18, 18-39, ..., >=80."""
    edges = list(edges)
    if edges != sorted(set(edges)) or not edges or edges[0] <= 0 or edges[-1] > MAX_AGE:
        raise SubgroupError(f"age band edges must be ascending, distinct, in 1..{MAX_AGE}, got {edges}")
    return [f"<{edges[0]}"] + [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f">={edges[-1]}"]


def read_fields(table: Path, images: Sequence[str], *, age_edges: Sequence[int]) -> pd.DataFrame:
    """Per image of ``images`` (in order): ``sex``, ``age_band``, ``view`` (None where unknown)."""
    table = Path(table)
    try:
        raw = pd.read_csv(io.BytesIO(read_regular(table, what="label table")), dtype=str, keep_default_na=False,
                          compression="gzip" if table.suffix == ".gz" else None)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, EOFError) as exc:
        raise SubgroupError(f"{table}: cannot read the label table ({exc})") from exc
    raw.columns = [c.strip() for c in raw.columns]
    if {"image", *SPLIT_TABLE_COLUMNS.values()} <= set(raw.columns):     # a label-table dataset's split table
        raw = raw.rename(columns={"image": "Image Index", **{SPLIT_TABLE_COLUMNS[k]: v for k, v in COLUMNS.items()}})
    missing = [c for c in ("Image Index", *COLUMNS.values()) if c not in raw.columns]
    if missing:
        raise SubgroupError(f"{table}: missing column(s) {missing} (needed for the subgroups)")
    raw = raw.drop_duplicates("Image Index").set_index("Image Index")
    absent = [i for i in images if i not in raw.index]
    if absent:
        raise SubgroupError(f"{table}: {len(absent)} test image(s) have no row, e.g. {absent[:3]}")
    rows = raw.loc[list(images)]
    age = pd.to_numeric(rows[COLUMNS["age"]].str.strip().str.rstrip("Y"), errors="coerce")
    age = age.where((age >= 0) & (age <= MAX_AGE))
    names = age_band_names(age_edges)
    band = pd.cut(age, bins=[-np.inf, *age_edges, np.inf], right=False, labels=names)
    return pd.DataFrame({
        "sex": rows[COLUMNS["sex"]].str.strip().map(SEXES).to_numpy(),
        "age_band": band.astype(object).where(band.notna(), None).to_numpy(),
        "view": rows[COLUMNS["view"]].str.strip().where(rows[COLUMNS["view"]].str.strip().isin(VIEWS)).to_numpy(),
    }, index=pd.Index(list(images), name="image")).astype(object).where(lambda d: d.notna(), None)


def from_table(cfg: EvaluateConfig, table: Path, images: Sequence[str], y: np.ndarray, s: np.ndarray,
               patients: Sequence[str], labels: Sequence[str]) -> tuple[pd.DataFrame, dict]:
    """The fields of ``images`` from the label ``table`` and metrics.json's ``subgroups`` of their predictions."""
    fields = read_fields(Path(table), images, age_edges=cfg.age_bands)
    groups = subgroup_aurocs(y, s, np.asarray(patients), labels, fields, age_edges=cfg.age_bands,
                             min_count=cfg.min_patients, n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    return fields, {"age_bands": list(cfg.age_bands), "min_count": cfg.min_patients, "groups": groups}


def subgroup_aurocs(y: np.ndarray, s: np.ndarray, patients: np.ndarray, labels: Sequence[str], fields: pd.DataFrame,
                    *, age_edges: Sequence[int], min_count: int, n_resamples: int, seed: int) -> list[dict]:
    """One entry per (attribute, group): images, patients, the mean AUROC over the findings with at
    least ``min_count`` positive and negative patients in the group (CI by patient bootstrap, the
    resamples where every one of them is defined), and per finding the AUROC with its CI or why there
    is none, with the positive and negative images and patients it rests on."""
    order = {"sex": list(SEXES.values()), "age_band": age_band_names(age_edges), "view": list(VIEWS)}
    out = []
    for attr, groups in order.items():
        values = fields[attr].to_numpy()
        for group in groups:
            sel = values == group
            out.append(_group(attr, group, y[sel], s[sel], patients[sel], labels, min_count, n_resamples, seed))
        out.append({"attribute": attr, "group": "unknown", "n_images": int(pd.isna(fields[attr]).sum()),
                    "n_patients": int(len(set(patients[pd.isna(fields[attr]).to_numpy()]))), "mean_auroc": None,
                    "mean_ci": None, "mean_labels": [], "labels": {},
                    "note": "not in any group (field missing or invalid)"})
    return out


def _group(attr: str, group: str, y: np.ndarray, s: np.ndarray, patients: np.ndarray, labels: Sequence[str],
           min_count: int, n_resamples: int, seed: int) -> dict:
    entry = {"attribute": attr, "group": group, "n_images": int(len(y)), "n_patients": int(len(set(patients))),
             "mean_auroc": None, "mean_ci": None, "mean_labels": [], "labels": {}, "note": ""}
    if len(y) == 0:
        entry["note"] = "no test image"
        return entry
    pos = np.sum(y == 1, axis=0)
    neg = np.sum(y == 0, axis=0)
    pos_pat = [np.unique(patients[y[:, j] == 1]).size for j in range(len(labels))]
    neg_pat = [np.unique(patients[y[:, j] == 0]).size for j in range(len(labels))]
    enough = [j for j in range(len(labels)) if pos_pat[j] >= min_count and neg_pat[j] >= min_count]
    point = auroc_per_label(y, s, list(labels))
    sub = [labels[j] for j in enough]
    boot = bootstrap_auroc(y[:, enough], s[:, enough], patients, sub, n_resamples=n_resamples,
                           seed=seed) if enough else None     # one bootstrap: the findings' CIs and the mean's
    for j, label in enumerate(labels):
        if j in enough:
            why = ""
        elif point[label] is None:
            why = "one class only"
        else:
            why = too_few(pos_pat[j], neg_pat[j], min_count)
        ci = boot["labels"][label]["ci"] if boot and not why else None
        entry["labels"][label] = {"auroc": point[label], "ci": ci, "n_pos": int(pos[j]), "n_neg": int(neg[j]),
                                  "n_pos_patients": int(pos_pat[j]), "n_neg_patients": int(neg_pat[j]), "note": why,
                                  "ci_resamples_dropped": boot["labels"][label]["n_skipped"] if ci else None}
    if boot:
        entry.update(mean_auroc=boot["mean_auroc"]["auroc"], mean_ci=boot["mean_auroc_ci"], mean_labels=sub)
    else:
        entry["note"] = f"too few for a CI: no finding has {min_count} positive and {min_count} negative patients"
    return entry
