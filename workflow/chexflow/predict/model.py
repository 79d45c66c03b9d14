"""The fine-tuned model with everything needed to apply it to an image file: what the training path
did to its images (:class:`Preprocess`), its labels, the thresholds chosen on validation, its run id.

A model file with a ``predict`` record (evaluation's ``model.pt``, checked by
``checkpoint.load_model`` and ``predict_record.refuse_if_malformed``) makes a :class:`Predictor`
alone: weights, architecture, labels, crop, run id, how the files are decoded (``predict.decoding``: the
shard stage's, ``data.tables.DECODINGS``; a model of a CSV-declared dataset needs no declaration), the
stored side, the normalisation, the validation thresholds, whether the training data was synthetic. Two files override parts of it (and stand in for a model file without the record, as
the fine-tuning writes it), each checked (every file read is untrusted):
- the dataset manifest the model was trained on: the stored side and the dataset;
- ``metrics.json`` of the evaluation: ``threshold_val_youden`` per label, chosen on validation.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from chexflow.data import registry
from chexflow.data.augment import MEAN, STD, gpu_augment
from chexflow.data.manifest import read_manifest
from chexflow.evaluate.predict_record import refuse_if_malformed
from chexflow.fsutil import read_regular
from chexflow.train.checkpoint import load_model
from chexflow.train.models import ieee_fp32


class PredictInputError(ValueError):
    """A model, manifest or metrics file that cannot serve predictions; the message names it."""


@dataclass(frozen=True)
class Preprocess:
    """The training path's preprocessing, from file to network input.

    1. decode to uint8 grey, cut the central square, resize to ``stored_size`` (PIL bilinear):
       the shard stage's ``decode`` of the dataset (``data.images``), or ``data.dicom`` for DICOM;
    2. resize to ``crop`` (torch bilinear, antialiased) and normalise ``(x / 255 - mean) / std``:
       ``data.augment.gpu_augment(train=False)``, as validation and evaluation do.
    """
    stored_size: int
    crop: int
    mean: float = MEAN
    std: float = STD

    def network_input(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, stored_size, stored_size]`` on the model's device -> float ``[B, 1, crop, crop]``."""
        return gpu_augment(images, out_size=self.crop, train=False, cfg=None, generator=None,
                                  mean=self.mean, std=self.std)

    def describe(self) -> dict:
        return {"stored_size": self.stored_size, "crop": self.crop, "mean": self.mean, "std": self.std,
                "input": f"float32 [batch, 1, {self.crop}, {self.crop}]",
                "steps": ["decode to 8-bit grey (DICOM: modality LUT, VOI LUT or window, MONOCHROME1 inverted)",
                          "cut the central square",
                          f"resize to {self.stored_size} x {self.stored_size} (PIL bilinear, antialiased)",
                          f"resize to {self.crop} x {self.crop} (torch bilinear, antialias=True, align_corners=False)",
                          f"x = (pixel / 255 - {self.mean}) / {self.std}"]}


@dataclass
class Predictor:
    model: torch.nn.Module               # in eval mode, on ``device``
    labels: tuple[str, ...]
    thresholds: dict[str, float]         # the labels that have a validation-chosen threshold
    run_id: str
    preprocess: Preprocess
    dataset: str                         # the training data's name (the model file's 'dataset')
    decoding: str = "grey"               # how image files become stored pixels (data.tables.DECODINGS)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cam_layer: str | None = None         # the Grad-CAM layer the evaluation's heatmaps used
    synthetic: bool | None = None        # trained on synthetic data (None: not recorded)
    sources: dict = field(default_factory=dict)   # where the stored size and thresholds came from

    def probabilities(self, images: torch.Tensor) -> np.ndarray:
        """float32 ``[B, labels]``: sigmoid outputs for uint8 ``[B, S, S]`` images (S: the stored size)."""
        with torch.no_grad(), ieee_fp32():
            x = self.preprocess.network_input(images.to(self.device))
            return torch.sigmoid(self.model(x).float()).cpu().numpy()

    def findings(self, probs: np.ndarray) -> list[str]:
        """The labels whose probability reaches their threshold (``>=``, as evaluation's operating points)."""
        return [label for label, p in zip(self.labels, probs) if label in self.thresholds
                and p >= self.thresholds[label]]


def pick_device(choice: str) -> torch.device:
    """``auto``: CUDA when available; ``cuda`` without a GPU is an error, not a silent CPU run."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise PredictInputError("device cuda asked for, but torch sees no CUDA device")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")


def load_predictor(model_path: Path, manifest_path: Path | None = None, metrics_path: Path | None = None, *,
                   device: torch.device | None = None, manifest_fallback: Path | None = None) -> tuple[Predictor, dict]:
    """The predictor of a fine-tuned model file, and the file's content (for provenance). Its ``predict``
    record serves alone; ``manifest_path`` and ``metrics_path`` override the record's stored size and
    dataset, and thresholds, and are needed for a model file without one (``manifest_fallback``: the
    manifest to use then only)."""
    model, info = load_model(model_path, expect={"task": "multilabel"})   # checked: weights only, format, fields
    refuse_if_malformed(info, model_path)                                  # and the predict record, if any
    labels, run_id, crop = tuple(info["labels"]), info["run_id"], info["crop"]
    record = info.get("predict")
    if record is None and manifest_path is None:
        manifest_path = manifest_fallback
    for given, what in ((manifest_path, "--manifest (the stored image size)"),
                        (metrics_path, "--metrics (the validation thresholds)")):
        if given is None and record is None:
            raise PredictInputError(f"{model_path}: no 'predict' record (a fine-tuning model.pt; evaluation writes "
                                    f"results/evaluate/model.pt with one): give {what}")
    if manifest_path is not None:
        stored, dataset, synthetic = _read_manifest(Path(manifest_path), labels)
    else:
        stored, dataset, synthetic = record["stored_size"], info["dataset"], record["synthetic"]
    decoding = record["decoding"] if record is not None else registry.decoding_of(dataset)
    if metrics_path is not None:
        thresholds, cam_layer = read_thresholds(Path(metrics_path), labels, info, model)
    else:
        thresholds = {k: v for k, v in record["thresholds"].items() if v is not None}
        cam_layer = _checked_layer(record["cam_layer"], model, f"{model_path}: predict.cam_layer")
    mean, std = (record["mean"], record["std"]) if record is not None else (MEAN, STD)
    sources = {"stored_size": str(manifest_path or model_path), "thresholds": str(metrics_path or model_path)}
    model = model.to(device or torch.device("cpu")).eval()
    return Predictor(model, labels, thresholds, run_id, Preprocess(stored, crop, mean, std), dataset, decoding,
                     device or torch.device("cpu"), cam_layer, synthetic, sources), info


def _read_manifest(path: Path, labels: tuple[str, ...]) -> tuple[int, str, bool | None]:
    m = read_manifest(path)
    size, dataset, synthetic = m.get("image_size"), m.get("dataset"), m.get("synthetic")
    if synthetic is not None and not isinstance(synthetic, bool):
        raise PredictInputError(f"{path}: 'synthetic' must be true or false, got {synthetic!r}")
    if not isinstance(size, int) or not 1 <= size <= 65536:
        raise PredictInputError(f"{path}: 'image_size' must be a side in px, got {size!r}")
    if not isinstance(dataset, str) or not dataset:
        raise PredictInputError(f"{path}: 'dataset' must be a dataset's name, got {dataset!r}")
    if tuple(m.get("labels") or ()) != labels:
        raise PredictInputError(f"{path}: its labels {m.get('labels')} are not the model's {list(labels)} "
                                "(the manifest of another dataset?)")
    return size, dataset, synthetic


def read_thresholds(path: Path, labels: tuple[str, ...], info: dict,
                    model: torch.nn.Module | None = None) -> tuple[dict[str, float], str | None]:
    """``threshold_val_youden`` per label from evaluation's ``metrics.json``, checked against the model
    file (same labels; same run id, epoch and validation metric where both record them), and the
    Grad-CAM layer its heatmaps used (``localisation.layer``: a module of ``model``), if it recorded one."""
    try:
        metrics = json.loads(read_regular(path, what="metrics file"))
    except (OSError, ValueError) as exc:
        raise PredictInputError(f"{path}: cannot read evaluation metrics ({exc})") from exc
    per_label = metrics.get("labels") if isinstance(metrics, dict) else None
    if not isinstance(per_label, dict) or sorted(per_label) != sorted(labels):
        found = sorted(per_label) if isinstance(per_label, dict) else per_label
        raise PredictInputError(f"{path}: 'labels' must hold the model's {len(labels)} labels, got {found}")
    for key, ours in (("model_run_id", info.get("run_id")), ("model_epoch", info.get("epoch")),
                      ("model_val_metric", info.get("val_metric"))):
        theirs = metrics.get(key)
        if theirs is not None and ours is not None and theirs != ours and not _both_nan(theirs, ours):
            raise PredictInputError(f"{path}: evaluated another model ({key} {theirs!r}, this model's {ours!r}); "
                                    "evaluate this model first")
    out = {}
    for label in labels:
        thr = per_label[label].get("threshold_val_youden") if isinstance(per_label[label], dict) else None
        if thr is None:
            continue                     # evaluation found no threshold (one class only in val or test)
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not math.isfinite(thr) or not 0 <= thr <= 1:
            raise PredictInputError(f"{path}: labels.{label}.threshold_val_youden must be a probability, got {thr!r}")
        out[label] = float(thr)
    layer = (metrics.get("localisation") or {}).get("layer") if isinstance(metrics.get("localisation"), dict) else None
    return out, _checked_layer(layer, model, f"{path}: localisation.layer")


def _checked_layer(layer, model: torch.nn.Module | None, what: str) -> str | None:
    """``layer`` when it is None or a module of ``model``; else :class:`PredictInputError` naming ``what``."""
    if layer is not None and model is not None:
        names = {name for name, _ in model.named_modules() if name}
        if not isinstance(layer, str) or layer not in names:
            raise PredictInputError(f"{what} {layer!r} is not a layer of the model")
    return layer


def _both_nan(a, b) -> bool:
    return all(isinstance(v, float) and math.isnan(v) for v in (a, b))
