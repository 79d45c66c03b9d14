"""Losses: cross-entropy for pretraining classes, BCE that ignores missing labels for findings."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_bce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean BCE-with-logits over the known labels only (NaN in ``targets`` = unknown, ignored)."""
    known = ~torch.isnan(targets)
    safe = torch.where(known, targets, torch.zeros_like(targets))
    per = F.binary_cross_entropy_with_logits(logits.float(), safe.float(), reduction="none")
    per = per * known
    return per.sum() / known.sum().clamp(min=1)


def task_loss(task: str, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if task == "multiclass":
        return F.cross_entropy(logits.float(), targets.long())
    return masked_bce(logits, targets)
