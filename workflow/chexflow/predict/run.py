"""``chexflow predict``: the fine-tuned model on PNG, JPEG and DICOM files, one CSV row per file.

Each row: the file, its format, an error (empty when the file was read), the model's run id, whether
its training data was synthetic (``synthetic_training_data``: true/false; also said in the log), the
findings (labels whose probability reaches the threshold evaluation chose on validation), the 14
probabilities (``<label>_score``, as evaluation's predictions.csv) and, with ``heatmaps``, the
Grad-CAM PNG of the most likely finding. A file that cannot be read gets its reason in ``error``;
the others go on. Files are decoded by loader workers while the model runs on batches (CPU or GPU).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from chexflow import watchdog
from chexflow.data.images import DecodeError
from chexflow.data.workers import loader_processes
from chexflow.evaluate.record import write_predictions
from chexflow.predict.config import PredictConfig
from chexflow.predict.files import Reader, list_inputs, reader_for
from chexflow.predict.model import Predictor, load_predictor, pick_device


class _Files(torch.utils.data.Dataset):
    """``(index, pixels or None, format, error)`` per file: a file's failure is its row's, not the run's."""

    def __init__(self, files: list[Path], reader: Reader) -> None:
        self.files, self.reader = files, reader

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            pixels, fmt = self.reader.read(self.files[i])
        except DecodeError as exc:
            return i, None, "", exc.reason
        except Exception as exc:  # noqa: BLE001 - a hostile file may raise anything inside a decoder
            return i, None, "", " ".join(f"unexpected error while reading it: {type(exc).__name__}: {exc}".split())
        return i, pixels, fmt, ""


def batches(files: list[Path], reader: Reader, *, batch_size: int, workers: int):
    """Lists of ``_Files`` items in file order, decoded by ``workers`` processes (0: this one)."""
    return torch.utils.data.DataLoader(_Files(files, reader), batch_size=batch_size, shuffle=False,
                                       num_workers=workers, collate_fn=list,
                                       prefetch_factor=2 if workers > 0 else None, **loader_processes(workers))


def run(cfg: PredictConfig, *, model_path: Path, out_csv: Path, manifest: Path | None = None,
        metrics: Path | None = None,
        inputs: Sequence[str | Path] = (), heatmap_dir: Path | None = None, progress: bool = True) -> pd.DataFrame:
    """Predict on ``inputs`` (default: ``cfg.inputs``) and write ``out_csv``; returns its table. The model
    file's predict record serves alone; ``manifest`` and ``metrics`` override it (``model.load_predictor``).
    Heatmaps (``cfg.heatmaps``) go to ``heatmap_dir`` (default: ``heatmaps/`` beside the CSV)."""
    files = list_inputs(inputs or cfg.inputs)
    predictor, _ = load_predictor(model_path, manifest, metrics, device=pick_device(cfg.device))
    reader = reader_for(predictor.dataset, predictor.preprocess.stored_size, cfg, predictor.decoding)
    out_csv = Path(out_csv)
    heat = None
    if cfg.heatmaps:
        from chexflow.predict.heatmap import Writer
        heat = Writer(predictor, Path(heatmap_dir) if heatmap_dir else out_csv.parent / "heatmaps", out_csv.parent)
    _log(f"model {model_path} (run {predictor.run_id}) on {predictor.device}; {len(files)} files; "
         f"preprocessing: {'; '.join(predictor.preprocess.describe()['steps'])}")
    _log(f"stored size from {predictor.sources['stored_size']}, thresholds from {predictor.sources['thresholds']}")
    _log_synthetic(predictor)
    unset = [label for label in predictor.labels if label not in predictor.thresholds]
    if unset:
        _log(f"no validation threshold for {', '.join(unset)} ({predictor.sources['thresholds']}): "
             "never listed as findings")
    rows: list[dict] = []
    bar = tqdm(total=len(files), unit="img", desc="predict", disable=not progress, file=sys.stderr)
    for batch in batches(files, reader, batch_size=cfg.batch_size, workers=cfg.workers):
        rows += predict_batch(predictor, batch, files, heat)
        watchdog.beat("predict")
        bar.update(len(batch))
    bar.close()
    table = _table(rows, predictor, cfg.heatmaps)
    write_predictions(out_csv, table)
    failed = table[table["error"] != ""]
    first = f" (first: {failed['file'].iloc[0]}: {failed['error'].iloc[0]})" if len(failed) else ""
    _log(f"{out_csv}: {len(table) - len(failed)} of {len(table)} files predicted, {len(failed)} not read{first}")
    _log_synthetic(predictor)        # again last: the line a reader of the log's tail sees
    return table


def _log_synthetic(predictor: Predictor) -> None:
    if predictor.synthetic:
        _log(f"WARNING: this model was trained on synthetic data ({predictor.dataset}): its scores and findings say "
             "nothing about real radiographs (column synthetic_training_data)")
    elif predictor.synthetic is None:
        _log("whether the training data was synthetic is not recorded (column synthetic_training_data empty)")


def predict_batch(predictor: Predictor, batch: list, files: list[Path], heat=None) -> list[dict]:
    """The CSV rows of one batch of ``_Files`` items (probabilities of the readable ones in one forward
    pass; their heatmaps when ``heat``, a ``heatmap.Writer``, is given)."""
    ok = [item for item in batch if item[1] is not None]
    probs = predictor.probabilities(torch.from_numpy(np.stack([item[1] for item in ok]))) if ok else None
    by_index = {item[0]: k for k, item in enumerate(ok)}
    drawn = heat.write([(i, px, files[i]) for i, px, _, _ in ok], probs) if heat is not None and ok else {}
    rows = []
    for i, _, fmt, error in batch:
        row = {"file": str(files[i]), "format": fmt, "error": error, "run_id": predictor.run_id,
               "synthetic_training_data": "" if predictor.synthetic is None else str(predictor.synthetic).lower(),
               "findings": ""}
        if i in by_index:
            p = probs[by_index[i]]
            row["findings"] = ";".join(predictor.findings(p))
            row.update({f"{label}_score": float(v) for label, v in zip(predictor.labels, p)})
            row.update(drawn.get(i, {}))
        rows.append(row)
    return rows


def _table(rows: list[dict], predictor: Predictor, heatmaps: bool) -> pd.DataFrame:
    columns = ["file", "format", "error", "run_id", "synthetic_training_data", "findings", *(["heatmap_label", "heatmap"] if heatmaps else []),
               *(f"{label}_score" for label in predictor.labels)]
    table = pd.DataFrame(rows, columns=columns)
    text = [c for c in columns if not c.endswith("_score")]
    table[text] = table[text].fillna("")
    return table


def _log(message: str) -> None:
    print(f"chexflow predict: {message}", file=sys.stderr, flush=True)
