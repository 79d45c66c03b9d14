"""The evaluation's records, ``metrics.json`` and ``predictions.csv``: one format each, the operating
point evaluation chooses per finding, and the readers every consumer (the report, the studies) goes
through.

One format, the one ``evaluate.run`` writes: per finding ``ci`` is ``[low, high]`` or null; the
mean's CI is ``bootstrap.mean_auroc_ci``. A finding's operating point is the evaluation's decision,
recorded with the split its threshold was chosen on (``operating_point_split``):

* ``"validation"``: Youden's J on the validation predictions (``threshold_val_youden``), applied to
  test (``test_operating_point``; with one class in test, the rates it cannot measure are null); the
  threshold the predict stage uses;
* ``"test"``: the fallback when validation holds one class of the finding but test holds both: the
  Youden threshold of the test predictions themselves. It is optimistic (chosen and measured on the
  same images) and is never written as ``threshold_val_youden``, so nothing downstream applies it;
* no key (no operating point): one class in validation and in test.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
import pandas as pd

from chexflow import host
from chexflow.evaluate.metrics import operating_point, youden_threshold
from chexflow.fsutil import atomic_path, open_regular, read_json

Split = Literal["validation", "test"]
SPLITS: tuple[Split, ...] = ("validation", "test")


class OperatingPoint(TypedDict, total=False):
    """A finding's operating point as ``metrics.json`` records it (keys absent: none chosen)."""
    threshold_val_youden: float
    test_operating_point: dict[str, Any]      # metrics.operating_point on the test split
    operating_point_split: Split


class LabelRecord(TypedDict, total=False):
    """One finding of ``metrics.json`` ``labels``; absent when undefined: the AUPRC, prevalence and
    calibration (one class in test), the operating point (see the module)."""
    auroc: float | None
    ci: list[float] | None                    # [low, high] of the patient bootstrap, or null
    n_pos: int
    n_neg: int
    n_pos_patients: int
    n_neg_patients: int
    too_few: str | None                       # the small-count rule's words (intervals.too_few): ci withheld
    ci_resamples_dropped: int                 # bootstrap resamples with one class of the finding
    vs_chance: str | None                     # the CI against 0.5: above, includes, below (intervals.against_chance)
    chexnet: float | None
    auprc: float
    prevalence: float
    calibration: dict[str, Any]
    score_intervals: dict[str, Any] | None    # intervals.score_intervals: AUPRC, Brier, ECE (None: too few)
    val_positives: int
    val_positive_patients: int
    threshold_few_positives: bool             # a validation threshold on few positives
    threshold_val_youden: float
    test_operating_point: dict[str, Any]
    test_operating_point_intervals: dict[str, Any]    # intervals.operating_point_intervals
    operating_point_split: Split


class MetricsRecordError(ValueError):
    """A metrics.json that is not the evaluation's record (names the file and the key)."""


def choose_operating_point(val_y: np.ndarray, val_s: np.ndarray, test_y: np.ndarray,
                           test_s: np.ndarray) -> OperatingPoint:
    """The operating point of one finding (arrays of known labels only): chosen on validation when
    it holds both classes (whatever the test split holds: its threshold is valid either way), else on
    test when test holds both (the documented, optimistic fallback); none otherwise."""
    if np.unique(val_y).size == 2:
        thr = youden_threshold(val_y, val_s)
        on_test = operating_point(test_y, test_s, thr) if test_y.size else {    # no known test label: nothing measured
            "threshold": float(thr), **dict.fromkeys(("sensitivity", "specificity", "ppv", "npv", "f1")),
            **dict.fromkeys(("tp", "fp", "tn", "fn"), 0)}
        return {"threshold_val_youden": float(thr), "test_operating_point": on_test,
                "operating_point_split": "validation"}
    if np.unique(test_y).size < 2:
        return {}
    thr = youden_threshold(test_y, test_s)
    return {"test_operating_point": operating_point(test_y, test_s, thr), "operating_point_split": "test"}


# --------------------------------------------------------------------------- reading
def _number(value: Any, path: Path, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetricsRecordError(f"{path}: {key} must be a number or null, got {value!r}")
    return None if math.isnan(float(value)) else float(value)


def _ci(value: Any, path: Path, key: str) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise MetricsRecordError(f"{path}: {key} must be [low, high] or null, got {value!r}")
    pair = [_number(v, path, key) for v in value]
    return None if None in pair else pair


def _check_label(label: str, entry: Any, path: Path) -> None:
    where = f"labels[{label!r}]"
    if not isinstance(entry, dict):
        raise MetricsRecordError(f"{path}: {where} must be an object")
    for key in ("auroc", "ci"):
        if key not in entry:
            raise MetricsRecordError(f"{path}: {where} has no {key!r} key (the evaluation writes 'auroc' and "
                                     "'ci': [low, high] or null)")
    entry["auroc"] = _number(entry["auroc"], path, f"{where}.auroc")
    entry["ci"] = _ci(entry["ci"], path, f"{where}.ci")
    op, split = entry.get("test_operating_point"), entry.get("operating_point_split")
    if op is not None and not isinstance(op, dict):
        raise MetricsRecordError(f"{path}: {where}.test_operating_point must be an object")
    if (op is None) != (split is None) or (split is not None and split not in SPLITS):
        raise MetricsRecordError(f"{path}: {where}: an operating point names the split its threshold was chosen on "
                                 f"(operating_point_split: one of {list(SPLITS)}), got {split!r}")
    if split == "validation" and "threshold_val_youden" not in entry:
        raise MetricsRecordError(f"{path}: {where}: a validation operating point needs threshold_val_youden")


def read_metrics(path: Path) -> dict[str, Any]:
    """``metrics.json`` checked against the evaluation's format (the record as written, numbers as
    float or None); anything else fails naming the file and the key."""
    data = read_json(path, MetricsRecordError, what="metrics.json", kind="an evaluation's metrics.json")
    for key in ("labels", "mean_auroc", "n_images", "n_patients", "bootstrap"):
        if key not in data:
            raise MetricsRecordError(f"{path}: missing key {key!r}")
    if not isinstance(data["labels"], dict) or not data["labels"]:
        raise MetricsRecordError(f"{path}: 'labels' must be a non-empty object label -> {{auroc, ci, ...}}")
    for label, entry in data["labels"].items():
        _check_label(label, entry, path)
    boot = data["bootstrap"]
    if not isinstance(boot, dict) or "mean_auroc_ci" not in boot:
        raise MetricsRecordError(f"{path}: bootstrap must be an object with mean_auroc_ci ([low, high] or null)")
    boot["mean_auroc_ci"] = _ci(boot["mean_auroc_ci"], path, "bootstrap.mean_auroc_ci")
    data["mean_auroc"] = _number(data["mean_auroc"], path, "mean_auroc")
    data["model_val_metric"] = _number(data.get("model_val_metric"), path, "model_val_metric")
    for key in ("subgroups", "localisation", "underdiagnosis"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise MetricsRecordError(f"{path}: {key} must be an object")
    epoch = data.get("model_epoch")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise MetricsRecordError(f"{path}: model_epoch must be an integer, got {epoch!r}")
    for key in ("host", "training_host"):      # where it was measured (None or absent: not recorded)
        problems = [] if data.get(key) is None else host.problems(data[key])
        if problems:
            raise MetricsRecordError(f"{path}: {key}: {'; '.join(problems)}")
    return data


# A predictions table's floats as written: the scores are float32 (the model's sigmoid), and 9 significant
# digits write every float32 so that it reads back as itself (FLT_DECIMAL_DIG). Anything recomputed from the
# file (a finding's AUROC, a score's side of a threshold) is then what the evaluation computed from the
# scores themselves; with 6 digits, near-equal scores became ties and moved a tiny model's AUROC by 2e-4.
FLOAT_FORMAT = "%.9g"


def write_csv(path: Path, rows: pd.DataFrame | list[dict], columns: tuple[str, ...] | None = None, *,
              float_format: str = "%.6g") -> None:
    """A table (a frame, or rows; ``columns``: their order) to ``path`` as CSV: complete or absent."""
    with atomic_path(Path(path)) as tmp:
        pd.DataFrame(rows, columns=columns).to_csv(tmp, index=False, float_format=float_format)


def write_predictions(path: Path, table: pd.DataFrame) -> None:
    """A predictions table (evaluation's, external validation's, predict's) to ``path``: complete or absent."""
    write_csv(path, table, float_format=FLOAT_FORMAT)


class PredictionsRecordError(ValueError):
    """A predictions.csv that is not the evaluation's (names the file and the column)."""


def read_predictions(path: Path, labels: list[str]) -> pd.DataFrame:
    """``predictions.csv`` as ``evaluate.run`` writes it: image, patient, then per label ``L`` (0/1/empty)
    and ``L_score`` (a probability in [0, 1]), one row per image; anything else fails naming the file, the
    column and the first row that breaks it (an AUROC is a ranking and takes any score, a calibration curve
    and a Brier score do not). The scores come back as the float32 values the evaluation computed
    (:data:`FLOAT_FORMAT`), bit for bit."""
    path = Path(path)
    try:
        with open_regular(path, what="predictions.csv") as fh:
            df = pd.read_csv(fh, dtype={"image": str, "patient": str})
    except FileNotFoundError as exc:
        raise PredictionsRecordError(f"predictions.csv not found: {path}") from exc
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PredictionsRecordError(f"{path}: cannot parse as CSV: {exc}") from exc
    needed = ["image", "patient"] + [c for lab in labels for c in (lab, f"{lab}_score")]
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise PredictionsRecordError(f"{path}: missing column(s) {missing}")
    for lab in labels:
        for col in (lab, f"{lab}_score"):
            if not pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col]):
                raise PredictionsRecordError(f"{path}: column {col!r} is not numeric (labels are 0, 1 or empty, "
                                             "never True/False)")
        _refuse_rows(path, df, lab, ~(df[lab].isin((0, 1)) | df[lab].isna()), "a label is 0, 1 or empty")
        score = df[f"{lab}_score"]
        _refuse_rows(path, df, f"{lab}_score", ~score.between(0, 1), "a score is a probability in [0, 1]")
        df[f"{lab}_score"] = score.astype(np.float32)
    for col in ("image", "patient"):            # every statistic resamples patients: an id is never blank
        blank = df[col].isna() | (df[col].astype(str).str.strip() == "")
        if blank.any():
            raise PredictionsRecordError(f"{path}: column {col!r}: {int(blank.sum())} row(s) without an id (the first: "
                                         f"row {int(df.index[blank][0]) + 2} of the file)")
    twice = df["image"].duplicated(keep=False)
    if twice.any():
        raise PredictionsRecordError(f"{path}: {int(twice.sum())} rows name an image another row names too "
                                     f"(first: {df.loc[twice, 'image'].iloc[0]!r}); each image is one row")
    return df


def _refuse_rows(path: Path, df: pd.DataFrame, col: str, bad: pd.Series, rule: str) -> None:
    """Fail naming the file, the column, how many rows break ``rule`` and the first of them."""
    if bad.any():
        first = df.index[bad][0]
        raise PredictionsRecordError(f"{path}: column {col!r}: {int(bad.sum())} row(s) outside what the evaluation "
                                     f"writes ({rule}); the first: image {df.at[first, 'image']!r}, "
                                     f"{float(df.at[first, col]):.9g}")
