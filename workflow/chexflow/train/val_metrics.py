"""The validation metrics training selects its best epoch on: per-label AUROC, their mean, top-1
accuracy. Pure numpy + scikit-learn (torch tensors are accepted, torch is never imported).

They live below ``chexflow.evaluate`` (the trainer must not import a higher layer);
``chexflow.evaluate.metrics`` builds its bootstrap CIs and operating points on them.

Conventions: ``y_true`` is float ``[N, L]`` with NaN for "unknown" (such entries are left out of
that label's AUROC), ``y_score`` is ``[N, L]`` (logits or probabilities: AUROC is invariant to
monotone transforms).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["auroc_per_label", "check_scores", "mean_auroc", "to_numpy", "top1_accuracy"]


def to_numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy array, list or torch tensor (on any device)."""
    if hasattr(x, "detach"):  # torch.Tensor without importing torch
        x = x.detach()
        if hasattr(x, "float") and str(getattr(x, "dtype", "")) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        return x.cpu().numpy()
    return np.asarray(x)


def check_scores(y_true: np.ndarray, y_score: np.ndarray, labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays as float64 ``[N, L]``; shapes, label count and 0/1/NaN targets checked."""
    y_true = np.asarray(y_true, dtype=np.float64)
    y_score = np.asarray(y_score, dtype=np.float64)
    if y_true.ndim == 1:
        y_true = y_true[:, None]
    if y_score.ndim == 1:
        y_score = y_score[:, None]
    if y_true.shape != y_score.shape:
        raise ValueError(f"y_true has shape {y_true.shape} but y_score has shape {y_score.shape}")
    if y_true.shape[1] != len(labels):
        raise ValueError(f"{y_true.shape[1]} label columns but {len(labels)} label names: {list(labels)}")
    known = ~np.isnan(y_true)
    if not np.isin(y_true[known], (0.0, 1.0)).all():
        raise ValueError("y_true must contain only 0, 1 or NaN (unknown)")
    if np.isnan(y_score[known]).any():
        raise ValueError("y_score is NaN where y_true is known")
    return y_true, y_score


def auroc_per_label(y_true: np.ndarray, y_score: np.ndarray, labels: Sequence[str]) -> dict[str, float | None]:
    """AUROC of each label column over its non-NaN rows; None when only one class is present."""
    # imported here: a training rank other than rank 0 never computes an AUROC (chexflow.train.validation)
    # and skips scikit-learn's import, 1.7 CPU-s and 110 MiB a process (bench/benchmarks-log.md)
    from sklearn.metrics import roc_auc_score

    y_true, y_score = check_scores(y_true, y_score, labels)
    out: dict[str, float | None] = {}
    for j, label in enumerate(labels):
        known = ~np.isnan(y_true[:, j])
        t = y_true[known, j]
        if t.size == 0 or np.unique(t).size < 2:
            out[label] = None
            continue
        out[label] = float(roc_auc_score(t, y_score[known, j]))
    return out


def mean_auroc(per_label: dict[str, float | None]) -> float:
    """Mean over the labels whose AUROC is defined (NaN if none is)."""
    vals = [v for v in per_label.values() if v is not None]
    return float(np.mean(vals)) if vals else float("nan")


def top1_accuracy(logits: Any, targets: Any) -> float:
    """Fraction of rows whose argmax over classes equals the integer target."""
    logits = to_numpy(logits)
    targets = to_numpy(targets).reshape(-1)
    if logits.ndim != 2 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"top1_accuracy: logits {logits.shape} must be [N, C] with N = {targets.shape[0]}")
    if targets.size == 0:
        return float("nan")
    return float((np.argmax(logits, axis=1) == targets).mean())
