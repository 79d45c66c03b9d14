"""The ``predict`` record of a model file: what applying the model to an image file needs beyond the
weights and the fields every model file has (labels, crop, run id, dataset name). Evaluation adds it
(``results/evaluate/model.pt``: the selected model's weights and this record, :mod:`.model_file`), so
that the file alone serves ``chexflow predict`` and ``chexflow export``; the fine-tuning's ``model.pt``
has none.

It lives with its writer: training checks the fields every model file has
(:func:`chexflow.train.checkpoint.model_problems`) and knows nothing of evaluation's record; a reader
that uses the record checks it here (:func:`refuse_if_malformed`), every problem naming its key
(``predict.thresholds.Mass`` ...).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from chexflow.data.tables import DECODINGS
from chexflow.train.checkpoint import ModelFileError

PREDICT_FORMAT = 2      # 2: with ``decoding`` (a model of a CSV-declared dataset predicts without its declaration)

# key -> type of the record (None allowed where the tuple holds type(None))
PREDICT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": int,
    "stored_size": int,          # side (px) of the shards' stored images: file -> stored pixels
    "mean": float, "std": float,   # normalisation of the network input: (pixel / 255 - mean) / std
    "synthetic": bool,           # trained on synthetic data (the demo's phantoms): its scores mean nothing clinically
    "dataset_title": str,        # the training data, in words (the file's 'dataset' is its name)
    "decoding": str,             # how an image file becomes stored pixels: a key of data.tables.DECODINGS
    "thresholds": dict,          # label -> probability chosen on validation (Youden's J), or None
    "val_positives": dict,       # label -> {"images": n, "patients": n}: the validation positives it rests on
    "min_val_positives": int,    # below this (images or patients) a threshold is flagged as resting on few
    "threshold_rule": str,
    "cam_layer": (str, type(None)),   # the Grad-CAM layer of evaluation's heatmaps
}
THRESHOLD_RULE = "finding when probability >= threshold (Youden's J on validation); null: none chosen"


def predict_record(*, stored_size: int, mean: float, std: float, synthetic: bool, dataset_title: str,
                   decoding: str, thresholds: dict, val_positives: dict, min_val_positives: int,
                   cam_layer: str | None, labels: list[str]) -> dict:
    """The record, checked against the model's ``labels`` as a reader checks it."""
    record = {"format": PREDICT_FORMAT, "stored_size": int(stored_size), "mean": float(mean), "std": float(std),
              "synthetic": synthetic, "dataset_title": dataset_title, "decoding": decoding,
              "thresholds": {label: None if thresholds.get(label) is None else float(thresholds[label])
                             for label in labels},
              "val_positives": {label: {k: int(v) for k, v in val_positives[label].items()} for label in labels},
              "min_val_positives": int(min_val_positives), "threshold_rule": THRESHOLD_RULE, "cam_layer": cam_layer}
    problems = predict_problems(record, labels)
    if problems:
        raise ValueError(f"predict record: {'; '.join(problems)}")
    return record


def predict_problems(record: Any, labels: list[str]) -> list[str]:
    """Why ``record`` is not the predict record of a model of ``labels`` ([] when it is); each names its key."""
    if not isinstance(record, dict):
        return [f"predict is a {type(record).__name__}, not a record"]
    if record.get("format") != PREDICT_FORMAT:
        return [f"predict.format is {record.get('format')!r}; this chexflow reads predict format {PREDICT_FORMAT}"]
    problems = []
    for key, tp in PREDICT_FIELDS.items():
        if key not in record:
            problems.append(f"no 'predict.{key}'")
        elif (isinstance(record[key], bool) and tp is not bool) or not isinstance(record[key], tp):
            problems.append(f"predict.{key} is a {type(record[key]).__name__}")
    unknown = sorted(set(record) - set(PREDICT_FIELDS))
    if unknown:
        problems.append(f"predict has keys this chexflow does not know: {unknown}")
    if problems:
        return problems
    if not 1 <= record["stored_size"] <= 65536:
        problems.append(f"predict.stored_size {record['stored_size']} is not a side in px")
    if not (math.isfinite(record["mean"]) and math.isfinite(record["std"]) and record["std"] > 0):
        problems.append(f"predict.mean/std ({record['mean']}, {record['std']}) is not a normalisation")
    if record["decoding"] not in DECODINGS:
        problems.append(f"predict.decoding {record['decoding']!r} is not a way of reading image files this chexflow "
                        f"knows ({', '.join(DECODINGS)})")
    return problems + _per_label(record, "thresholds", labels, _threshold_problem) \
        + _per_label(record, "val_positives", labels, _positives_problem)


def refuse_if_malformed(info: dict, source: Path | str) -> None:
    """A model file's content (checked as every model file is) whose ``predict`` record, if it has one,
    is not this format: :class:`ModelFileError` naming ``source`` and every problem."""
    if "predict" in info:
        problems = predict_problems(info["predict"], list(info["labels"]))
        if problems:
            raise ModelFileError(f"{source}: refused: {'; '.join(problems)}")


def _per_label(record: dict, key: str, labels: list[str], check) -> list[str]:
    table = record[key]
    extra = [k for k in table if k not in labels]
    if extra:
        return [f"predict.{key} names label(s) the model does not have: {extra}"]
    missing = [label for label in labels if label not in table]
    if missing:
        return [f"predict.{key} lacks the model's label(s) {missing}"]
    return [f"predict.{key}.{label} {problem}" for label in labels if (problem := check(table[label]))]


def _threshold_problem(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
        return f"is {value!r}, not a probability or null"
    return None


def _positives_problem(value: Any) -> str | None:
    if not isinstance(value, dict) or sorted(value) != ["images", "patients"] or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        return f"is {value!r}, not {{'images': count, 'patients': count}}"
    return None
