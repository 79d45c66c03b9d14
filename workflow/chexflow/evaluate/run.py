"""Evaluation stage: predictions of the selected model on validation and test, AUROC with CIs.

The model arriving here was selected on validation by the fine-tuning stage; the test split is
used once, here, and never for selection. Operating points are chosen on validation (Youden's J)
and then applied to test.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from chexflow.evaluate.config import EvaluateConfig
from chexflow.train.config import TrainConfig
from chexflow.data import loader
from chexflow.evaluate.metrics import auroc_per_label, bootstrap_auroc, mean_auroc, operating_point, youden_threshold
from chexflow.evaluate.published import CHEXNET
from chexflow.fsutil import atomic_path, write_text_atomic
from chexflow.train.checkpoint import load_model


def predict(model: torch.nn.Module, shards, *, crop: int, batch_size: int, device) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    stream = loader.ShardStream(shards, rank=0, world=1, seed=0, batch_size=batch_size, shuffle=False)
    batches = loader.make_loader(stream, batch_size=batch_size, workers=0, pin_memory=False)
    scores, targets, patients, images = [], [], [], []
    model.eval()
    with torch.no_grad():
        for x, y, ids in batches:
            z = loader.gpu_augment(x.to(device), out_size=crop, train=False, cfg=None, generator=None)
            scores.append(torch.sigmoid(model(z).float()).cpu().numpy())
            targets.append(y.numpy().astype(np.float64))
            patients += [i.patient for i in ids]
            images += [i.image for i in ids]
    return np.concatenate(scores), np.concatenate(targets), patients, images


def expected_run_ids(train_cfgs: list[TrainConfig], pretrained: Path | None) -> set[str]:
    """The run ids a model to evaluate may carry: those of the training settings that should have
    produced it (the finetune section; the sweep's trials) with its pretraining model."""
    from chexflow.train.trainer import run_id
    for c in train_cfgs:
        if c.init == "pretrained" and pretrained is None:
            raise ValueError(f"{c.stage}.init is pretrained: the pretraining model is needed to compute the "
                             "expected run id of the model (--pretrained)")
    return {run_id(c, pretrained) for c in train_cfgs}


def run(cfg: EvaluateConfig, *, model_path: Path, manifest: Path, out_dir: Path,
        expect_run_ids: set[str] | None = None) -> dict:
    """Evaluate the model file ``model_path`` on the test split of ``manifest``. The file must be a
    multi-label model of the manifest's labels and, with ``expect_run_ids``, carry one of those run
    ids (a stale model of other settings is refused naming both)."""
    out_dir = Path(out_dir)
    expect = {"task": "multilabel", "labels": list(loader.read_manifest(manifest)["labels"])}
    if expect_run_ids is not None:
        ids = sorted(expect_run_ids)
        expect["run_id"] = ids[0] if len(ids) == 1 else frozenset(ids)
    else:
        print(f"{model_path}: run id not checked (no training settings given)", flush=True)
    model, info = load_model(model_path, expect=expect)
    labels = list(info["labels"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    crop = info["crop"]

    val = predict(model, loader.split_shards(manifest, "val"), crop=crop, batch_size=cfg.batch_size, device=device)
    test = predict(model, loader.split_shards(manifest, "test"), crop=crop, batch_size=cfg.batch_size, device=device)
    s, y, patients, images = test

    per_label = auroc_per_label(y, s, labels)
    boot = bootstrap_auroc(y, s, np.asarray(patients), labels, n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    defined = [label for label in labels if per_label[label] is not None]
    result = {"labels": {}, "mean_auroc": mean_auroc(per_label), "mean_auroc_labels": defined,
              "chexnet_mean_same_labels": CHEXNET.mean_over(defined), "n_images": int(len(images)),
              "n_patients": int(len(set(patients))), "model": str(model_path), "model_run_id": info["run_id"],
              "model_run_id_checked": expect_run_ids is not None,
              "model_epoch": info.get("epoch"), "model_val_metric": info.get("val_metric"),
              "bootstrap": {"n_resamples": cfg.bootstrap_resamples, "seed": cfg.seed,
                            "mean_auroc_ci": boot.get("mean_auroc_ci")}}
    vs, vy = val[0], val[1]
    for j, label in enumerate(labels):
        known = ~np.isnan(y[:, j])
        entry = {"auroc": per_label[label], "n_pos": int((y[known, j] == 1).sum()),
                 "n_neg": int((y[known, j] == 0).sum()),
                 "ci": boot.get("labels", {}).get(label, {}).get("ci"), "chexnet": CHEXNET.get(label)}
        vknown = ~np.isnan(vy[:, j])
        if len(np.unique(vy[vknown, j])) == 2 and len(np.unique(y[known, j])) == 2:
            thr = youden_threshold(vy[vknown, j], vs[vknown, j])
            entry["threshold_val_youden"] = float(thr)
            entry["test_operating_point"] = operating_point(y[known, j], s[known, j], thr)
        result["labels"][label] = entry

    out_dir.mkdir(parents=True, exist_ok=True)
    cols = {"image": images, "patient": patients}
    for j, label in enumerate(labels):
        cols[label] = y[:, j]
        cols[f"{label}_score"] = s[:, j]
    with atomic_path(out_dir / "predictions.csv") as tmp:
        pd.DataFrame(cols).to_csv(tmp, index=False, float_format="%.6g")
    rows = [{"label": L, "auroc": result["labels"][L]["auroc"],
             "ci_low": (result["labels"][L]["ci"] or [None, None])[0],
             "ci_high": (result["labels"][L]["ci"] or [None, None])[1],
             "chexnet": CHEXNET.get(L)} for L in labels]
    rows.append({"label": "mean", "auroc": result["mean_auroc"],
                 "ci_low": (result["bootstrap"]["mean_auroc_ci"] or [None, None])[0],
                 "ci_high": (result["bootstrap"]["mean_auroc_ci"] or [None, None])[1],
                 "chexnet": result["chexnet_mean_same_labels"]})
    with atomic_path(out_dir / "auroc.csv") as tmp:
        pd.DataFrame(rows).to_csv(tmp, index=False, float_format="%.4f")
    write_text_atomic(out_dir / "metrics.json", json.dumps(result, indent=1, default=float))
    return result
