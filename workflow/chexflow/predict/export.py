"""``chexflow export``: TorchScript and ONNX files of the fine-tuned model, for serving without chexflow.

Each export computes the probabilities ``sigmoid(model(x))`` of a float32 input ``[batch, 1, crop,
crop]`` (any batch size) and carries in its metadata what a server needs to get from an image file to
``x`` and from the probabilities to findings: the preprocessing (``Preprocess.describe``), the labels,
the validation-chosen thresholds, the run id, and the model card when there is one. TorchScript holds
them as extra files (``chexflow.json``, ``model_card.md``: ``torch.jit.load(path, _extra_files=...)``),
ONNX as metadata properties of the same names (``onnxruntime``: ``get_modelmeta().custom_metadata_map``).

Before the files get their names, each is loaded back and run on real test images of the manifest
(the shards evaluation read), at the full check batch and at batch size 1; the largest absolute
difference from the torch model's probabilities is recorded in ``export.json`` and must stay within
``export.tolerance`` (1e-4 in fp32), or nothing is written.
"""
from __future__ import annotations

import hashlib
import json
import sys
import warnings
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from chexflow import host
from chexflow.data.loader import ShardStream, make_loader
from chexflow.data.manifest import split_shards
from chexflow.evaluate.predict_record import THRESHOLD_RULE
from chexflow.fsutil import atomic_path, sha256_file, write_text_atomic
from chexflow.predict import EXPORT_FILES as FILES
from chexflow.predict import EXPORT_SUMMARY
from chexflow.predict.config import ExportConfig
from chexflow.predict.model import Predictor, load_predictor
from chexflow.settings import to_dict

METADATA = "chexflow.json"
CARD = "model_card.md"


class ExportMismatchError(RuntimeError):
    """An export's outputs differ from the torch model's beyond the tolerance."""


class Probabilities(torch.nn.Module):
    """The network with its sigmoid: what evaluation and ``chexflow predict`` compute."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model(x))


def metadata(predictor: Predictor, info: dict, model_path: Path, card: str | None) -> dict:
    """What a server needs, and the model file's ``predict`` record as the file holds it (None without one)."""
    return {"format": "chexflow-export/1", "run_id": predictor.run_id, "labels": list(predictor.labels),
            "dataset": predictor.dataset, "decoding": predictor.decoding,
            "synthetic_training_data": predictor.synthetic,
            "thresholds": {label: predictor.thresholds.get(label) for label in predictor.labels},
            "threshold_rule": THRESHOLD_RULE, "predict": info.get("predict"), "sources": predictor.sources,
            "preprocess": predictor.preprocess.describe(), "output": f"float32 [batch, {len(predictor.labels)}] "
            "probabilities (sigmoid), in the order of labels", "arch": info.get("arch"), "epoch": info.get("epoch"),
            "val_metric": info.get("val_metric"), "val_metric_name": info.get("val_metric_name"),
            "model_sha256": sha256_file(model_path), "model_card": CARD if card is not None else None}


def check_images(manifest: Path, predictor: Predictor, n: int) -> torch.Tensor:
    """The network inputs of the first ``n`` test images of the manifest, preprocessed as evaluation does."""
    shards = split_shards(manifest, "test")
    stream = ShardStream(shards, rank=0, world=1, seed=0, batch_size=n, shuffle=False)
    images, _, _ = next(iter(make_loader(stream, batch_size=n, workers=0, pin_memory=False)))
    return predictor.preprocess.network_input(images.to(predictor.device)).cpu()


def run(cfg: ExportConfig, *, model_path: Path, manifest: Path, out_dir: Path, metrics: Path | None = None,
        model_card: Path | None = None) -> dict:
    """Write the exports of ``cfg.formats`` and ``export.json`` (their checks) to ``out_dir``. ``manifest``
    gives the check's test images (and the stored size for a model file without a predict record); the
    file's predict record gives the rest, its thresholds overridden by ``metrics`` when given."""
    predictor, info = load_predictor(model_path, None, metrics, manifest_fallback=manifest)   # CPU, fp32: the reference
    out_dir = Path(out_dir)
    card = _model_card(model_card)
    meta = metadata(predictor, info, Path(model_path), card)
    extra = {METADATA: json.dumps(meta, indent=1), **({CARD: card} if card is not None else {})}
    x = check_images(manifest, predictor, cfg.check_images)
    module = Probabilities(predictor.model).eval()
    with torch.no_grad():
        reference = module(x).numpy()
    summary = {"run_id": predictor.run_id, "predict_record": _record_summary(meta, Path(model_path)),
               "n_check_images": int(x.shape[0]), "tolerance": cfg.tolerance,
               "config": to_dict(cfg), "metadata": meta, "versions": _versions(), "host": host.describe(),
               "exports": {}}
    with ExitStack() as stack:                   # every file or none: all are renamed once all checks pass
        for fmt in cfg.formats:
            tmp = stack.enter_context(atomic_path(out_dir / FILES[fmt]))
            write = _torchscript if fmt == "torchscript" else _onnx
            write(module, x, tmp, extra, cfg)
            diffs = _check(fmt, tmp, x, reference, extra)
            summary["exports"][fmt] = {"file": FILES[fmt], "sha256": sha256_file(tmp), "max_abs_diff": diffs}
            worst = max(diffs.values())
            _log(f"{fmt}: max |export - torch| {worst:.3g} over {x.shape[0]} test images (batches {list(diffs)})")
            if not worst <= cfg.tolerance:
                raise ExportMismatchError(f"{fmt} export of {model_path}: probabilities differ from torch's by "
                                          f"{worst:.3g} > export.tolerance {cfg.tolerance}; nothing written")
        if card is not None:                     # the text embedded in the exports, beside them
            stack.enter_context(atomic_path(out_dir / CARD)).write_text(card, encoding="utf-8")
    write_text_atomic(out_dir / EXPORT_SUMMARY, json.dumps(summary, indent=1))   # last: the rule's "done"
    return summary


def _record_summary(meta: dict, model_path: Path) -> dict:
    """Which predict record the exports carry (``chexflow.json``'s ``predict``): the model file's, with the
    sha256 of its canonical JSON, and where the thresholds and stored size the exports state came from."""
    record = meta["predict"]
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest() if record is not None else None
    return {"key": f"{METADATA}:predict", "model_file": str(model_path), "in_model_file": record is not None,
            "sha256": digest, "synthetic_training_data": meta["synthetic_training_data"], **meta["sources"]}


def _model_card(path: Path | None) -> str | None:
    if path is None or not Path(path).is_file():
        _log(f"no model card at {path}: the exports go without one")
        return None
    return Path(path).read_text(encoding="utf-8")


def _torchscript(module: torch.nn.Module, x: torch.Tensor, path: Path, extra: dict, cfg: ExportConfig) -> None:
    with warnings.catch_warnings():
        # torch marks torch.jit deprecated in favour of torch.export; TorchScript is still what
        # LibTorch (C++) and Triton's PyTorch backend load, which is why it is asked for here
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
        scripted = torch.jit.script(module)
        torch.jit.save(scripted, str(path), _extra_files=extra)


def _onnx(module: torch.nn.Module, x: torch.Tensor, path: Path, extra: dict, cfg: ExportConfig) -> None:
    import onnx

    batch = torch.export.Dim("batch", min=1)
    torch.onnx.export(module, (x,), str(path), input_names=["image"], output_names=["probabilities"],
                      dynamic_shapes=({0: batch},), opset_version=cfg.opset, external_data=False, dynamo=True)
    proto = onnx.load(str(path))
    for key, value in extra.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


def _check(fmt: str, path: Path, x: torch.Tensor, reference: np.ndarray, extra: dict) -> dict[str, float]:
    """Max |export - torch| per check batch (all images; the first alone); the metadata read back."""
    run, meta = _load_torchscript(path) if fmt == "torchscript" else _load_onnx(path)
    if {k: meta.get(k) for k in extra} != extra:
        raise ExportMismatchError(f"{fmt} export: the metadata read back differs from what was written")
    out = {}
    for name, sl in ((f"batch_{x.shape[0]}", slice(None)), ("batch_1", slice(0, 1))):
        got = run(x[sl].numpy())
        if got.shape != reference[sl].shape:
            raise ExportMismatchError(f"{fmt} export: output shape {got.shape}, expected {reference[sl].shape}")
        out[name] = float(np.abs(got - reference[sl]).max())
    return out


def _load_torchscript(path: Path):
    files = {METADATA: "", CARD: ""}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
        loaded = torch.jit.load(str(path), map_location="cpu", _extra_files=files)

    def run(a: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return loaded(torch.from_numpy(a)).numpy()
    return run, {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in files.items() if v}


def _load_onnx(path: Path):
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return (lambda a: session.run(["probabilities"], {"image": a})[0]), session.get_modelmeta().custom_metadata_map


def _versions() -> dict:
    import onnx
    import onnxruntime
    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def _log(message: str) -> None:
    print(f"chexflow export: {message}", file=sys.stderr, flush=True)
