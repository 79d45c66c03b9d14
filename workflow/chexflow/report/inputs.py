"""The report's inputs: their structure (``INPUTS``, the workflow's report_input_tree) and a reader per
file that fails naming the file and what is wrong with it."""
from __future__ import annotations

import base64
import contextlib
import json
import math
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import pandas as pd

from chexflow.evaluate.comparison_record import ComparisonRecordError, read_comparison
from chexflow.evaluate.external_record import ExternalInputError, read_record
from chexflow.evaluate.intervals import ci_columns
from chexflow.evaluate.record import MetricsRecordError, PredictionsRecordError, read_metrics, read_predictions
from chexflow.fsutil import open_regular, read_json
from chexflow.report.errors import ReportInputError
from chexflow.report.templating import hms
from chexflow.train.epochs import EpochsRecordError, read_epochs

# The structure of the report's inputs (``--inputs-json``; the workflow's report_input_tree): a
# section's files by name. None: any name (benchmarks: stage -> TSV).
INPUTS: dict[str, tuple[str, ...] | None] = {
    "evaluation": ("metrics", "predictions", "saliency"),
    "training": ("pretrain", "finetune"),
    "manifests": None,              # pretrain, finetune, external_<dataset>
    "external": None,               # dataset -> its external validation's metrics.json
    "benchmarks": None,
    "ablation": ("comparison",),
    "scaling": ("table", "plot"),
    "sweep": ("table", "selection", "metrics"),
}
REQUIRED_INPUTS = (("evaluation", "metrics"), ("training", "pretrain"), ("training", "finetune"))


def check_inputs(tree: Any) -> dict[str, Any]:
    """The report's inputs (``INPUTS``) with every file as a ``Path``; an unknown section or name, a
    missing required input or a value that is not a path fails naming it."""
    if not isinstance(tree, dict):
        raise ReportInputError(f"report inputs: expected an object of sections {list(INPUTS)}, "
                               f"got {type(tree).__name__}")
    out: dict[str, Any] = {}
    for section, files in tree.items():
        if section not in INPUTS:
            raise ReportInputError(f"report inputs: unknown section {section!r}; known: {list(INPUTS)}")
        if not isinstance(files, dict):
            raise ReportInputError(f"report inputs: {section} must be an object name -> path")
        names = INPUTS[section]
        unknown = sorted(set(files) - set(names)) if names is not None else []
        if unknown:
            raise ReportInputError(f"report inputs: unknown {section} input(s) {unknown}; known: {list(names)}")
        out[section] = {name: _path(f"{section}.{name}", v) for name, v in files.items()}
    for section, name in REQUIRED_INPUTS:
        if name not in out.get(section, {}):
            raise ReportInputError(f"report inputs: {section}.{name} is required")
    return out


def _path(key: str, value: Any) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise ReportInputError(f"report inputs: {key} must be a path, got {value!r}")
    return Path(value)


@contextlib.contextmanager
def opened(path: Path, what: str) -> Iterator[BinaryIO]:
    """``path`` opened as a regular file only (``fsutil.open_regular``: a FIFO or folder is named for
    what it is and never blocks); a missing one fails naming ``what``."""
    try:
        fh = open_regular(path, what=what)
    except FileNotFoundError as exc:
        raise ReportInputError(f"{what} not found: {path}") from exc
    with fh:
        yield fh


def _record(read: Callable[..., Any], path: Path, *args: Any) -> Any:
    """What ``read`` (a record's one reader) makes of ``path``; its refusal is the report's (exit status 7)."""
    try:
        return read(Path(path), *args)
    except (MetricsRecordError, PredictionsRecordError, ExternalInputError, EpochsRecordError,
            ComparisonRecordError) as exc:
        raise ReportInputError(str(exc)) from exc


def load_metrics_json(path: Path) -> dict[str, Any]:
    """The evaluation's metrics.json, read through its record (``chexflow.evaluate.record``: one
    format, the writer's), arranged for the views: per label ``ci_low``/``ci_high`` and the operating
    point evaluation chose with its split; ``raw_labels``: the record's entries as written."""
    data = _record(read_metrics, path)
    labels = {label: {"auroc": e["auroc"], "n_pos": e.get("n_pos"), "n_neg": e.get("n_neg"), **ci_columns(e["ci"]),
                      "operating_point": e.get("test_operating_point"),
                      "operating_point_split": e.get("operating_point_split")}
              for label, e in data["labels"].items()}
    boot = data["bootstrap"]
    return {
        "labels": labels,
        "mean_auroc": data["mean_auroc"],
        "mean_auroc_ci": boot["mean_auroc_ci"],
        "n_images": data["n_images"],
        "n_patients": data["n_patients"],
        # what newer evaluations add (absent keys: the section says nothing)
        "raw_labels": data["labels"],
        **{key: data.get(key) for key in ("model_epoch", "model_val_metric", "model_init", "model_arch", "model_seed",
                                          "min_val_positives", "min_patients", "calibration_bins", "subgroups",
                                          "localisation", "underdiagnosis", "host", "training_host",
                                          "published_comparable")},
        **{key: boot.get(key) for key in ("mean_rule", "mean_resamples_used", "n_resamples")},
    }


def load_external(path: Path) -> dict[str, Any]:
    """An external validation's record (``chexflow.evaluate.external``)."""
    return _record(read_record, path)


def load_metrics_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    """Per-epoch training metrics, read through the training's record (``chexflow.train.epochs``)."""
    return _record(read_epochs, path, what)


def load_comparison(path: Path) -> dict[str, Any]:
    """The ablation's comparison, read through its record (``chexflow.evaluate.comparison_record``)."""
    return dict(_record(read_comparison, path))


def load_manifest(path: Path, dataset: str) -> dict[str, Any]:
    """Shard manifest (``data/shards/<dataset>/manifest.json``)."""
    data = read_json(path, ReportInputError, what=f"manifest of dataset {dataset!r}")
    if not isinstance(data, dict):
        raise ReportInputError(f"{path}: top level must be an object")
    for key in ("splits", "labels"):
        if key not in data:
            raise ReportInputError(f"{path}: missing key {key!r}")
    if not isinstance(data["splits"], dict) or not data["splits"]:
        raise ReportInputError(f"{path}: 'splits' must be a non-empty object")
    for split, info in data["splits"].items():
        if not isinstance(info, dict) or "n_images" not in info:
            raise ReportInputError(f"{path}: splits[{split!r}] must be an object with 'n_images'")
    return data


def load_predictions(path: Path, labels: list[str]) -> pd.DataFrame:
    """predictions.csv, read through the evaluation's record (``chexflow.evaluate.record``)."""
    return _record(read_predictions, path, labels)


def load_benchmark(path: Path, stage: str) -> dict[str, Any]:
    """Snakemake ``benchmark:`` file (TSV with header ``s  h:m:s  max_rss ...``); repeats averaged."""
    path = Path(path)
    try:
        with opened(path, f"benchmark file of stage {stage!r}") as fh:
            df = pd.read_csv(fh, sep="\t", na_values=["-", "NA"])
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ReportInputError(f"{path}: cannot parse Snakemake benchmark TSV: {exc}") from exc
    if "s" not in df.columns or df.empty:
        raise ReportInputError(f"{path}: expected a Snakemake benchmark TSV with an 's' column and a data row")
    seconds = float(pd.to_numeric(df["s"], errors="coerce").mean())
    rss = pd.to_numeric(df["max_rss"], errors="coerce").max() if "max_rss" in df.columns else float("nan")
    return {"stage": stage, "seconds": seconds, "hms": hms(seconds), "repeats": int(len(df)),
            "max_rss_mb": None if pd.isna(rss) else float(rss)}


def read_csv(path: Path, what: str, columns: tuple[str, ...]) -> pd.DataFrame:
    path = Path(path)
    try:
        with opened(path, what) as fh:
            df = pd.read_csv(fh)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: cannot parse as CSV: {exc}") from exc
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ReportInputError(f"{path}: missing column(s) {missing}")
    return df


def png_data_uri(path: Path, what: str) -> str:
    with opened(Path(path), what) as fh:
        return "data:image/png;base64," + base64.b64encode(fh.read()).decode("ascii")


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in json.loads(df.to_json(orient="records"))]
