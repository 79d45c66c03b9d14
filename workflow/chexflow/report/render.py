"""Render the single-file HTML report of a chexflow run.

Everything is embedded (inline CSS, figures as base64 PNG data URIs): the HTML opens
offline, can be mailed, and references no external asset. The Jinja2 template
``templates/report.html.j2`` is loaded as package data through importlib.resources.
"""

from __future__ import annotations

import base64
import json
import math
import os
import platform
import socket
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pandas as pd
import yaml
from sklearn.metrics import auc, roc_curve

from chexflow.evaluate import published
from chexflow.evaluate.metrics import (operating_point, paired_bootstrap_auroc_diff, paired_bootstrap_over_seeds,
                                       precision_recall, youden_threshold)
from chexflow.fsutil import write_text_atomic
from chexflow.report import analyses, plots
from chexflow.report.ablation_arms import aligned as _aligned
from chexflow.report.ablation_arms import published_comparisons
from chexflow.report.ablation_arms import verdict as _verdict
from chexflow.report.errors import ReportInputError

__all__ = ["ReportInputError", "render_report", "collect_provenance", "package_versions", "INPUTS"]

SYNTHETIC_BANNER = ("These results are on the embedded SYNTHETIC demo data (phantoms, not real radiographs): "
                    "the numbers say nothing about real chest X-ray performance.")
PILOT_BANNER = ("PILOT on {n_parts} of {n_release} archives of {title}: {n_found:,} of the {n_listed:,} images "
                "named in the split lists were used. These numbers are NOT comparable with CheXNet or the other "
                "published results.")

PROVENANCE_PACKAGES = ("torch", "torchvision", "horovod", "snakemake", "scikit-learn", "numpy", "pandas",
                       "matplotlib", "jinja2", "webdataset")
EPOCH_KEYS = ("epoch", "train_loss", "val_loss", "val_metric", "val_metric_name", "lr", "images_per_sec",
              "epoch_time_s", "world_size")
TEMPLATE_NAME = "report.html.j2"
MODEL_CARD_TEMPLATE = "model_card.md.j2"

# The structure of the report's inputs (``--inputs-json``; the workflow's report_input_tree): a
# section's files by name. None: any name (benchmarks: stage -> TSV; ablation: run -> its files).
INPUTS: dict[str, tuple[str, ...] | None] = {
    "evaluation": ("metrics", "predictions", "saliency"),
    "training": ("pretrain", "finetune"),
    "manifests": ("pretrain", "finetune"),
    "benchmarks": None,
    "ablation": None,
    "scaling": ("table", "plot"),
    "sweep": ("table", "selection", "metrics"),
}
REQUIRED_INPUTS = (("evaluation", "metrics"), ("training", "pretrain"), ("training", "finetune"))
ABLATION_RUN_FILES = ("metrics", "predictions", "training")


# --------------------------------------------------------------------------- provenance
def package_versions(names: tuple[str, ...] = PROVENANCE_PACKAGES) -> dict[str, str]:
    """Installed distribution versions (``"not installed"`` when absent), plus python."""
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _git(repo_dir: Path, *args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def collect_provenance(repo_dir: Path | None) -> dict[str, Any]:
    """Git commit (``"unknown"`` without git/repo), dirty flag, host, UTC date, versions, SLURM job id."""
    commit = dirty = None
    if repo_dir is not None:
        commit = _git(Path(repo_dir), "rev-parse", "HEAD")
        if commit is not None:
            status = _git(Path(repo_dir), "status", "--porcelain", "--untracked-files=no")
            dirty = bool(status) if status is not None else None
    prov: dict[str, Any] = {
        "git_commit": commit or "unknown",
        "git_dirty": dirty,
        "host": socket.gethostname(),
        "date_utc": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "platform": platform.platform(),
        "packages": package_versions(),
    }
    if os.environ.get("SLURM_JOB_ID"):
        prov["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return prov


# --------------------------------------------------------------------------- loaders
def _read_json(path: Path, what: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{what} {path} is not valid JSON: {exc}") from exc


def _number_or_none(value: Any, path: Path, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportInputError(f"{path}: {key} must be a number or null, got {value!r}")
    return None if math.isnan(float(value)) else float(value)


def _ci_pair(value: Any, path: Path, key: str) -> list[float | None] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ReportInputError(f"{path}: {key} must be [low, high] or null, got {value!r}")
    return [_number_or_none(v, path, key) for v in value]


def load_metrics_json(path: Path) -> dict[str, Any]:
    """Evaluation metrics.json (contract format).

    Optional extras that are shown when present: a per-label CI as ``ci_low``/``ci_high`` or
    ``ci: [low, high]``; the mean's CI as top-level ``mean_auroc_ci`` or
    ``bootstrap.mean_auroc_ci``; per-label ``threshold_val_youden`` with
    ``test_operating_point`` (the dict of ``metrics.operating_point``).
    """
    data = _read_json(path, "metrics.json")
    if not isinstance(data, dict):
        raise ReportInputError(f"{path}: top level must be an object")
    for key in ("labels", "mean_auroc", "n_images", "n_patients"):
        if key not in data:
            raise ReportInputError(f"{path}: missing key {key!r}")
    if not isinstance(data["labels"], dict) or not data["labels"]:
        raise ReportInputError(f"{path}: 'labels' must be a non-empty object label -> {{auroc, n_pos, n_neg}}")
    labels: dict[str, dict[str, Any]] = {}
    for label, entry in data["labels"].items():
        if not isinstance(entry, dict) or "auroc" not in entry:
            raise ReportInputError(f"{path}: labels[{label!r}] must be an object with an 'auroc' key")
        ci = _ci_pair(entry.get("ci"), path, f"labels[{label!r}].ci") or [
            _number_or_none(entry.get("ci_low"), path, f"labels[{label!r}].ci_low"),
            _number_or_none(entry.get("ci_high"), path, f"labels[{label!r}].ci_high")]
        op = entry.get("test_operating_point")
        if op is not None and not isinstance(op, dict):
            raise ReportInputError(f"{path}: labels[{label!r}].test_operating_point must be an object")
        labels[label] = {
            "auroc": _number_or_none(entry["auroc"], path, f"labels[{label!r}].auroc"),
            "n_pos": entry.get("n_pos"),
            "n_neg": entry.get("n_neg"),
            "ci_low": ci[0],
            "ci_high": ci[1],
            "val_operating_point": op,
        }
    boot = data.get("bootstrap") if isinstance(data.get("bootstrap"), dict) else {}
    mean_ci = _ci_pair(data.get("mean_auroc_ci", boot.get("mean_auroc_ci")), path, "mean_auroc_ci")
    for key in ("subgroups", "localisation", "underdiagnosis"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ReportInputError(f"{path}: {key} must be an object")
    epoch = data.get("model_epoch")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise ReportInputError(f"{path}: model_epoch must be an integer, got {epoch!r}")
    return {
        "labels": labels,
        "mean_auroc": _number_or_none(data["mean_auroc"], path, "mean_auroc"),
        "mean_auroc_ci": mean_ci if mean_ci and None not in mean_ci else None,
        "n_images": data["n_images"],
        "n_patients": data["n_patients"],
        # what newer evaluations add (absent keys: the section says nothing)
        "raw_labels": {label: entry for label, entry in data["labels"].items()},
        "model_epoch": epoch,
        "model_val_metric": _number_or_none(data.get("model_val_metric"), path, "model_val_metric"),
        "model_init": data.get("model_init"),
        "model_arch": data.get("model_arch"),
        "model_seed": data.get("model_seed"),
        "mean_rule": boot.get("mean_rule"),
        "mean_resamples_used": boot.get("mean_resamples_used"),
        "n_resamples": boot.get("n_resamples"),
        "min_val_positives": data.get("min_val_positives"),
        "calibration_bins": data.get("calibration_bins"),
        "subgroups": data.get("subgroups"),
        "localisation": data.get("localisation"),
        "underdiagnosis": data.get("underdiagnosis"),
    }


def load_metrics_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    """Per-epoch training metrics (one JSON object per line, contract keys)."""
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"{what} training metrics not found: {path}")
    epochs = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportInputError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ReportInputError(f"{path}:{lineno}: expected a JSON object per line")
        missing = [k for k in ("epoch", "train_loss", "val_metric") if k not in obj]
        if missing:
            raise ReportInputError(f"{path}:{lineno}: missing key(s) {missing}")
        epochs.append(obj)
    if not epochs:
        raise ReportInputError(f"{path}: no epochs recorded ({what} training metrics are empty)")
    return epochs


def load_manifest(path: Path, dataset: str) -> dict[str, Any]:
    """Shard manifest (``data/shards/<dataset>/manifest.json``)."""
    data = _read_json(path, f"manifest of dataset {dataset!r}")
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
    """predictions.csv: image, patient, then per label ``L`` (0/1/empty) and ``L_score``."""
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"predictions.csv not found: {path}")
    try:
        df = pd.read_csv(path, dtype={"image": str, "patient": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: cannot parse as CSV: {exc}") from exc
    needed = ["image", "patient"] + [c for lab in labels for c in (lab, f"{lab}_score")]
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise ReportInputError(f"{path}: missing column(s) {missing}")
    for lab in labels:
        for col in (lab, f"{lab}_score"):
            if not pd.api.types.is_numeric_dtype(df[col]):
                raise ReportInputError(f"{path}: column {col!r} is not numeric")
    return df


def load_benchmark(path: Path, stage: str) -> dict[str, Any]:
    """Snakemake ``benchmark:`` file (TSV with header ``s  h:m:s  max_rss ...``); repeats averaged."""
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"benchmark file of stage {stage!r} not found: {path}")
    try:
        df = pd.read_csv(path, sep="\t", na_values=["-", "NA"])
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ReportInputError(f"{path}: cannot parse Snakemake benchmark TSV: {exc}") from exc
    if "s" not in df.columns or df.empty:
        raise ReportInputError(f"{path}: expected a Snakemake benchmark TSV with an 's' column and a data row")
    seconds = float(pd.to_numeric(df["s"], errors="coerce").mean())
    rss = pd.to_numeric(df["max_rss"], errors="coerce").max() if "max_rss" in df.columns else float("nan")
    return {"stage": stage, "seconds": seconds, "hms": _hms(seconds), "repeats": int(len(df)),
            "max_rss_mb": None if pd.isna(rss) else float(rss)}


# --------------------------------------------------------------------------- view model
def _hms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


@dataclass(frozen=True)
class AurocRow:
    label: str
    display: str
    ours: float | None
    ci_low: float | None
    ci_high: float | None
    n_pos: Any
    n_neg: Any
    chexnet: float | None
    wang: float | None
    n_pos_patients: Any = None
    synthetic: bool = False          # published numbers for orientation only: no difference

    @property
    def diff(self) -> float | None:
        if self.synthetic or self.ours is None or self.chexnet is None:
            return None
        return self.ours - self.chexnet

    @property
    def chance_note(self) -> str:
        """Below 0.5: whether the CI says worse than chance or cannot tell."""
        if self.ours is None or self.ours >= 0.5:
            return ""
        if self.ci_high is not None and self.ci_high < 0.5:
            return "below chance (CI below 0.5)"
        return "below 0.5, CI includes chance" if self.ci_low is not None else "below 0.5, no CI"


def _auroc_rows(metrics: dict[str, Any], *, synthetic: bool = False) -> list[AurocRow]:
    return [AurocRow(label=lab, display=plots.display_name(lab), ours=e["auroc"], ci_low=e["ci_low"],
                     ci_high=e["ci_high"], n_pos=e["n_pos"], n_neg=e["n_neg"],
                     chexnet=published.CHEXNET_AUROC.get(lab), wang=published.WANG2017_AUROC.get(lab),
                     n_pos_patients=metrics["raw_labels"][lab].get("n_pos_patients"), synthetic=synthetic)
            for lab, e in metrics["labels"].items()]


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _mean_row(rows: list[AurocRow], metrics: dict[str, Any], *, synthetic: bool = False) -> dict[str, Any]:
    defined = [r for r in rows if r.ours is not None]
    chexnet = _mean([r.chexnet for r in defined])
    ours = metrics["mean_auroc"]
    ci = metrics["mean_auroc_ci"]
    return {
        "ours": ours, "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None,
        "chexnet": chexnet, "wang": _mean([r.wang for r in defined]),
        "diff": None if synthetic or ours is None or chexnet is None else ours - chexnet,
        "n_defined": len(defined), "n_labels": len(rows), "rule": metrics.get("mean_rule"),
        "resamples_used": metrics.get("mean_resamples_used"), "n_resamples": metrics.get("n_resamples"),
    }


def _dataset_view(name: str, manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    splits = []
    for split, info in manifest["splits"].items():
        splits.append({"name": split, "n_images": info.get("n_images"), "n_patients": info.get("n_patients"),
                       "n_shards": info.get("n_shards", len(info.get("shards", []) or []))})
    prevalence = []
    for label in manifest["labels"]:
        cells = []
        for split, info in manifest["splits"].items():
            count = (info.get("label_counts") or {}).get(label)
            n = info.get("n_images") or 0
            cells.append({"count": count, "pct": (100.0 * count / n) if count is not None and n else None})
        prevalence.append({"label": plots.display_name(str(label)), "cells": cells})
    for row, (split, info) in zip(splits, manifest["splits"].items()):
        row["n_listed"] = info.get("n_listed")
    return {"name": name, "title": manifest.get("title", name), "synthetic": bool(manifest.get("synthetic", False)),
            "split_source": manifest.get("split_source"), "release": _release_text(manifest),
            "task": manifest.get("task", "?"), "image_size": manifest.get("image_size"),
            "n_rejects": manifest.get("n_rejects"), "splits": splits, "split_names": list(manifest["splits"]),
            "prevalence": prevalence, "path": str(path)}


def _release_text(manifest: dict[str, Any]) -> str:
    """How much of the release a dataset's shards hold (from the manifest's coverage record)."""
    cov = manifest.get("coverage")
    if not cov:
        return "coverage not recorded"
    used = f"{cov['n_found']:,} of {cov['n_listed']:,} listed images"
    if cov.get("pilot"):
        return (f"PILOT on {len(cov['parts'])} of {cov['n_release_parts']} archives ({', '.join(cov['parts'])}): "
                f"{used}; not comparable with published results")
    return f"all {len(cov['parts'])} archives: {used}"


def _run_view(config: dict[str, Any], manifests: dict[str, dict[str, Any]], pretrain: list[dict[str, Any]],
              finetune: list[dict[str, Any]]) -> dict[str, Any]:
    """What was run, from the config, the manifests and the training logs: architectures,
    datasets, backends, world sizes, the split used and how much of the release."""
    study = config.get("study") or {}
    names = list(manifests)
    stages = []
    for key, what, epochs, fallback in (("pretrain", "pretraining", pretrain, names[:1]),
                                        ("finetune", "fine-tuning", finetune, names[-1:])):
        section = config.get(key) or {}
        dataset = study.get(f"{key}_dataset") or (fallback[0] if fallback else None)
        manifest = manifests.get(dataset, {})
        world = epochs[-1].get("world_size")
        stages.append({
            "what": what, "dataset": dataset, "title": manifest.get("title", dataset or "unknown dataset"),
            "arch": (section.get("model") or {}).get("arch", "unknown architecture"),
            "backend": section.get("backend", "unknown backend"),
            "world": "?" if world is None else world,
            "split": manifest.get("split_source") or "not recorded",
            "release": _release_text(manifest) if manifest else "n/a",
        })
    subtitle = " and ".join(f"{s['arch']} {s['what']} on {s['title']} ({s['backend']}, {s['world']} rank"
                            f"{'' if s['world'] == 1 else 's'})" for s in stages)
    fine = stages[-1]
    cov = manifests.get(fine["dataset"], {}).get("coverage") or {}
    pilot = None
    if cov.get("pilot"):
        pilot = PILOT_BANNER.format(n_parts=len(cov["parts"]), n_release=cov["n_release_parts"], title=fine["title"],
                                    n_found=cov["n_found"], n_listed=cov["n_listed"])
    return {"subtitle": subtitle, "stages": stages, "pilot_banner": pilot}


def _training_view(epochs: list[dict[str, Any]], title: str, *, tested: dict[str, Any] | None = None) -> dict[str, Any]:
    """``tested``: the evaluation's metrics of the model file (which epoch was tested)."""
    last = epochs[-1]
    total = sum(float(e.get("epoch_time_s") or 0.0) for e in epochs)
    metric_name = str(last.get("val_metric_name") or "val_metric")
    best = max((e for e in epochs if e.get("val_metric") is not None), key=lambda e: e["val_metric"], default=None)
    return {
        "title": title,
        "plot": plots.training_curves(epochs, title),
        "n_epochs": len(epochs),
        "world_size": last.get("world_size"),
        "total_time": _hms(total),
        "metric_name": metric_name.replace("_", " "),
        "final_metric": last.get("val_metric"),
        "best_metric": None if best is None else best["val_metric"],
        "best_epoch": None if best is None else best["epoch"],
        "mean_images_per_sec": _mean([e.get("images_per_sec") for e in epochs]),
        "rows": [{k: e.get(k) for k in EPOCH_KEYS} for e in epochs],
        "tested_epoch": None if tested is None else tested.get("model_epoch"),
        "tested_metric": None if tested is None else tested.get("model_val_metric"),
    }


def _roc_view(df: pd.DataFrame | None, labels: list[str], metrics: dict[str, Any]) -> dict[str, Any] | None:
    """ROC curves from predictions.csv and operating points.

    Operating points come from metrics.json (threshold chosen on the validation set) when it
    has them; otherwise the Youden threshold is chosen on the test predictions themselves
    (flagged as optimistic in the report).
    """
    val_ops = {lab: metrics["labels"][lab]["val_operating_point"] for lab in labels
               if metrics["labels"][lab]["val_operating_point"]}
    if df is None and not val_ops:
        return None
    source = "validation" if val_ops else "test"
    curves: dict[str, Any] = {}
    ops = []
    for lab in labels:
        op = val_ops.get(lab)
        if df is not None:
            known = df[lab].notna()
            t = df.loc[known, lab].to_numpy(dtype=float)
            s = df.loc[known, f"{lab}_score"].to_numpy(dtype=float)
            if np.unique(t).size == 2:
                fpr, tpr, _ = roc_curve(t.astype(int), s)
                if source == "test":
                    op = operating_point(t, s, youden_threshold(t, s))
                dot = None
                if op and op.get("sensitivity") is not None and op.get("specificity") is not None:
                    dot = (1.0 - op["specificity"], op["sensitivity"])
                curves[lab] = (fpr, tpr, float(auc(fpr, tpr)), dot)
        raw = metrics["raw_labels"][lab]
        ops.append({"display": plots.display_name(lab), "op": op, "val_pos": raw.get("val_positives"),
                    "val_pos_patients": raw.get("val_positive_patients"),
                    "few": bool(raw.get("threshold_few_positives")) and source == "validation"})
    return {"plot": plots.roc_grid(curves) if curves else None, "operating_points": ops,
            "threshold_source": source, "min_val_positives": metrics.get("min_val_positives"),
            "n_few": sum(o["few"] for o in ops),
            "n_images": None if df is None else int(len(df)),
            "n_patients": None if df is None else int(df["patient"].nunique())}


def _yaml(config: dict[str, Any]) -> str:
    plain = json.loads(json.dumps(config, default=str))  # Paths etc. -> str
    return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


def _signed(value: Any, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:+.{digits}f}"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, loader=jinja2.PackageLoader("chexflow.report", "templates"))
    env.filters["fmt"] = _fmt
    env.filters["signed"] = _signed
    return env


def _template(name: str = TEMPLATE_NAME, *, html: bool = True) -> jinja2.Template:
    template_file = resources.files("chexflow.report").joinpath("templates").joinpath(name)
    source = template_file.read_text(encoding="utf-8")
    env = _environment()
    env.autoescape = html          # the model card is Markdown: no HTML escaping
    return env.from_string(source)


def _limitations(ctx: dict[str, Any]) -> list[str]:
    """What the run itself shows about the limits of its numbers (the report's and the model card's list)."""
    out = []
    if ctx["synthetic_datasets"]:
        out.append("Trained and tested on synthetic phantoms: the numbers say nothing about real radiographs.")
    if ctx["run"]["pilot_banner"]:
        out.append("A pilot on part of the release: not comparable with published results.")
    undefined = [r.display for r in ctx["rows"] if r.ours is None]
    if undefined:
        out.append(f"No test AUROC for {', '.join(undefined)}: a single class in the test split.")
    weak = [r.display for r in ctx["rows"] if r.ci_low is not None and r.ci_low <= 0.5]
    if weak:
        out.append(f"The AUROC CI includes chance (0.5) or lies below it for {', '.join(weak)}.")
    roc = ctx["roc"]
    if roc and roc.get("n_few"):
        few = [o["display"] for o in roc["operating_points"] if o["few"]]
        out.append(f"Operating points of {', '.join(few)} rest on fewer than {roc['min_val_positives']} validation "
                   "positives (images or patients): their thresholds are unstable.")
    out += analyses.limitations(ctx)
    abl = ctx["ablation"]
    if abl and len(abl["seeds"]) == 1:
        out.append("The ablation rests on one training seed per arm: its CI covers the test patients, not training "
                   "randomness (ablation.seeds runs several).")
    return out


# --------------------------------------------------------------------------- optional studies
def _read_csv(path: Path, what: str, columns: tuple[str, ...]) -> pd.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"{what} not found: {path}")
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: cannot parse as CSV: {exc}") from exc
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ReportInputError(f"{path}: missing column(s) {missing}")
    return df


def _png_data_uri(path: Path, what: str) -> str:
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"{what} not found: {path}")
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in json.loads(df.to_json(orient="records"))]


def _scaling_view(csv: Path, plot: Path | None) -> dict[str, Any]:
    df = _read_csv(csv, "scaling table", ("world_size", "images_per_sec", "images_per_sec_per_rank", "speedup",
                                          "efficiency", "time_per_epoch_s"))
    return {"rows": _records(df), "plot": _png_data_uri(plot, "scaling plot") if plot else None,
            "baseline": int(df["world_size"].min()), "path": str(csv), "one_machine": _one_machine(df)}


def _one_machine(df: pd.DataFrame) -> dict[str, Any] | None:
    """The cores the ranks shared when every world size ran on one machine (None: unknown or several nodes)."""
    if not {"nodes", "cores_per_node"} <= set(df.columns):
        return None
    nodes = pd.to_numeric(df["nodes"], errors="coerce")
    cores = pd.to_numeric(df["cores_per_node"], errors="coerce")
    if nodes.isna().any() or cores.isna().any() or (nodes != 1).any() or cores.nunique() != 1:
        return None
    threads = pd.to_numeric(df.get("threads_per_rank"), errors="coerce") if "threads_per_rank" in df else None
    return {"cores": int(cores.iloc[0]), "max_world": int(df["world_size"].max()),
            "threads": None if threads is None or threads.isna().any()
            else {int(w): int(t) for w, t in zip(df["world_size"], threads)}}


def _sweep_view(table_csv: Path, selection_json: Path, winner_metrics: Path | None) -> dict[str, Any]:
    df = _read_csv(table_csv, "sweep table", ("trial", "status", "val_metric", "winner"))
    selection = _read_json(selection_json, "sweep selection")
    fixed = {"trial", "status", "val_metric", "val_metric_name", "best_epoch", "reason", "winner"}
    params = [c for c in df.columns if c not in fixed]
    test = load_metrics_json(Path(winner_metrics)) if winner_metrics else None
    winner = selection.get("winner", {}) if isinstance(selection, dict) else {}
    return {"rows": _records(df), "params": params, "winner": winner.get("trial"),
            "winner_params": winner.get("params", {}), "winner_val": winner.get("val_metric"),
            "n_trials": len(df), "n_failed": int((df["status"] != "ok").sum()),
            "test_mean_auroc": None if test is None else test["mean_auroc"],
            "test_mean_auroc_ci": None if test is None else test["mean_auroc_ci"]}


# --------------------------------------------------------------------------- the inputs, as one structure
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
        if section == "ablation":
            out[section] = {run: _run_files(run, f) for run, f in files.items()}
            continue
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


def _run_files(run: str, files: Any) -> dict[str, Path]:
    if not isinstance(files, dict) or set(files) != set(ABLATION_RUN_FILES):
        raise ReportInputError(f"report inputs: ablation.{run} must name exactly {list(ABLATION_RUN_FILES)}")
    return {k: _path(f"ablation.{run}.{k}", v) for k, v in files.items()}


# --------------------------------------------------------------------------- ablation
def _arm_name(init: str) -> str:
    names = {"pretrained": "Fine-tuned from the pretraining model", "random": "Fine-tuned from random init",
             "file": "Fine-tuned from published weights (init_file)"}
    return names.get(init, init)


def _ablation_view(runs: dict[str, dict[str, Path]], labels: list[str], config: dict,
                   main_metrics: dict[str, Any]) -> dict[str, Any] | None:
    """Pretrained vs random init, per training seed and over seeds: each run's test mean AUROC and
    tested epoch, the paired patient-bootstrap CI of the gain on the same images, per finding with CIs."""
    loaded = []
    for name, files in runs.items():
        m = load_metrics_json(files["metrics"])
        init, seed = m["model_init"], m["model_seed"]
        if init not in ("pretrained", "random", "file") or seed is None:
            raise ReportInputError(f"{files['metrics']}: names no init/seed of its model (model_init, model_seed)")
        loaded.append({"name": name, "init": init, "seed": int(seed), "metrics": m, "files": files,
                       "predictions": load_predictions(files["predictions"], labels),
                       "epochs": load_metrics_jsonl(files["training"], f"ablation run {name}")})
    by = {(r["init"], r["seed"]): r for r in loaded}
    seeds = sorted({r["seed"] for r in loaded if ("pretrained", r["seed"]) in by and ("random", r["seed"]) in by})
    if not seeds:
        raise ReportInputError("the ablation's runs hold no seed with both arms (pretrained and random)")
    ev = config.get("evaluate") or {}
    boot = {"n_resamples": int(ev.get("bootstrap_resamples", 1000)), "seed": int(ev.get("seed", 0))}
    ref = by[("pretrained", seeds[0])]["predictions"]
    pairs = [(_aligned(ref, by[("pretrained", s)]), _aligned(ref, by[("random", s)])) for s in seeds]
    y = ref[labels].to_numpy(float)
    cols = [f"{lab}_score" for lab in labels]
    scores = [(p[cols].to_numpy(float), r[cols].to_numpy(float)) for p, r in pairs]
    per_seed = []
    for s_, (a, b) in zip(seeds, scores):
        res = paired_bootstrap_auroc_diff(y, a, b, ref["patient"].to_numpy(), labels, **boot)
        epochs = {init: by[(init, s_)]["metrics"]["model_epoch"] for init in ("pretrained", "random")}
        per_seed.append({**res, "seed": s_, **_verdict(res["ci"]), "epochs": epochs})
    over = paired_bootstrap_over_seeds(y, scores, ref["patient"].to_numpy(), labels, **boot) if len(seeds) > 1 else None
    first = per_seed[0]
    main_seed = main_metrics.get("model_seed")
    main_init = main_metrics.get("model_init") or "pretrained"
    other = next((r for r in loaded if r["init"] != main_init and r["seed"] == main_seed), None)
    rows = [{"name": _arm_name(r["init"]), "init": r["init"], "seed": r["seed"],
             "mean_auroc": r["metrics"]["mean_auroc"], "ci": r["metrics"]["mean_auroc_ci"], "epoch": r["metrics"]["model_epoch"],
             "n_epochs": len(r["epochs"]), "where": str(r["files"]["metrics"].parent)}
            for r in sorted(loaded, key=lambda r: (r["seed"], ("pretrained", "random", "file").index(r["init"])))]
    return {
        "rows": rows, "seeds": seeds, "per_seed": per_seed, "paired": first if len(seeds) == 1 else None,
        "over_seeds": None if over is None else {**over, **_verdict(over["ci"], over["t_ci"])},
        "per_label": [{"display": plots.display_name(lab), **first["labels"][lab]} for lab in first["labels_used"]],
        "other_training": None if other is None else _training_view(
            other["epochs"], f"Ablation: fine-tuning from {other['init']} init (seed {other['seed']})",
            tested=other["metrics"]),
        "main_init": main_init, "other_init": "pretrained" if main_init == "random" else "random",
        "published": published_comparisons(by, seeds, ref, labels, boot),
    }


# --------------------------------------------------------------------------- calibration
def _calibration_view(metrics: dict[str, Any], df: pd.DataFrame | None, labels: list[str]) -> dict[str, Any] | None:
    raw = metrics["raw_labels"]
    rows = [{"display": plots.display_name(lab), "auprc": raw[lab].get("auprc"), "prevalence": raw[lab].get("prevalence"),
             **{k: (raw[lab].get("calibration") or {}).get(k) for k in ("brier", "ece")}} for lab in labels]
    if all(r["auprc"] is None for r in rows):
        return None
    curves = {}
    if df is not None:
        for lab in labels:
            known = df[lab].notna()
            t, sc = df.loc[known, lab].to_numpy(float), df.loc[known, f"{lab}_score"].to_numpy(float)
            if np.unique(t).size == 2:
                pr = precision_recall(t, sc)
                curves[lab] = (np.asarray(pr["recall"]), np.asarray(pr["precision"]), pr["auprc"], pr["prevalence"])
    bins = {lab: (raw[lab].get("calibration") or {}).get("bins") for lab in labels if raw[lab].get("calibration")}
    return {"rows": rows, "pr_plot": plots.pr_grid(curves) if curves else None,
            "reliability_plot": plots.reliability_grid(bins) if bins else None,
            "n_bins": metrics.get("calibration_bins")}


# --------------------------------------------------------------------------- entry point
def render_report(out_html: Path, *, inputs: dict[str, Any], config: dict, provenance: dict,
                  model_card: Path | None = None) -> None:
    """Write the self-contained HTML report to ``out_html`` (atomically), and the model card to
    ``model_card`` when given.

    ``inputs``: the report's files as one structure (``INPUTS``; the workflow's report_input_tree);
    a section appears for what is there (the studies switched on, the ablation's runs).
    """
    out_html = Path(out_html)
    tree = check_inputs(inputs)
    ev, tr = tree["evaluation"], tree["training"]
    metrics = load_metrics_json(ev["metrics"])
    labels = list(metrics["labels"])
    pretrain = load_metrics_jsonl(tr["pretrain"], "pretraining")
    finetune = load_metrics_jsonl(tr["finetune"], "fine-tuning")
    loaded = {}
    for role, p in tree.get("manifests", {}).items():
        m = load_manifest(p, role)
        loaded[str(m.get("dataset", role))] = (m, p)
    datasets = [_dataset_view(name, m, p) for name, (m, p) in loaded.items()]
    manifests = {name: m for name, (m, _) in loaded.items()}
    synthetic = [d["name"] for d in datasets if d["synthetic"]]
    benchmarks = [load_benchmark(p, stage) for stage, p in tree.get("benchmarks", {}).items()]
    predictions = load_predictions(ev["predictions"], labels) if "predictions" in ev else None
    roc = _roc_view(predictions, labels, metrics)

    sc, sw = tree.get("scaling"), tree.get("sweep")
    if sw is not None and {"table", "selection"} - set(sw):
        raise ReportInputError("the sweep section needs both the sweep table and the selection JSON")
    scaling_view = _scaling_view(sc["table"], sc.get("plot")) if sc else None
    sweep_view = _sweep_view(sw["table"], sw["selection"], sw.get("metrics")) if sw else None
    ablation_view = _ablation_view(tree["ablation"], labels, config, metrics) if tree.get("ablation") else None

    rows = _auroc_rows(metrics, synthetic=bool(synthetic))
    prov = dict(provenance)
    prov.setdefault("packages", package_versions())
    prov.setdefault("git_commit", "unknown")
    packages = prov.pop("packages")
    training = [_training_view(pretrain, "Pretraining"), _training_view(finetune, "Fine-tuning", tested=metrics)]
    context = {
        "title": "chexflow report",
        "generated_utc": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "synthetic_banner": SYNTHETIC_BANNER if synthetic else None,
        "run": _run_view(config, manifests, pretrain, finetune),
        "synthetic_datasets": synthetic,
        "datasets": datasets,
        "benchmarks": benchmarks,
        "total_stage_time": _hms(sum(b["seconds"] for b in benchmarks)) if benchmarks else None,
        "metrics": metrics,
        "rows": rows,
        "mean": _mean_row(rows, metrics, synthetic=bool(synthetic)),
        "below_chance": [r for r in rows if r.ours is not None and r.ours < 0.5],
        "bars": plots.auroc_bars(labels, {r.label: r.ours for r in rows}, published.CHEXNET_AUROC,
                                 published.WANG2017_AUROC),
        "has_ci": any(r.ci_low is not None for r in rows),
        "roc": roc,
        "calibration": _calibration_view(metrics, predictions, labels),
        "subgroups": analyses.subgroup_view(metrics),
        "localisation": analyses.localisation_view(metrics, ev.get("saliency"), labels),
        "underdiagnosis": analyses.underdiagnosis_view(metrics),
        "training": training,
        "tested": {"epoch": metrics.get("model_epoch"), "val_metric": metrics.get("model_val_metric")},
        "scaling": scaling_view,
        "sweep": sweep_view,
        "ablation": ablation_view,
        "published": analyses.published_view(),
        "split_caveat": published.SPLIT_CAVEAT,
        "config_yaml": _yaml(config),
        "config": config,
        "provenance": prov,
        "packages": packages,
    }
    context["limitations"] = _limitations(context)
    context["model_card_text"] = _template(MODEL_CARD_TEMPLATE, html=False).render(**context)
    write_text_atomic(out_html, _template().render(**context))
    if model_card is not None:
        write_text_atomic(Path(model_card), context["model_card_text"])
