"""The evaluation's record (chexflow.evaluate.record): the operating point evaluation chooses and the
split it records, and the reader that accepts the writer's one format only."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_curve

from chexflow.evaluate import record


def _youden(y: np.ndarray, s: np.ndarray) -> float:
    """Independently: the finite ROC threshold with the largest TPR - FPR (first on ties)."""
    fpr, tpr, thr = roc_curve(y, s)
    j = [(tpr[k] - fpr[k], -k) for k in range(len(thr)) if np.isfinite(thr[k])]
    return float(thr[-max(j)[1]])


def _data(seed: int, n: int = 80) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(float)
    y[:2] = [0.0, 1.0]
    return y, y * 0.7 + rng.random(n)


def _sens_spec(y: np.ndarray, s: np.ndarray, thr: float) -> tuple[float, float]:
    pred = s >= thr
    return float(pred[y == 1].mean()), float((~pred[y == 0]).mean())


def test_threshold_chosen_on_validation_and_applied_to_test():
    (vy, vs), (ty, ts) = _data(1), _data(2)
    op = record.choose_operating_point(vy, vs, ty, ts)
    assert op["operating_point_split"] == "validation"
    assert op["threshold_val_youden"] == pytest.approx(_youden(vy, vs))
    point = op["test_operating_point"]
    assert point["threshold"] == op["threshold_val_youden"]
    assert (point["sensitivity"], point["specificity"]) == pytest.approx(_sens_spec(ty, ts, point["threshold"]))


def test_one_class_in_validation_falls_back_to_test_and_says_so():
    ty, ts = _data(3)
    op = record.choose_operating_point(np.zeros(10), np.linspace(0, 1, 10), ty, ts)
    assert op["operating_point_split"] == "test" and "threshold_val_youden" not in op    # predict never applies it
    assert op["test_operating_point"]["threshold"] == pytest.approx(_youden(ty, ts))
    assert record.choose_operating_point(np.ones(4), np.arange(4.0), np.zeros(5), np.arange(5.0)) == {}   # both one


def test_one_class_in_test_keeps_the_validation_threshold():
    """Validation holds both classes, test only negatives: the threshold chosen on validation stands
    (the predict record and the underdiagnosis call keep it); on test only what negatives measure."""
    vy, vs = _data(4)
    ty, ts = np.zeros(5), np.array([0.1, 0.2, 0.3, 0.9, 0.95])
    op = record.choose_operating_point(vy, vs, ty, ts)
    assert op["operating_point_split"] == "validation"
    assert op["threshold_val_youden"] == pytest.approx(_youden(vy, vs))
    point = op["test_operating_point"]
    assert point["sensitivity"] is None and point["ppv"] in (0.0, None)
    assert point["specificity"] == pytest.approx(float((ts < op["threshold_val_youden"]).mean()))
    assert point["tn"] + point["fp"] == 5 and point["tp"] + point["fn"] == 0
    empty = record.choose_operating_point(vy, vs, np.zeros(0), np.zeros(0))       # no known test label at all
    assert empty["threshold_val_youden"] == op["threshold_val_youden"]
    assert empty["test_operating_point"] == {"threshold": op["threshold_val_youden"], "sensitivity": None,
                                             "specificity": None, "ppv": None, "npv": None, "f1": None,
                                             "tp": 0, "fp": 0, "tn": 0, "fn": 0}


def _write(tmp_path: Path, metrics: dict) -> Path:
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(metrics))
    return path


def _good() -> dict:
    op = {"threshold": 0.4, "sensitivity": 0.8, "specificity": 0.7}
    return {"labels": {"A": {"auroc": 0.8, "ci": [0.7, 0.9], "threshold_val_youden": 0.4, "test_operating_point": op,
                             "operating_point_split": "validation"},
                       "B": {"auroc": None, "ci": None}},
            "mean_auroc": 0.8, "n_images": 10, "n_patients": 5,
            "bootstrap": {"n_resamples": 10, "seed": 0, "mean_auroc_ci": [0.7, 0.9]}}


def test_reader_takes_the_writers_format(tmp_path: Path):
    m = record.read_metrics(_write(tmp_path, _good()))
    assert m["labels"]["A"]["ci"] == [0.7, 0.9] and m["labels"]["B"]["ci"] is None
    assert m["bootstrap"]["mean_auroc_ci"] == [0.7, 0.9]


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m["labels"]["A"].update(ci_low=0.7, ci_high=0.9) or m["labels"]["A"].pop("ci"),
     r"labels\['A'\] has no 'ci' key"),
    (lambda m: m.update(mean_auroc_ci=[0.7, 0.9]) or m.pop("bootstrap"), "missing key 'bootstrap'"),
    (lambda m: m["bootstrap"].pop("mean_auroc_ci"), "bootstrap must be an object with mean_auroc_ci"),
    (lambda m: m["labels"]["A"].update(ci=[0.7]), r"labels\['A'\]\.ci must be \[low, high\]"),
    (lambda m: m["labels"]["A"].pop("operating_point_split"), "names the split"),
    (lambda m: m["labels"]["A"].update(operating_point_split="train"), "names the split"),
    (lambda m: m["labels"]["A"].pop("threshold_val_youden"), "needs threshold_val_youden"),
    (lambda m: m["labels"]["A"].update(auroc="0.8"), r"auroc must be a number"),
])
def test_reader_refuses_anything_else_naming_the_key(tmp_path: Path, change, message: str):
    m = _good()
    change(m)
    with pytest.raises(record.MetricsRecordError, match=message) as err:
        record.read_metrics(_write(tmp_path, m))
    assert str(tmp_path / "metrics.json") in str(err.value)


def test_predictions_written_and_read_are_the_scores_and_their_auroc_bit_for_bit(tmp_path: Path):
    """A tiny model's scores crowd together: 400 float32 scores within 3e-6 of each other (as in a CI run
    where the Nodule scores sat near 0.0221636). Written with 6 significant digits they tied, and the AUROC
    recomputed from the file moved by more than 1e-4; written as FLOAT_FORMAT they read back as the same
    float32 values, and every AUROC recomputed from the file is the evaluation's exactly."""
    import pandas as pd
    from sklearn.metrics import roc_auc_score

    from chexflow.evaluate.metrics import auroc_per_label

    rng = np.random.default_rng(7)
    n = 400
    base = np.float32(0.0221636)
    scores = (base + rng.integers(-25, 25, n).astype(np.float32) * np.spacing(base)).astype(np.float32)
    y = rng.integers(0, 2, n).astype(np.float64)
    table = pd.DataFrame({"image": [f"{i:08d}_000.png" for i in range(n)], "patient": [str(i) for i in range(n)],
                          "Nodule": y, "Nodule_score": scores})
    record.write_predictions(tmp_path / "predictions.csv", table)
    back = record.read_predictions(tmp_path / "predictions.csv", ["Nodule"])
    assert back["Nodule_score"].dtype == np.float32
    assert np.array_equal(back["Nodule_score"].to_numpy(), scores)
    ours = auroc_per_label(y[:, None], scores[:, None], ["Nodule"])["Nodule"]
    assert roc_auc_score(back["Nodule"], back["Nodule_score"]) == roc_auc_score(y, scores) == ours
    # the format it replaces: the same table with 6 significant digits ties scores and moves the AUROC
    table.to_csv(tmp_path / "six.csv", index=False, float_format="%.6g")
    six = pd.read_csv(tmp_path / "six.csv")
    assert six["Nodule_score"].nunique() < len(np.unique(scores))
    assert roc_auc_score(six["Nodule"], six["Nodule_score"]) != roc_auc_score(y, scores)


def _table(tmp_path: Path, edit=None) -> Path:
    """A predictions.csv as the evaluation writes it (3 images, one finding), then ``edit``-ed as raw text."""
    import pandas as pd
    table = pd.DataFrame({"image": ["a.png", "b.png", "c.png"], "patient": ["1", "2", "2"],
                          "Nodule": [0.0, 1.0, np.nan], "Nodule_score": np.float32([0.0, 1.0, 0.25])})
    record.write_predictions(tmp_path / "predictions.csv", table)
    if edit:
        path = tmp_path / "predictions.csv"
        path.write_text(edit(path.read_text()))
    return tmp_path / "predictions.csv"


def test_predictions_reader_takes_the_edges_of_what_the_evaluation_writes(tmp_path: Path):
    """Scores of exactly 0 and 1 (a saturated sigmoid), an unknown label (empty): all read back as written."""
    df = record.read_predictions(_table(tmp_path), ["Nodule"])
    assert df["Nodule_score"].tolist() == [0.0, 1.0, 0.25] and df["Nodule"].isna().tolist() == [False, False, True]


@pytest.mark.parametrize(("edit", "column", "image", "value"), [
    # a label the evaluation never writes: CheXpert's "uncertain", a second class, a soft label
    (lambda t: t.replace("b.png,2,1,", "b.png,2,-1,"), "Nodule", "b.png", "-1"),
    (lambda t: t.replace("b.png,2,1,", "b.png,2,2,"), "Nodule", "b.png", "2"),
    (lambda t: t.replace("a.png,1,0,", "a.png,1,0.5,"), "Nodule", "a.png", "0.5"),
    # a score that is no probability: a logit, a negative, a missing one, an infinity
    (lambda t: t.replace(",0.25\n", ",1.7\n"), "Nodule_score", "c.png", "1.7"),
    (lambda t: t.replace("a.png,1,0,0\n", "a.png,1,0,-0.01\n"), "Nodule_score", "a.png", "-0.01"),
    (lambda t: t.replace(",0.25\n", ",\n"), "Nodule_score", "c.png", "nan"),
    (lambda t: t.replace(",0.25\n", ",inf\n"), "Nodule_score", "c.png", "inf"),
], ids=["uncertain-label", "label-2", "soft-label", "score-1.7", "score-negative", "score-missing", "score-inf"])
def test_predictions_reader_refuses_values_the_evaluation_never_writes(tmp_path: Path, edit, column, image, value):
    """An AUROC is a ranking and would take any of these without a word (a logit as a score, a label of 2 as
    a positive); the calibration and Brier score would be wrong. Refused in one line: the file, the column,
    how many rows and the first one."""
    path = _table(tmp_path, edit)
    with pytest.raises(record.PredictionsRecordError) as err:
        record.read_predictions(path, ["Nodule"])
    message = str(err.value)
    assert "\n" not in message and str(path) in message and f"column {column!r}: 1 row(s)" in message, message
    assert message.endswith(f"the first: image {image!r}, {value}"), message


def test_predictions_reader_refuses_an_image_listed_twice(tmp_path: Path):
    """A row pasted twice would count its image twice in every AUROC and every bootstrap resample."""
    path = _table(tmp_path, lambda t: t + t.splitlines()[1] + "\n")
    with pytest.raises(record.PredictionsRecordError, match=r"2 rows name an image another row names too "
                       r"\(first: 'a.png'\); each image is one row"):
        record.read_predictions(path, ["Nodule"])


def test_predictions_reader_refuses_true_false_labels_and_blank_ids(tmp_path: Path):
    """pandas reads a column of True/False as booleans, which count as numbers equal to 1 and 0: refused,
    as is a row without a patient id (the bootstrap would pool every such image as one patient)."""
    path = _table(tmp_path, lambda t: t.replace("a.png,1,0,", "a.png,1,False,").replace("b.png,2,1,", "b.png,2,True,")
                  .replace("c.png,2,,", "c.png,2,False,"))
    with pytest.raises(record.PredictionsRecordError, match=r"column 'Nodule' is not numeric \(labels are 0, 1 or "
                       r"empty, never True/False\)"):
        record.read_predictions(path, ["Nodule"])
    path = _table(tmp_path, lambda t: t.replace("b.png,2,", "b.png,,").replace("c.png,2,", "c.png, ,"))
    with pytest.raises(record.PredictionsRecordError, match=r"column 'patient': 2 row\(s\) without an id \(the "
                       r"first: row 3 of the file\)"):
        record.read_predictions(path, ["Nodule"])
