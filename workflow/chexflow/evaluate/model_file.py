"""The model file that travels alone: evaluation writes ``model.pt`` beside its metrics, the weights
it evaluated and their fields as they came, plus the ``predict`` record
(:mod:`.predict_record`): the stored image size, the normalisation, the thresholds
chosen on validation and the validation positives they rest on, the training data's title and
whether it was synthetic. ``chexflow predict --model model.pt`` needs nothing else.
"""
from __future__ import annotations

from pathlib import Path

from chexflow.data import registry
from chexflow.data.augment import MEAN, STD
from chexflow.data.manifest import read_manifest
from chexflow.evaluate.predict_record import predict_problems, predict_record
from chexflow.train.checkpoint import model_problems, save_atomic

NAME = "model.pt"


class ModelFileInputError(ValueError):
    """A manifest whose fields cannot make the predict record; the message names the file and key."""


def record_of(result: dict, manifest: Path, labels: list[str]) -> dict:
    """The predict record of the evaluation ``result`` (its metrics.json content) on ``manifest``: what
    reading an image file needs (the stored side, the dataset's decoding, the normalisation) and the
    thresholds, so that a model of a dataset the predicting process does not know (a CSV-declared one)
    predicts from the file alone."""
    m = read_manifest(Path(manifest))
    for key, tp in (("image_size", int), ("synthetic", bool), ("title", str), ("dataset", str)):
        if isinstance(m.get(key), bool) is not (tp is bool) or not isinstance(m.get(key), tp):
            raise ModelFileInputError(f"{manifest}: {key!r} must be a {tp.__name__}, got {m.get(key)!r}")
    entries = result["labels"]
    return predict_record(
        stored_size=m["image_size"], mean=MEAN, std=STD, synthetic=m["synthetic"],
        dataset_title=m["title"], decoding=registry.decoding_of(m["dataset"]), labels=labels,
        thresholds={label: entries[label].get("threshold_val_youden") for label in labels},
        val_positives={label: {"images": entries[label]["val_positives"],
                               "patients": entries[label]["val_positive_patients"]} for label in labels},
        min_val_positives=result["min_val_positives"],
        cam_layer=(result.get("localisation") or {}).get("layer"))


def write(path: Path, info: dict, result: dict, manifest: Path) -> dict:
    """Write the model file ``info`` (as loaded, checked) with its predict record to ``path``; returns it."""
    packaged = {**info, "predict": record_of(result, manifest, list(info["labels"]))}
    problems = model_problems(packaged) + predict_problems(packaged["predict"], list(info["labels"]))
    if problems:
        raise ValueError(f"{path}: not written: {'; '.join(problems)}")
    save_atomic(packaged, Path(path))
    return packaged
