"""An interval beside every number the evaluation shows, each named in the record (``interval``): the
patient bootstrap (:data:`BOOTSTRAP`), or exact over patients where it collapses at a rate of 0 or 1
(:data:`EXACT`); and the one small-count rule (:func:`too_few`). Both: docs/evaluation.md, "Intervals
and the small-count rule".
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from chexflow.evaluate.metrics import patient_draws, percentile_ci

BOOTSTRAP = "patient bootstrap"
EXACT = "exact (Clopper-Pearson) over patients"


def too_few(n_pos_patients: int, n_neg_patients: int | None, minimum: int) -> str | None:
    """The rule's words when ``n_pos_patients`` or ``n_neg_patients`` is below ``minimum`` (None: enough).
    ``n_neg_patients`` None: a rate over one class of patients (its denominator's)."""
    if n_pos_patients >= minimum and (n_neg_patients is None or n_neg_patients >= minimum):
        return None
    if n_neg_patients is None:
        return f"too few: {n_pos_patients} patients ({minimum} needed)"
    return f"too few: {n_pos_patients} positive / {n_neg_patients} negative patients ({minimum} of each needed)"


def against_chance(ci: list[float] | None, chance: float = 0.5) -> str | None:
    """Where a CI lies against chance (an AUROC's 0.5): "above", "includes", "below"; None without a CI
    (none made, or withheld by the small-count rule). The evaluation stores it; the report words it."""
    if not ci:
        return None
    return "above" if ci[0] > chance else "below" if ci[1] < chance else "includes"


def ci_columns(ci: Sequence[float] | None, prefix: str = "ci") -> dict[str, float | None]:
    """A CI as the columns ``{prefix}_low`` and ``{prefix}_high`` of a table (both None without a CI)."""
    low, high = ci or (None, None)
    return {f"{prefix}_low": low, f"{prefix}_high": high}


def exact_ci(k: int, n: int, *, alpha: float = 0.05) -> list[float]:
    """Clopper-Pearson interval of k/n (scipy's ``binomtest``); valid where the n units are independent."""
    from scipy.stats import binomtest
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=1.0 - alpha, method="exact")
    return [float(ci.low), float(ci.high)]


def weights(patients: Sequence[Any], n_resamples: int, seed: Any) -> np.ndarray:
    """Image multiplicities ``[B, N]`` of the patient bootstrap drawn with ``seed``."""
    pidx, counts = patient_draws(np.asarray(patients), n_resamples, seed)
    return counts[:, pidx].astype(np.float64)


def rate(hit: np.ndarray, den: np.ndarray, patients: Sequence[Any], *, minimum: int, n_resamples: int, seed: Any,
         alpha: float = 0.05) -> dict[str, Any]:
    """The share of the images in ``den`` that are ``hit`` (bool arrays per image), with its interval.

    Returns ``{"k", "n" (images), "n_patients" (in the denominator), "rate", "ci", "interval",
    "n_resamples_used", "n_resamples_dropped", "too_few"}``: ``too_few`` (the rule's words) when the
    denominator holds fewer than ``minimum`` patients, then no interval."""
    den = np.asarray(den, bool)
    return ratio((np.asarray(hit, bool) & den).astype(float), den.astype(float), patients, minimum=minimum,
                 n_resamples=n_resamples, seed=seed, alpha=alpha)


def ratio(num: np.ndarray, den: np.ndarray, patients: Sequence[Any], *, minimum: int, n_resamples: int, seed: Any,
          alpha: float = 0.05) -> dict[str, Any]:
    """``sum(num) / sum(den)`` of per-image counts (``0 <= num <= den``; an image with ``den`` 0 is not in the
    denominator), with its interval as :func:`rate` gives it (a rate: ``num`` and ``den`` 0/1; F1: 2 TP
    over 2 TP + FP + FN)."""
    num, den, patients = np.asarray(num, float), np.asarray(den, float), np.asarray(patients)
    k, n = int(round(num.sum())), int(round(den.sum()))
    n_pat = int(np.unique(patients[den > 0]).size)
    out = {"k": k, "n": n, "n_patients": n_pat, "rate": k / n if n else None, "ci": None, "interval": None,
           "n_resamples_used": 0, "n_resamples_dropped": 0, "too_few": too_few(n_pat, None, minimum)}
    if out["too_few"]:
        return out
    w = weights(patients, n_resamples, seed)
    top, d = w @ num, w @ den
    vals = np.where(d > 0, top / np.where(d > 0, d, 1.0), np.nan)
    used = int((d > 0).sum())
    out.update(n_resamples_used=used, n_resamples_dropped=n_resamples - used)
    if k in (0, n):
        out.update(ci=exact_ci(0 if k == 0 else n_pat, n_pat, alpha=alpha), interval=EXACT)
    else:
        out.update(ci=percentile_ci(vals, alpha), interval=BOOTSTRAP)
    return out


def mean(values: np.ndarray, patients: Sequence[Any], *, minimum: int, n_resamples: int, seed: Any,
         alpha: float = 0.05) -> dict[str, Any]:
    """The mean of ``values`` (one per image or map) with its patient-bootstrap interval; ``too_few`` below
    ``minimum`` patients. Returns ``{"value", "ci", "interval", "n", "n_patients", "too_few"}``."""
    values, patients = np.asarray(values, float), np.asarray(patients)
    n_pat = int(np.unique(patients).size)
    out = {"value": float(values.mean()) if values.size else None, "ci": None, "interval": None,
           "n": int(values.size), "n_patients": n_pat, "too_few": too_few(n_pat, None, minimum)}
    if out["too_few"]:
        return out
    w = weights(patients, n_resamples, seed)
    vals = (w @ values) / w.sum(axis=1)
    if np.ptp(vals) > 0:                    # every map alike (all 0 IoBB): no interval to show, the value says it
        out.update(ci=percentile_ci(vals, alpha), interval=BOOTSTRAP)
    return out


def _weighted_ap(t: np.ndarray, s: np.ndarray, w: np.ndarray) -> np.ndarray:
    """scikit-learn's average precision (sum over thresholds of recall's step x precision) of each weight
    row of ``w`` [B, n] (an image of weight k counts as k copies); NaN without a positive."""
    order = np.argsort(-s, kind="mergesort")
    s_sorted, pos = s[order], t[order] == 1.0
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])        # tie groups, highest first
    ws = w[:, order]
    tp = np.cumsum(np.add.reduceat(np.where(pos, ws, 0.0), starts, axis=1), axis=1)
    fp = np.cumsum(np.add.reduceat(np.where(pos, 0.0, ws), starts, axis=1), axis=1)
    step = np.diff(np.concatenate([np.zeros((w.shape[0], 1)), tp], axis=1), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(tp + fp > 0, tp / (tp + fp), 0.0)
        return (step * precision).sum(axis=1) / tp[:, -1]


def score_intervals(t: np.ndarray, p: np.ndarray, patients: Sequence[Any], *, n_bins: int, n_resamples: int,
                    seed: Any, alpha: float = 0.05) -> dict[str, Any]:
    """Patient-bootstrap intervals of one finding's AUPRC, Brier score and ECE (known labels only: ``t``
    0/1, ``p`` probabilities), the bins and ECE as ``metrics.calibration`` computes them. A resample that
    holds one class is dropped (as for the AUROC). Returns ``{"auprc_ci", "brier_ci", "ece_ci", "interval",
    "n_resamples_used", "n_resamples_dropped"}``."""
    t, p = np.asarray(t, float), np.asarray(p, float)
    w = weights(patients, n_resamples, seed)
    n_pos, n_all = w @ t, w.sum(axis=1)
    ok = (n_pos > 0) & (n_pos < n_all)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    onehot = np.eye(n_bins)[np.searchsorted(edges[1:-1], p)]      # scikit-learn's "uniform" bins
    ece = np.abs(w @ (onehot * t[:, None]) - w @ (onehot * p[:, None])).sum(axis=1) / n_all
    stats = {"auprc_ci": _weighted_ap(t, p, w), "brier_ci": (w @ (p - t) ** 2) / n_all, "ece_ci": ece}
    out: dict[str, Any] = {k: percentile_ci(np.where(ok, v, np.nan), alpha) for k, v in stats.items()}
    used = int(ok.sum())
    return {**out, "interval": BOOTSTRAP, "n_resamples_used": used, "n_resamples_dropped": n_resamples - used}


def operating_point_intervals(t: np.ndarray, s: np.ndarray, patients: Sequence[Any], threshold: float, *,
                              minimum: int, n_resamples: int, seed: Any, alpha: float = 0.05) -> dict[str, Any]:
    """Sensitivity, specificity, PPV, NPV and F1 of ``s >= threshold`` (known labels ``t``), each over its own
    denominator's patients (the positives', the negatives', the flagged', the unflagged'; F1's: the images
    with a TP, FP or FN)."""
    t, flagged = np.asarray(t, float) == 1.0, np.asarray(s, float) >= threshold
    kw = {"minimum": minimum, "n_resamples": n_resamples, "seed": seed, "alpha": alpha}
    tp, fp, fn = (t & flagged).astype(float), (~t & flagged).astype(float), (t & ~flagged).astype(float)
    return {"sensitivity": rate(flagged, t, patients, **kw), "specificity": rate(~flagged, ~t, patients, **kw),
            "ppv": rate(t, flagged, patients, **kw), "npv": rate(~t, ~flagged, patients, **kw),
            "f1": ratio(2 * tp, 2 * tp + fp + fn, patients, **kw)}
