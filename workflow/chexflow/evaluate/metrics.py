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

from collections.abc import Sequence
from typing import Any

import numpy as np
from sklearn.calibration import calibration_curve
from sklearn.metrics import average_precision_score, brier_score_loss, confusion_matrix, precision_recall_curve, roc_curve

from chexflow.train.val_metrics import auroc_per_label, mean_auroc, to_numpy, top1_accuracy
from chexflow.train.val_metrics import check_scores as _check_2d

__all__ = [
    "auroc_per_label",
    "mean_auroc",
    "patient_resample_counts",
    "patient_draws",
    "percentile_ci",
    "auroc_columns",
    "bootstrap_auroc",
    "paired_bootstrap_auroc_diff",
    "paired_bootstrap_over_seeds",
    "independent_bootstrap_auroc_diff",
    "youden_threshold",
    "operating_point",
    "top1_accuracy",
    "to_numpy",
    "positives",
    "calibration",
    "precision_recall",
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


MEAN_RULE = ("resamples in which every label of the mean has both classes; resamples that lost a label's "
             "positives (or negatives) are dropped, not averaged over fewer labels")


def _mean_over_complete_resamples(per_label: np.ndarray) -> np.ndarray:
    """Row means of ``per_label`` [B, L] over the rows where no label is NaN (see ``MEAN_RULE``)."""
    complete = ~np.isnan(per_label).any(axis=1)
    return per_label[complete].mean(axis=1) if per_label.shape[1] else np.empty(0)


def patient_draws(groups: Sequence[Any], n_resamples: int, seed: Any) -> tuple[np.ndarray, np.ndarray]:
    """``patient_resample_counts`` from ``default_rng(seed)``: the one stream every patient bootstrap of
    chexflow draws from (a seed gives the same patients to every statistic of one test set)."""
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    return patient_resample_counts(groups, n_resamples, np.random.default_rng(seed))


def percentile_ci(vals: np.ndarray, alpha: float = 0.05) -> list[float] | None:
    """The percentile interval of the resamples' values (NaN: a resample where the statistic is undefined,
    left out); None when none is defined."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    vals = np.asarray(vals, float)
    vals = vals[~np.isnan(vals)]
    if vals.size == 0:
        return None
    return [float(v) for v in np.percentile(vals, [100.0 * alpha / 2.0, 100.0 * (1.0 - alpha / 2.0)])]


def auroc_columns(y: np.ndarray, s: np.ndarray, counts: np.ndarray, patient_index: np.ndarray,
                  chunk_size: int = 256) -> np.ndarray:
    """AUROC ``[B, L]`` of each column of ``y``/``s`` in each resample ``counts`` [B, P] (NaN labels left
    out; NaN where a resample holds one class): the loop every AUROC bootstrap goes through."""
    out = np.full((counts.shape[0], y.shape[1]), np.nan)
    for j in range(y.shape[1]):
        known = ~np.isnan(y[:, j])
        for b0 in range(0, counts.shape[0], chunk_size):
            w = counts[b0:b0 + chunk_size][:, patient_index[known]].astype(np.float64)
            out[b0:b0 + chunk_size, j] = _weighted_auroc_batch(y[known, j], s[known, j], w)
    return out


def _checked(y_true: np.ndarray, y_score: np.ndarray, groups: Sequence[Any], labels: Sequence[str], alpha: float
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    y_true, y_score = _check_2d(y_true, y_score, labels)
    groups = np.asarray(groups)
    if groups.shape[0] != y_true.shape[0]:
        raise ValueError(f"groups has {groups.shape[0]} entries but there are {y_true.shape[0]} images")
    return y_true, y_score, groups


def bootstrap_auroc(y_true: np.ndarray, y_score: np.ndarray, groups: Sequence[Any], labels: Sequence[str], *,
                    n_resamples: int = 1000, seed: int = 0, alpha: float = 0.05,
                    chunk_size: int = 256) -> dict[str, Any]:
    """Patient-level bootstrap percentile CIs for per-label and mean AUROC.

    Patients are drawn with replacement (all images of a drawn patient come along).
    A resample in which a label has only one class is skipped for that label
    (``n_skipped``). The mean AUROC's CI uses only the resamples in which every label of the
    point estimate's mean has both classes (``MEAN_RULE``): a resample that lost a rare label's
    positives would otherwise average over fewer, easier or harder labels than the point estimate.

    Returns ``{"labels": {L: {"auroc", "ci_low", "ci_high", "ci": [low, high],
    "n_resamples_used", "n_skipped"}}, "mean_auroc": {"auroc", "ci_low", "ci_high",
    "n_resamples_used", "n_resamples_dropped", "rule"}, "mean_auroc_ci": [low, high], "n_resamples",
    "alpha", "seed", "n_patients", "n_images"}`` (CIs and the ``ci`` pairs are None when undefined).
    """
    y_true, y_score, groups = _checked(y_true, y_score, groups, labels, alpha)
    point = auroc_per_label(y_true, y_score, labels)
    patient_index, counts = patient_draws(groups, n_resamples, seed)
    defined = [j for j, label in enumerate(labels) if point[label] is not None]
    boot = np.full((n_resamples, len(labels)), np.nan)
    boot[:, defined] = auroc_columns(y_true[:, defined], y_score[:, defined], counts, patient_index, chunk_size)
    out_labels: dict[str, dict[str, Any]] = {}
    for j, label in enumerate(labels):
        used = int((~np.isnan(boot[:, j])).sum())
        ci = percentile_ci(boot[:, j], alpha)
        out_labels[label] = {"auroc": point[label], "ci_low": ci and ci[0], "ci_high": ci and ci[1], "ci": ci,
                             "n_resamples_used": used, "n_skipped": n_resamples - used}
    per_resample_mean = _mean_over_complete_resamples(boot[:, defined]) if defined else np.empty(0)
    ci = percentile_ci(per_resample_mean, alpha)
    used = int(per_resample_mean.size)
    return {
        "labels": out_labels,
        "mean_auroc": {"auroc": mean_auroc(point), "ci_low": ci and ci[0], "ci_high": ci and ci[1],
                       "n_resamples_used": used, "n_resamples_dropped": n_resamples - used, "rule": MEAN_RULE},
        "mean_auroc_ci": ci,
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
    a resample is over the labels defined in both point estimates; only resamples in which every one
    of them has both classes count (``MEAN_RULE``). Each label's own difference gets its CI too.

    Returns ``{"diff", "ci": [low, high] or None, "p_le_0" (share of resamples with A - B <= 0),
    "mean_a", "mean_b", "n_resamples_used", "n_resamples", "alpha", "seed", "n_patients",
    "n_images", "labels_used", "labels": {L: {"diff", "a", "b", "ci", "n_resamples_used"}}, "rule"}``.
    """
    y_true, score_a, groups = _checked(y_true, score_a, groups, labels, alpha)
    _, score_b = _check_2d(y_true, score_b, labels)
    point_a = auroc_per_label(y_true, score_a, labels)
    point_b = auroc_per_label(y_true, score_b, labels)
    used = [j for j, lab in enumerate(labels) if point_a[lab] is not None and point_b[lab] is not None]
    if not used:
        raise ValueError("no label has both classes in y_true: the AUROC difference is undefined")
    patient_index, counts = patient_draws(groups, n_resamples, seed)
    diff = (auroc_columns(y_true[:, used], score_a[:, used], counts, patient_index, chunk_size)
            - auroc_columns(y_true[:, used], score_b[:, used], counts, patient_index, chunk_size))
    per_resample = _mean_over_complete_resamples(diff)
    mean_a = float(np.mean([point_a[labels[j]] for j in used]))
    mean_b = float(np.mean([point_b[labels[j]] for j in used]))
    per_label = {labels[j]: {"diff": point_a[labels[j]] - point_b[labels[j]], "a": point_a[labels[j]],
                             "b": point_b[labels[j]], "ci": percentile_ci(diff[:, k], alpha),
                             "n_resamples_used": int((~np.isnan(diff[:, k])).sum())}
                 for k, j in enumerate(used)}
    return {"diff": mean_a - mean_b, "ci": percentile_ci(per_resample, alpha),
            "p_le_0": float(np.mean(per_resample <= 0.0)) if per_resample.size else None,
            "mean_a": mean_a, "mean_b": mean_b, "n_resamples_used": int(per_resample.size),
            "n_resamples": n_resamples, "alpha": alpha, "seed": seed, "n_patients": int(counts.shape[1]),
            "n_images": int(y_true.shape[0]), "labels_used": [labels[j] for j in used], "labels": per_label,
            "rule": MEAN_RULE}


def paired_bootstrap_over_seeds(y_true: np.ndarray, runs: Sequence[tuple[np.ndarray, np.ndarray]],
                                groups: Sequence[Any], labels: Sequence[str], *, n_resamples: int = 1000,
                                seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """The mean-AUROC difference ``A - B`` averaged over training seeds, on the same test images.

    ``runs``: one (score_a, score_b) pair per training seed. Two uncertainties, kept apart:
    ``ci`` resamples test patients (the same draw for every seed; the per-resample value is the
    seed-average of each seed's difference over the labels, complete resamples only, ``MEAN_RULE``);
    ``t_ci`` is the t-interval of the per-seed differences (training randomness; None for one seed).
    """
    from scipy import stats
    if not runs:
        raise ValueError("paired_bootstrap_over_seeds needs at least one (score_a, score_b) run")
    y_true, _ = _check_2d(y_true, runs[0][0], labels)
    per_seed = [paired_bootstrap_auroc_diff(y_true, a, b, groups, labels, n_resamples=1, seed=seed) for a, b in runs]
    used = per_seed[0]["labels_used"]
    if any(r["labels_used"] != used for r in per_seed):
        raise ValueError("the runs define the AUROC on different labels")
    cols = [labels.index(lab) for lab in used]
    patient_index, counts = patient_draws(groups, n_resamples, seed)
    total = np.zeros((n_resamples, len(cols)))
    for a, b in runs:
        _, a = _check_2d(y_true, a, labels)
        _, b = _check_2d(y_true, b, labels)
        total += (auroc_columns(y_true[:, cols], a[:, cols], counts, patient_index)
                  - auroc_columns(y_true[:, cols], b[:, cols], counts, patient_index))
    per_resample = _mean_over_complete_resamples(total / len(runs))
    diffs = np.array([r["diff"] for r in per_seed])
    t_ci = None
    if len(diffs) > 1:
        half = stats.t.ppf(1.0 - alpha / 2.0, len(diffs) - 1) * diffs.std(ddof=1) / np.sqrt(len(diffs))
        t_ci = [float(diffs.mean() - half), float(diffs.mean() + half)]
    return {"diff": float(diffs.mean()), "per_seed": diffs.tolist(),
            "sd": float(diffs.std(ddof=1)) if len(diffs) > 1 else None,
            "ci": percentile_ci(per_resample, alpha),
            "t_ci": t_ci, "n_seeds": len(runs), "n_resamples_used": int(per_resample.size),
            "n_resamples": n_resamples, "n_patients": int(counts.shape[1]), "labels_used": used, "rule": MEAN_RULE}


def independent_bootstrap_auroc_diff(a: tuple[np.ndarray, np.ndarray, Sequence[Any]],
                                     b: tuple[np.ndarray, np.ndarray, Sequence[Any]], labels: Sequence[str], *,
                                     n_resamples: int = 1000, seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """The AUROC difference ``A - B`` per finding between two test sets that share no patient (a model's
    internal test set and an external one, Zech et al., PLOS Medicine 2018), with a percentile CI.

    ``a`` and ``b``: ``(y_true [N, L], y_score [N, L], patient per image)``, the columns of ``labels`` in
    the same order (a finding's column of each set). The sets are independent samples, so each is
    resampled by patient on its own: resample ``k`` of the difference is the ``k``-th resample of A
    minus the ``k``-th of B, drawn from independent streams (A's is ``default_rng(seed)``, the stream
    ``bootstrap_auroc`` draws with ``seed``, so A's CI is the one A's own evaluation reports; B's is
    ``default_rng([seed, 1])``). The variance of the difference is then the sum of the two variances,
    as it must be for independent samples; a paired bootstrap (``paired_bootstrap_auroc_diff``) would be
    wrong here, there being no pairs. A resample where a finding has one class in either set is
    dropped for that finding. The mean difference is over the findings defined in both point estimates,
    from the resamples where all of them are defined in both sets (``MEAN_RULE``).

    Returns ``{"labels": {L: {"a", "a_ci", "b", "b_ci", "diff", "ci", "p_le_0", "n_resamples_used"}},
    "mean": {"a", "b", "diff", "ci", "labels", "n_resamples_used"}, "n_resamples", "seed", "alpha",
    "n_patients_a", "n_patients_b", "rule"}``; ``p_le_0``: the share of resamples with A - B <= 0.
    """
    sets = []
    for name, (y, s, groups), stream in (("A", a, seed), ("B", b, [seed, 1])):
        y, s = _check_2d(y, s, labels)
        groups = np.asarray(groups)
        if groups.shape[0] != y.shape[0]:
            raise ValueError(f"set {name}: {groups.shape[0]} patient ids but {y.shape[0]} images")
        pidx, counts = patient_draws(groups, n_resamples, stream)
        sets.append((auroc_per_label(y, s, labels), auroc_columns(y, s, counts, pidx), counts.shape[1]))
    (point_a, boot_a, n_a), (point_b, boot_b, n_b) = sets
    diff = boot_a - boot_b
    out_labels = {}
    for j, lab in enumerate(labels):
        defined = point_a[lab] is not None and point_b[lab] is not None
        d = diff[:, j][~np.isnan(diff[:, j])] if defined else np.empty(0)
        out_labels[lab] = {"a": point_a[lab], "a_ci": percentile_ci(boot_a[:, j], alpha) if point_a[lab] is not None
                           else None, "b": point_b[lab],
                           "b_ci": percentile_ci(boot_b[:, j], alpha) if point_b[lab] is not None else None,
                           "diff": point_a[lab] - point_b[lab] if defined else None,
                           "ci": percentile_ci(d, alpha) if defined else None,
                           "p_le_0": float(np.mean(d <= 0.0)) if d.size else None, "n_resamples_used": int(d.size),
                           "n_resamples_dropped": n_resamples - int(d.size)}
    used = [j for j, lab in enumerate(labels) if out_labels[lab]["diff"] is not None]
    mean_diff = _mean_over_complete_resamples(diff[:, used]) if used else np.empty(0)
    mean = {"labels": [labels[j] for j in used], "n_resamples_used": int(mean_diff.size),
            "a": float(np.mean([point_a[labels[j]] for j in used])) if used else None,
            "b": float(np.mean([point_b[labels[j]] for j in used])) if used else None,
            "ci": percentile_ci(mean_diff, alpha)}
    mean["diff"] = None if not used else mean["a"] - mean["b"]
    return {"labels": out_labels, "mean": mean, "n_resamples": n_resamples, "seed": seed, "alpha": alpha,
            "n_patients_a": int(n_a), "n_patients_b": int(n_b), "rule": MEAN_RULE}


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
    """Sensitivity, specificity, PPV, NPV and F1 of ``score >= threshold`` (None where undefined)."""
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
        "npv": ratio(tn, tn + fn),
        "f1": ratio(2 * tp, 2 * tp + fp + fn),
        "tp": tp, "fp": fp, "tn": tn, "fn": fn,
    }


def positives(y_true: np.ndarray, patients: Sequence[Any]) -> dict[str, int]:
    """Positives of one label counted per image and per patient (a patient with any positive image),
    and the known images: the evidence a threshold or an AUROC rests on."""
    y = np.asarray(y_true, dtype=np.float64).reshape(-1)
    patients = np.asarray(patients)
    if patients.shape != y.shape:
        raise ValueError(f"{y.size} labels but {patients.size} patient ids")
    pos = y == 1.0
    return {"images": int(pos.sum()), "patients": int(np.unique(patients[pos]).size),
            "known_images": int((~np.isnan(y)).sum())}


# --------------------------------------------------------------------------- calibration, PR
def calibration(y_true: np.ndarray, y_prob: np.ndarray, *, n_bins: int = 10) -> dict[str, Any]:
    """Brier score, expected calibration error and the reliability diagram of probabilities of one label.

    Bins are ``n_bins`` equal-width bins of [0, 1], assigned as scikit-learn's ``calibration_curve``
    (strategy "uniform") assigns them; the curve is scikit-learn's. ECE = sum over non-empty bins of
    (images in bin / images) x |fraction positive - mean predicted probability| (Guo et al. 2017).
    Returns ``{"brier", "ece", "n", "prevalence", "bins": [{"lo", "hi", "count", "mean_predicted",
    "fraction_positive"}] (non-empty bins only)}``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    t, p = _known_binary(y_true, y_prob)
    if p.size and (p.min() < 0.0 or p.max() > 1.0):
        raise ValueError("calibration needs probabilities in [0, 1]")
    if np.unique(t).size < 2:
        raise ValueError("calibration needs both classes in y_true")
    frac_pos, mean_pred = calibration_curve(t, p, n_bins=n_bins, strategy="uniform")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    bin_of = np.searchsorted(edges[1:-1], p)        # scikit-learn's assignment of "uniform" bins
    counts = np.bincount(bin_of, minlength=n_bins)
    nonempty = np.flatnonzero(counts)
    ece = float(np.sum(counts[nonempty] / p.size * np.abs(frac_pos - mean_pred)))
    bins = [{"lo": float(edges[b]), "hi": float(edges[b + 1]), "count": int(counts[b]),
             "mean_predicted": float(mp), "fraction_positive": float(fp)}
            for b, mp, fp in zip(nonempty, mean_pred, frac_pos)]
    return {"brier": float(brier_score_loss(t, p)), "ece": ece, "n": int(p.size),
            "prevalence": float(t.mean()), "bins": bins}


def precision_recall(y_true: np.ndarray, y_score: np.ndarray) -> dict[str, Any]:
    """PR curve and AUPRC (scikit-learn's average precision) of one label; the chance level of AUPRC
    is the prevalence. Returns ``{"auprc", "prevalence", "precision", "recall"}`` (curve as lists)."""
    t, s = _known_binary(y_true, y_score)
    if np.unique(t).size < 2:
        raise ValueError("precision_recall needs both classes in y_true")
    precision, recall, _ = precision_recall_curve(t, s)
    return {"auprc": float(average_precision_score(t, s)), "prevalence": float(t.mean()),
            "precision": precision.tolist(), "recall": recall.tolist()}
