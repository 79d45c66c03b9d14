"""The test results' views: AUROC per finding and mean beside the published ones, ROC curves with the
evaluation's operating points, precision-recall and calibration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import roc_curve

from chexflow.evaluate import published
from chexflow.evaluate.intervals import ci_columns
from chexflow.evaluate.metrics import precision_recall
from chexflow.report import plots
from chexflow.report.templating import mean_of


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
    too_few: str | None = None       # the small-count rule's words (the CI withheld)
    dropped: int | None = None       # bootstrap resamples dropped (one class in the resample)
    vs_chance: str | None = None     # the evaluation's verdict of the CI against 0.5 (above, includes, below)

    @property
    def diff(self) -> float | None:
        if self.synthetic or self.ours is None or self.chexnet is None:
            return None
        return self.ours - self.chexnet

    @property
    def chance_note(self) -> str:
        """Below 0.5: the evaluation's verdict of the CI against chance, in words."""
        if self.ours is None or self.ours >= 0.5:
            return ""
        return {"below": "below chance (CI below 0.5)", "includes": "below 0.5, CI includes chance"}.get(
            self.vs_chance or "", "below 0.5, no CI")


def auroc_rows(metrics: dict[str, Any], *, synthetic: bool = False) -> list[AurocRow]:
    nih_findings = bool(metrics.get("published_comparable"))     # decided by evaluation
    return [AurocRow(label=lab, display=plots.display_name(lab), ours=e["auroc"], ci_low=e["ci_low"],
                     ci_high=e["ci_high"], n_pos=e["n_pos"], n_neg=e["n_neg"],
                     chexnet=published.CHEXNET_AUROC.get(lab) if nih_findings else None,
                     wang=published.WANG2017_AUROC.get(lab) if nih_findings else None,
                     n_pos_patients=metrics["raw_labels"][lab].get("n_pos_patients"), synthetic=synthetic,
                     too_few=metrics["raw_labels"][lab].get("too_few"),
                     dropped=metrics["raw_labels"][lab].get("ci_resamples_dropped"),
                     vs_chance=metrics["raw_labels"][lab].get("vs_chance"))
            for lab, e in metrics["labels"].items()]


def mean_row(rows: list[AurocRow], metrics: dict[str, Any], *, synthetic: bool = False) -> dict[str, Any]:
    defined = [r for r in rows if r.ours is not None]
    chexnet = mean_of([r.chexnet for r in defined])
    ours = metrics["mean_auroc"]
    return {
        "ours": ours, **ci_columns(metrics["mean_auroc_ci"]),
        "chexnet": chexnet, "wang": mean_of([r.wang for r in defined]),
        "diff": None if synthetic or ours is None or chexnet is None else ours - chexnet,
        "n_defined": len(defined), "n_labels": len(rows), "rule": metrics.get("mean_rule"),
        "resamples_used": metrics.get("mean_resamples_used"), "n_resamples": metrics.get("n_resamples"),
    }


def roc_view(df: pd.DataFrame | None, labels: list[str], metrics: dict[str, Any]) -> dict[str, Any] | None:
    """ROC curves from predictions.csv and the operating points the evaluation chose and recorded,
    each with the split its threshold was chosen on (``chexflow.evaluate.record``). The section's
    source is "validation" when any threshold was chosen there, else "test" (optimistic)."""
    entries = metrics["labels"]
    splits = {entries[lab]["operating_point_split"] for lab in labels if entries[lab]["operating_point"]}
    if df is None and not splits:
        return None
    source = "validation" if "validation" in splits or not splits else "test"
    curves: dict[str, Any] = {}
    ops = []
    for lab in labels:
        op, split = entries[lab]["operating_point"], entries[lab]["operating_point_split"]
        if df is not None:
            known = df[lab].notna()
            t = df.loc[known, lab].to_numpy(dtype=float)
            s = df.loc[known, f"{lab}_score"].to_numpy(dtype=float)
            if np.unique(t).size == 2:
                fpr, tpr, _ = roc_curve(t.astype(int), s)
                dot = None
                if op and op.get("sensitivity") is not None and op.get("specificity") is not None:
                    dot = (1.0 - op["specificity"], op["sensitivity"])
                curves[lab] = (fpr, tpr, entries[lab]["auroc"], dot)     # the title: the recorded AUROC
        raw = metrics["raw_labels"][lab]
        ops.append({"display": plots.display_name(lab), "op": op, "split": split,
                    "iv": raw.get("test_operating_point_intervals") or {},
                    "val_pos": raw.get("val_positives"), "val_pos_patients": raw.get("val_positive_patients"),
                    "few": bool(raw.get("threshold_few_positives")) and split == "validation"})
    return {"plot": plots.roc_grid(curves) if curves else None, "operating_points": ops,
            "threshold_source": source, "min_val_positives": metrics.get("min_val_positives"),
            "n_few": sum(o["few"] for o in ops), "n_test_chosen": sum(o["split"] == "test" for o in ops),
            "n_images": None if df is None else int(len(df)),
            "n_patients": None if df is None else int(df["patient"].nunique())}


def calibration_view(metrics: dict[str, Any], df: pd.DataFrame | None, labels: list[str]) -> dict[str, Any] | None:
    raw = metrics["raw_labels"]
    rows = [{"display": plots.display_name(lab), "auprc": raw[lab].get("auprc"),
             "prevalence": raw[lab].get("prevalence"), "too_few": raw[lab].get("too_few"),
             **{k: (raw[lab].get("calibration") or {}).get(k) for k in ("brier", "ece")},
             **{k: (raw[lab].get("score_intervals") or {}).get(k) for k in ("auprc_ci", "brier_ci", "ece_ci")}}
            for lab in labels]
    if all(r["auprc"] is None for r in rows):
        return None
    curves = {}
    if df is not None:
        for lab in labels:
            known = df[lab].notna()
            t, sc = df.loc[known, lab].to_numpy(float), df.loc[known, f"{lab}_score"].to_numpy(float)
            if np.unique(t).size == 2:
                pr = precision_recall(t, sc)
                curves[lab] = (np.asarray(pr["recall"]), np.asarray(pr["precision"]), raw[lab].get("auprc"),
                               pr["prevalence"])   # the title: the recorded AUPRC
    bins = {lab: (raw[lab].get("calibration") or {}).get("bins") for lab in labels if raw[lab].get("calibration")}
    return {"rows": rows, "pr_plot": plots.pr_grid(curves) if curves else None,
            "reliability_plot": plots.reliability_grid(bins) if bins else None,
            "n_bins": metrics.get("calibration_bins")}

