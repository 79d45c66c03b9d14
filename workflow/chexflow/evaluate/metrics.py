"""Evaluation metrics: per-label AUROC, patient-level bootstrap CIs, operating points.

Per-label AUROC, its mean and top-1 accuracy are training's validation metrics too: they are
defined in ``chexflow.train.val_metrics`` (training must not import this layer) and used here.

numpy + scikit-learn only; torch tensors are accepted where noted but torch is never
imported here (conversion goes through ``.detach().cpu().numpy()``).

Conventions: ``y_true`` is float ``[N, L]`` with NaN for "unknown" (such entries are
left out of that label's AUROC), ``y_score`` is ``[N, L]`` (logits or probabilities:
AUROC is invariant to monotone transforms).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from sklearn.metrics import confusion_matrix, roc_curve

from chexflow.train.val_metrics import auroc_per_label, mean_auroc, to_numpy, top1_accuracy
from chexflow.train.val_metrics import check_scores as _check_2d

__all__ = [
    "auroc_per_label",
    "mean_auroc",
    "patient_resample_counts",
    "bootstrap_auroc",
    "paired_bootstrap_auroc_diff",
    "youden_threshold",
    "operating_point",
    "top1_accuracy",
    "to_numpy",
]


# --------------------------------------------------------------------------- bootstrap
def patient_resample_counts(groups: Sequence[Any], n_resamples: int, rng: np.random.Generator
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Draw patients with replacement.

    Returns ``(patient_index[N], counts[n_resamples, P])``: ``patient_index[i]`` is the
    patient of image ``i`` (0..P-1) and ``counts[b, p]`` how many times patient ``p`` is
    drawn in resample ``b`` (each resample draws P patients). Image ``i`` then enters
    resample ``b`` with multiplicity ``counts[b, patient_index[i]]`` -- all images of a
    patient come along together.
    """
    groups = np.asarray(groups)
    if groups.ndim != 1:
        raise ValueError(f"groups must be 1-D (one patient id per image), got shape {groups.shape}")
    _, patient_index = np.unique(groups, return_inverse=True)
    n_patients = int(patient_index.max()) + 1 if patient_index.size else 0
    if n_patients == 0:
        raise ValueError("groups is empty: nothing to resample")
    counts = rng.multinomial(n_patients, np.full(n_patients, 1.0 / n_patients), size=n_resamples)
    return patient_index.reshape(-1), counts


def _weighted_auroc_batch(t: np.ndarray, s: np.ndarray, w: np.ndarray) -> np.ndarray:
    """AUROC of one label for a batch of integer weight vectors.

    ``t`` (n,) 0/1, ``s`` (n,) scores, ``w`` (B, n) multiplicities. An image with weight
    k counts as k copies, so this equals ``roc_auc_score`` on the expanded sample
    (ties count 1/2). NaN where a resample has only one class.
    """
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    pos = t[order] == 1.0
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])  # tie groups
    ws = w[:, order]
    gpos = np.add.reduceat(np.where(pos, ws, 0.0), starts, axis=1)
    gneg = np.add.reduceat(np.where(pos, 0.0, ws), starts, axis=1)
    neg_below = np.cumsum(gneg, axis=1) - gneg
    num = (gpos * (neg_below + 0.5 * gneg)).sum(axis=1)
    n_pos = gpos.sum(axis=1)
    n_neg = gneg.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = num / (n_pos * n_neg)
    auc[(n_pos == 0) | (n_neg == 0)] = np.nan
    return auc


def bootstrap_auroc(y_true: np.ndarray, y_score: np.ndarray, groups: Sequence[Any], labels: Sequence[str], *,
                    n_resamples: int = 1000, seed: int = 0, alpha: float = 0.05,
                    chunk_size: int = 256) -> dict[str, Any]:
    """Patient-level bootstrap percentile CIs for per-label and mean AUROC.

    Patients are drawn with replacement (all images of a drawn patient come along).
    A resample in which a label has only one class is skipped for that label
    (``n_skipped``). The mean AUROC of a resample is the mean over the labels that are
    defined both in the point estimate and in that resample.

    Returns ``{"labels": {L: {"auroc", "ci_low", "ci_high", "ci": [low, high],
    "n_resamples_used", "n_skipped"}}, "mean_auroc": {"auroc", "ci_low", "ci_high",
    "n_resamples_used"}, "mean_auroc_ci": [low, high], "n_resamples", "alpha", "seed",
    "n_patients", "n_images"}`` (CIs and the ``ci`` pairs are None when undefined).
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    y_true, y_score = _check_2d(y_true, y_score, labels)
    groups = np.asarray(groups)
    if groups.shape[0] != y_true.shape[0]:
        raise ValueError(f"groups has {groups.shape[0]} entries but there are {y_true.shape[0]} images")
    point = auroc_per_label(y_true, y_score, labels)
    rng = np.random.default_rng(seed)
    patient_index, counts = patient_resample_counts(groups, n_resamples, rng)

    boot = np.full((n_resamples, len(labels)), np.nan)
    for j, label in enumerate(labels):
        if point[label] is None:
            continue
        known = ~np.isnan(y_true[:, j])
        t, s, pidx = y_true[known, j], y_score[known, j], patient_index[known]
        for b0 in range(0, n_resamples, chunk_size):
            w = counts[b0:b0 + chunk_size][:, pidx].astype(np.float64)
            boot[b0:b0 + chunk_size, j] = _weighted_auroc_batch(t, s, w)

    q = [100.0 * alpha / 2.0, 100.0 * (1.0 - alpha / 2.0)]

    def ci(vals: np.ndarray) -> tuple[float | None, float | None]:
        vals = vals[~np.isnan(vals)]
        if vals.size == 0:
            return None, None
        lo, hi = np.percentile(vals, q)
        return float(lo), float(hi)

    out_labels: dict[str, dict[str, Any]] = {}
    for j, label in enumerate(labels):
        col = boot[:, j]
        used = int((~np.isnan(col)).sum()) if point[label] is not None else 0
        lo, hi = ci(col) if point[label] is not None else (None, None)
        out_labels[label] = {"auroc": point[label], "ci_low": lo, "ci_high": hi,
                             "ci": None if lo is None else [lo, hi],
                             "n_resamples_used": used, "n_skipped": n_resamples - used}
    defined = [j for j, label in enumerate(labels) if point[label] is not None]
    if defined:
        with warnings.catch_warnings():  # all-NaN rows (every label skipped) -> NaN, silently
            warnings.simplefilter("ignore", RuntimeWarning)
            per_resample_mean = np.nanmean(boot[:, defined], axis=1)
        lo, hi = ci(per_resample_mean)
        used = int((~np.isnan(per_resample_mean)).sum())
    else:
        lo = hi = None
        used = 0
    return {
        "labels": out_labels,
        "mean_auroc": {"auroc": mean_auroc(point), "ci_low": lo, "ci_high": hi, "n_resamples_used": used},
        "mean_auroc_ci": None if lo is None else [lo, hi],
        "n_resamples": n_resamples,
        "alpha": alpha,
        "seed": seed,
        "n_patients": int(counts.shape[1]),
        "n_images": int(y_true.shape[0]),
    }


def paired_bootstrap_auroc_diff(y_true: np.ndarray, score_a: np.ndarray, score_b: np.ndarray,
                                groups: Sequence[Any], labels: Sequence[str], *, n_resamples: int = 1000,
                                seed: int = 0, alpha: float = 0.05, chunk_size: int = 256) -> dict[str, Any]:
    """Paired patient-level bootstrap of the mean-AUROC difference ``A - B`` on the same images.

    Both models are scored on the same resample (the same patients drawn), so the variation the
    two share (which patients are in the test set) cancels in the difference. The mean AUROC of
    a resample is over the labels defined in both point estimates and in that resample.

    Returns ``{"diff", "ci": [low, high] or None, "p_le_0" (share of resamples with A - B <= 0),
    "mean_a", "mean_b", "n_resamples_used", "n_resamples", "alpha", "seed", "n_patients",
    "n_images", "labels_used"}``.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    y_true, score_a = _check_2d(y_true, score_a, labels)
    _, score_b = _check_2d(y_true, score_b, labels)
    groups = np.asarray(groups)
    if groups.shape[0] != y_true.shape[0]:
        raise ValueError(f"groups has {groups.shape[0]} entries but there are {y_true.shape[0]} images")
    point_a = auroc_per_label(y_true, score_a, labels)
    point_b = auroc_per_label(y_true, score_b, labels)
    used = [j for j, lab in enumerate(labels) if point_a[lab] is not None and point_b[lab] is not None]
    if not used:
        raise ValueError("no label has both classes in y_true: the AUROC difference is undefined")
    patient_index, counts = patient_resample_counts(groups, n_resamples, np.random.default_rng(seed))
    diff = np.full((n_resamples, len(used)), np.nan)
    for k, j in enumerate(used):
        known = ~np.isnan(y_true[:, j])
        t, pidx = y_true[known, j], patient_index[known]
        for b0 in range(0, n_resamples, chunk_size):
            w = counts[b0:b0 + chunk_size][:, pidx].astype(np.float64)
            diff[b0:b0 + chunk_size, k] = (_weighted_auroc_batch(t, score_a[known, j], w)
                                           - _weighted_auroc_batch(t, score_b[known, j], w))
    with warnings.catch_warnings():  # all-NaN rows (every label skipped) -> NaN, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        per_resample = np.nanmean(diff, axis=1)
    per_resample = per_resample[~np.isnan(per_resample)]
    mean_a = float(np.mean([point_a[labels[j]] for j in used]))
    mean_b = float(np.mean([point_b[labels[j]] for j in used]))
    ci = None
    if per_resample.size:
        lo, hi = np.percentile(per_resample, [100.0 * alpha / 2.0, 100.0 * (1.0 - alpha / 2.0)])
        ci = [float(lo), float(hi)]
    return {"diff": mean_a - mean_b, "ci": ci,
            "p_le_0": float(np.mean(per_resample <= 0.0)) if per_resample.size else None,
            "mean_a": mean_a, "mean_b": mean_b, "n_resamples_used": int(per_resample.size),
            "n_resamples": n_resamples, "alpha": alpha, "seed": seed, "n_patients": int(counts.shape[1]),
            "n_images": int(y_true.shape[0]), "labels_used": [labels[j] for j in used]}


# --------------------------------------------------------------------------- thresholds
def _known_binary(y_true: np.ndarray, y_score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y_true = np.asarray(y_true, dtype=np.float64).reshape(-1)
    y_score = np.asarray(y_score, dtype=np.float64).reshape(-1)
    if y_true.shape != y_score.shape:
        raise ValueError(f"y_true has {y_true.size} values but y_score has {y_score.size}")
    known = ~np.isnan(y_true)
    return y_true[known].astype(int), y_score[known]


def youden_threshold(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """Score threshold maximising Youden's J = TPR - FPR (predict positive when score >= threshold)."""
    t, s = _known_binary(y_true, y_score)
    if np.unique(t).size < 2:
        raise ValueError("youden_threshold needs both classes in y_true")
    fpr, tpr, thr = roc_curve(t, s)
    finite = np.isfinite(thr)
    j = np.where(finite, tpr - fpr, -np.inf)
    return float(thr[int(np.argmax(j))])


def operating_point(y_true: np.ndarray, y_score: np.ndarray, threshold: float) -> dict[str, float | None]:
    """Sensitivity, specificity, PPV and F1 of ``score >= threshold`` (None where undefined)."""
    t, s = _known_binary(y_true, y_score)
    pred = (s >= threshold).astype(int)
    tn, fp, fn, tp = (int(v) for v in confusion_matrix(t, pred, labels=[0, 1]).ravel())

    def ratio(a: int, b: int) -> float | None:
        return a / b if b else None

    return {
        "threshold": float(threshold),
        "sensitivity": ratio(tp, tp + fn),
        "specificity": ratio(tn, tn + fp),
        "ppv": ratio(tp, tp + fp),
        "f1": ratio(2 * tp, 2 * tp + fp + fn),
        "tp": tp, "fp": fp, "tn": tn, "fn": fn,
    }

