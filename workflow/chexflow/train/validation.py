"""Validation during training: one pass over every rank's share of the validation split.

The caller broadcasts rank 0's BatchNorm statistics first, so that every rank evaluates the same model;
the metric (accuracy | mean AUROC) is computed over the gathered split (chexflow.train.val_metrics), the
AUROC by rank 0 alone and sent to the others.
"""
from __future__ import annotations

import numpy as np
import torch

from chexflow import watchdog
from chexflow.train import val_metrics as M
from chexflow.train.backends import Backend, gather_arrays
from chexflow.train.inputs import TrainData
from chexflow.train.losses import task_loss


def validate(model, data: TrainData, backend: Backend, device: torch.device, *, bf16: bool,
             channels_last: bool, loader, one_shape: bool = False) -> tuple[float, float, str]:
    """(validation loss, metric, metric name) of ``model`` over the whole split, the same on every rank.
    ``loader``: the run's validation loader (``data.val_loader``), built once per run. ``one_shape`` (a
    compiled model): a partial batch (the split's last) is padded to the batch size (copies of its last
    image, whose outputs are dropped), so the model sees one input shape: a smaller batch made
    torch.compile build a third graph, with dynamic shapes, on every rank of every run."""
    model.eval()
    watchdog.beat("validation")         # the phase a stall in this pass is named by
    scores, targets_all = [], []
    loss_sum, count = torch.zeros((), device=device), 0
    full = data.cfg.batch_size if one_shape else None     # the loader's batch (data.val_loader)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for images, targets, _ in loader:
            x = data.augment(images.to(device, non_blocking=True), train=False, generator=None,
                             channels_last=channels_last)
            n = x.shape[0]
            if full and n < full:
                x = torch.cat([x, x[-1:].expand(full - n, *x.shape[1:])]).contiguous(
                    memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            logits = model(x)[:n].float()
            loss_sum += task_loss(data.task, logits, targets.to(device, non_blocking=True)) * n
            count += n
            scores.append(logits)               # stays on the device until the split is done
            targets_all.append(targets)
            watchdog.beat("validation")
    n_classes = len(data.labels)
    local_scores = torch.cat(scores).cpu().numpy() if scores else np.zeros((0, n_classes), np.float32)
    local_targets = (torch.cat(targets_all).numpy() if targets_all
                     else np.zeros((0,) if data.task == "multiclass" else (0, n_classes)))
    tot = backend.allgather_object((float(loss_sum), count))
    val_loss = sum(t[0] for t in tot) / max(sum(t[1] for t in tot), 1)
    s, t = gather_arrays(backend)([local_scores, local_targets])
    if data.task == "multiclass":
        return val_loss, M.top1_accuracy(s, t), "accuracy"
    # the AUROC on rank 0, sent to the others: one rank of the world imports scikit-learn, not each, and
    # a refusal (NaN scores) reaches every rank as the same error instead of leaving them waiting
    outcome = None
    if backend.is_root:
        try:
            outcome = ("ok", float(M.mean_auroc(M.auroc_per_label(t.astype(np.float64), s, list(data.labels)))))
        except ValueError as exc:
            outcome = ("refused", str(exc))
    kind, value = backend.broadcast_object(outcome)
    if kind == "refused":
        raise ValueError(value)
    return val_loss, value, "mean_auroc"
