"""Evaluation stage: predictions of the selected model on validation and test, AUROC with CIs,
precision-recall, calibration, operating points, AUROC and underdiagnosis by subgroup, and Grad-CAM
heatmaps scored against the release's boxes.

The model arriving here was selected on validation by the fine-tuning stage; the test split is
used once, here, and never for selection. Its run id covers the train and val data; that no test
patient is one of theirs is checked from the shards before anything is scored (``leakage``).
Operating points are chosen on validation (Youden's J) and then applied to test; a threshold
resting on few validation positives is flagged; a finding with one class in validation falls back
to a test-chosen point, recorded as such (``record``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from chexflow import host, watchdog
from chexflow.data import nih
from chexflow.data.augment import gpu_augment
from chexflow.data.loader import ShardStream, make_loader
from chexflow.data.manifest import Alone, read_manifest, split_shards, verify_on_world
from chexflow.data.stamps import StampStore
from chexflow.evaluate import intervals, leakage, localisation, model_file, saliency, subgroups, underdiagnosis
from chexflow.evaluate.config import EvaluateConfig
from chexflow.evaluate.metrics import (auroc_per_label, bootstrap_auroc, calibration, mean_auroc, positives,
                                       precision_recall)
from chexflow.evaluate.published import CHEXNET
from chexflow.evaluate.record import LabelRecord, choose_operating_point, write_csv, write_predictions
from chexflow.fsutil import atomic_path, write_text_atomic
from chexflow.settings import ConfigError
from chexflow.train.checkpoint import load_model
from chexflow.train.config import TrainConfig
from chexflow.train.models import ieee_fp32


class Scored(NamedTuple):
    """A model's scores on a split's images: float ``[N, labels]`` sigmoid scores and targets (NaN unknown),
    each image's patient and name, in the shards' order."""
    scores: np.ndarray
    targets: np.ndarray
    patients: list[str]
    images: list[str]


def predict(model: torch.nn.Module, shards, *, crop: int, batch_size: int, device) -> Scored:
    """The model's scores on ``shards`` (evaluation's preprocessing: the crop, no augmentation)."""
    stream = ShardStream(shards, rank=0, world=1, seed=0, batch_size=batch_size, shuffle=False)
    batches = make_loader(stream, batch_size=batch_size, workers=0, pin_memory=False)
    scores, targets, patients, images = [], [], [], []
    model.eval()
    with torch.no_grad(), ieee_fp32():
        for x, y, ids in batches:
            watchdog.beat("evaluation")
            z = gpu_augment(x.to(device), out_size=crop, train=False, cfg=None, generator=None)
            scores.append(torch.sigmoid(model(z).float()).cpu().numpy())
            targets.append(y.numpy().astype(np.float64))
            patients += [i.patient for i in ids]
            images += [i.image for i in ids]
    return Scored(np.concatenate(scores), np.concatenate(targets), patients, images)


def expected_run_ids(train_cfgs: list[TrainConfig], manifest: Path, pretrained: Path | None) -> set[str]:
    """The run ids a model to evaluate may carry: those of the training settings that should have
    produced it (the finetune section; the sweep's trials) on the data of ``manifest`` (the one it
    is evaluated on) from its pretraining model: a model of other data is refused as stale."""
    from chexflow.train.identity import run_id
    for c in train_cfgs:
        if c.init == "pretrained" and pretrained is None:
            raise ConfigError(f"{c.stage}.init is pretrained: the pretraining model is needed to compute the "
                              "expected run id of the model (--pretrained)")
    return {run_id(c, manifest, pretrained) for c in train_cfgs}


def run(cfg: EvaluateConfig, *, model_path: Path, manifest: Path, out_dir: Path,
        expect_run_ids: set[str] | None = None, label_table: Path | None = None, boxes: Path | None = None,
        box_frame: int | None = None, heatmaps: bool = True, verified: Path | None = None) -> dict:
    """Evaluate the model file ``model_path`` on the test split of ``manifest`` into ``out_dir`` (tables,
    ``metrics.json``, and ``model.pt``: the model with its predict record, :mod:`.model_file`). The
    file must be a multi-label model of the manifest's labels and, with ``expect_run_ids``, carry one
    of those run ids (a stale model of other settings is refused naming both). ``label_table``: the
    release's label table (subgroups); ``boxes``: its box list in pixels of ``box_frame`` px square
    images (localisation scores; heatmaps of the top true/false positives are drawn either way).
    ``heatmaps`` False: no Grad-CAM at all (the ablation's runs: the report shows the main model's).
    ``verified``: the folder of shard verification stamps (chexflow.data.stamps): shards they vouch
    for are not hashed again (a requeued evaluation hashes nothing unchanged)."""
    if boxes is not None and box_frame is None:
        raise ConfigError(f"{boxes}: the box list needs the side of the images its boxes refer to (--box-frame)")
    out_dir = Path(out_dir)
    expect = {"task": "multilabel", "labels": list(read_manifest(manifest)["labels"])}
    if expect_run_ids is not None:
        ids = sorted(expect_run_ids)
        expect["run_id"] = ids[0] if len(ids) == 1 else frozenset(ids)
    else:
        print(f"{model_path}: run id not checked (no training settings given)", flush=True)
    # every shard evaluation reads, the training splits' for the leak check (by their stamps: training
    # stamped them), hashed at most once, then no test patient trained or selected on
    checked_splits = [*leakage.training_splits(Path(manifest)), "test"]
    shards = {split: split_shards(manifest, split) for split in checked_splits}
    every = [ref for split in checked_splits for ref in shards[split]]
    store = None if verified is None else StampStore(verified, manifest)
    print(verify_on_world(every, [0] * len(every), Alone(), store), flush=True)
    test_split = leakage.checked_test_split(Path(manifest))
    model, info = load_model(model_path, expect=expect)
    labels = list(info["labels"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    crop = info["crop"]

    val = predict(model, split_shards(manifest, "val"), crop=crop, batch_size=cfg.batch_size, device=device)
    test = predict(model, shards["test"], crop=crop, batch_size=cfg.batch_size, device=device)
    s, y, patients, images = test
    # the bootstraps, subgroups, audit and heatmaps: minutes at ChestX-ray14's 25,596 test images, and no
    # batch's pace predicts them
    watchdog.unpaced("statistics")

    per_label = auroc_per_label(y, s, labels)
    boot = bootstrap_auroc(y, s, np.asarray(patients), labels, n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    defined = [label for label in labels if per_label[label] is not None]
    comparable = published_comparable(labels)
    result = {"labels": {}, "mean_auroc": mean_auroc(per_label), "mean_auroc_labels": defined,
              "published_comparable": comparable,
              "chexnet_mean_same_labels": CHEXNET.mean_over(defined) if comparable else None,
              "n_images": int(len(images)),
              "n_patients": int(len(set(patients))), "model": str(model_path), "model_run_id": info["run_id"],
              "model_run_id_checked": expect_run_ids is not None, "test_split": test_split,
              "model_epoch": info.get("epoch"), "model_val_metric": info.get("val_metric"),
              "model_arch": info.get("arch"), "model_init": (info.get("config") or {}).get("init"),
              "model_seed": (info.get("config") or {}).get("seed"),
              "bootstrap": {"n_resamples": cfg.bootstrap_resamples, "seed": cfg.seed,
                            "mean_auroc_ci": boot.get("mean_auroc_ci"),
                            "mean_resamples_used": boot["mean_auroc"]["n_resamples_used"],
                            "mean_rule": boot["mean_auroc"]["rule"]},
              "min_val_positives": cfg.min_val_positives, "calibration_bins": cfg.calibration_bins,
              "min_patients": cfg.min_patients,
              # where the scores were computed, and where the model was trained (None: not recorded)
              "host": host.describe(), "training_host": info.get("host")}
    for j, label in enumerate(labels):
        result["labels"][label] = _label_entry(cfg, label, y[:, j], s[:, j], patients, val, j, per_label[label],
                                               boot["labels"][label], comparable)

    fields = None
    if label_table is not None:
        fields, result["subgroups"] = subgroups.from_table(cfg, label_table, images, y, s, patients, labels)
    # the "no finding" call of the audit: chosen on validation, applied to test (underdiagnosis)
    call = underdiagnosis.no_finding_operating_point(
        val.targets, val.scores, val.patients, labels, {L: e.get("threshold_val_youden") for L, e in result["labels"].items()})
    result["underdiagnosis"] = underdiagnosis.audit(
        y, s, patients, labels, call, fields, age_edges=cfg.age_bands, min_patients=cfg.min_patients,
        n_resamples=cfg.bootstrap_resamples, seed=cfg.seed, images=images)
    stored = int(read_manifest(Path(manifest)).get("image_size") or crop)
    heat = _saliency(cfg, model, info, labels, test, result, manifest=Path(manifest), crop=crop, stored=stored,
                     boxes=boxes, box_frame=box_frame, device=device) if heatmaps else _NO_HEATMAPS
    result["localisation"] = heat["summary"]

    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tables(out_dir, result, labels, test, heat)
    model_file.write(out_dir / model_file.NAME, info, result, Path(manifest))   # the file that travels alone
    write_text_atomic(out_dir / "metrics.json", json.dumps(result, indent=1, default=float))
    return result


# --------------------------------------------------------------------------- per finding

def published_comparable(labels: list[str]) -> bool:
    """Whether the published ChestX-ray14 numbers (CheXNet, Wang et al.) stand beside a model of ``labels``:
    they are of NIH's 14 findings, so only a model of exactly those. Decided here, stored in the record
    (``published_comparable``); the report reads it."""
    return tuple(labels) == nih.LABELS


def _label_entry(cfg: EvaluateConfig, label: str, yj: np.ndarray, sj: np.ndarray, patients: list[str],
                 val: Scored, j: int, auroc: float | None, boot: dict, comparable: bool) -> LabelRecord:
    """A finding's AUROC, CI, positives, AUPRC, calibration and its operating point (``record``), each
    with its interval (``intervals``), under the small-count rule: below ``min_patients`` positive or
    negative patients the CIs are withheld and ``too_few`` says why; CheXNet's AUROC of it where the
    published numbers are ``comparable``."""
    known = ~np.isnan(yj)
    test_pos = positives(yj, patients)
    pats = np.asarray(patients)[known]
    n_neg_patients = int(np.unique(pats[yj[known] == 0]).size)
    few = intervals.too_few(test_pos["patients"], n_neg_patients, cfg.min_patients) if auroc is not None else None
    entry: LabelRecord = {"auroc": auroc, "n_pos": test_pos["images"], "n_neg": int((yj[known] == 0).sum()),
                          "n_pos_patients": test_pos["patients"], "n_neg_patients": n_neg_patients, "too_few": few,
                          "ci": None if few else boot["ci"], "ci_resamples_dropped": boot["n_skipped"],
                          "vs_chance": None if few else intervals.against_chance(boot["ci"]),
                          "chexnet": CHEXNET.get(label) if comparable else None}
    if len(np.unique(yj[known])) == 2:
        pr = precision_recall(yj, sj)
        entry.update(auprc=pr["auprc"], prevalence=pr["prevalence"],
                     calibration=calibration(yj, sj, n_bins=cfg.calibration_bins))
        entry["score_intervals"] = None if few else intervals.score_intervals(
            yj[known], sj[known], pats, n_bins=cfg.calibration_bins, n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    vs, vy, vpatients = val.scores[:, j], val.targets[:, j], val.patients
    vknown = ~np.isnan(vy)
    vpos = positives(vy, vpatients)
    entry["val_positives"] = vpos["images"]
    entry["val_positive_patients"] = vpos["patients"]
    entry.update(choose_operating_point(vy[vknown], vs[vknown], yj[known], sj[known]))
    if "test_operating_point" in entry and known.any():
        entry["test_operating_point_intervals"] = intervals.operating_point_intervals(
            yj[known], sj[known], pats, entry["test_operating_point"]["threshold"], minimum=cfg.min_patients,
            n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    if entry.get("operating_point_split") == "validation":
        # the evidence the threshold rests on: images of one patient are not independent
        entry["threshold_few_positives"] = min(vpos["images"], vpos["patients"]) < cfg.min_val_positives
    return entry


# --------------------------------------------------------------------------- heatmaps and localisation

def inputs_of(shards, wanted: set[str], *, crop: int, batch_size: int, device) -> dict[str, torch.Tensor]:
    """The evaluation inputs (normalised [1, crop, crop], as ``predict`` feeds them) of the images in
    ``wanted``: a second pass over the split's shards, keeping only those."""
    stream = ShardStream(shards, rank=0, world=1, seed=0, batch_size=batch_size, shuffle=False)
    out: dict[str, torch.Tensor] = {}
    for x, _, ids in make_loader(stream, batch_size=batch_size, workers=0, pin_memory=False):
        watchdog.beat("evaluation")
        keep = [k for k, i in enumerate(ids) if i.image in wanted]
        if keep:
            z = gpu_augment(x[keep].to(device), out_size=crop, train=False, cfg=None, generator=None)
            out.update({ids[k].image: z[n].cpu() for n, k in enumerate(keep)})
    return out


def _gallery_pairs(cfg: EvaluateConfig, labels: list[str], s: np.ndarray, y: np.ndarray, result: dict) -> list:
    """(image index, finding index, kind) of the top-k true and false positives per finding at the
    validation-chosen threshold (highest score first)."""
    pairs = []
    for j, label in enumerate(labels):
        thr = result["labels"][label].get("threshold_val_youden")
        if thr is None or cfg.saliency.top_k == 0:
            continue
        order = np.argsort(-s[:, j], kind="stable")
        for kind, truth in (("TP", 1.0), ("FP", 0.0)):
            chosen = [i for i in order if y[i, j] == truth and s[i, j] >= thr][:cfg.saliency.top_k]
            pairs += [(int(i), j, kind) for i in chosen]
    return pairs


def _saliency(cfg: EvaluateConfig, model, info: dict, labels: list[str], test: Scored, result: dict, *,
              manifest: Path, crop: int, stored: int, boxes: Path | None, box_frame: int | None, device) -> dict:
    """Grad-CAM of the gallery (top true/false positives) and of every test image with a reference box
    of a finding it is positive for; the pointing game and IoBB of the latter, per finding."""
    s, y, patients, images = test
    index = {name: i for i, name in enumerate(images)}
    name, layer, side = saliency.choose_layer(model, crop=crop, in_channels=info["in_channels"],
                                              min_side=cfg.saliency.min_side, device=device, layer=cfg.saliency.layer)
    summary: dict = {"method": "Grad-CAM (Captum LayerGradCam)", "layer": name, "layer_side": side, "crop": crop,
                     "level": localisation.HEATMAP_LEVEL, "tie_rtol": localisation.TIE_RTOL, "boxes": None, "labels": {},
                     "unit": "patient", "min_patients": cfg.min_patients}
    ref: dict[tuple[int, int], list] = {}
    if boxes is not None:
        frame = localisation.Frame(width=box_frame, height=box_frame, stored=stored, crop=crop)
        table = nih.read_box_list(Path(boxes), frame=box_frame)
        in_test = table[table["image"].isin(index)]
        outside = 0
        for row in in_test.itertuples(index=False):
            i, j = index[row.image], labels.index(row.label)
            mapped = localisation.to_eval_frame((row.x, row.y, row.w, row.h), frame)
            if mapped is None:
                outside += 1
            elif y[i, j] == 1:
                ref.setdefault((i, j), []).append(mapped)
        summary["boxes"] = {"file": str(boxes), "frame": box_frame, "stored": stored, "n_boxes": int(len(table)),
                            "n_test_boxes": int(len(in_test)), "n_outside_crop": outside,
                            "findings": sorted(set(table["label"]), key=labels.index)}
    gallery = _gallery_pairs(cfg, labels, s, y, result)
    pairs = sorted(set(ref) | {(i, j) for i, j, _ in gallery})
    wanted = {images[i] for i, _ in pairs}
    inputs = inputs_of(split_shards(manifest, "test"), wanted, crop=crop, batch_size=cfg.batch_size,
                       device=device)
    x = torch.stack([inputs[images[i]] for i, _ in pairs]) if pairs else torch.zeros(0, 1, crop, crop)
    maps = saliency.gradcam(model, layer, x, [j for _, j in pairs], batch_size=cfg.saliency.batch_size)
    heat = dict(zip(pairs, maps))
    scored = []
    for (i, j), found in sorted(ref.items()):
        row = localisation.score(heat[(i, j)], found, where=f"{images[i]} ({labels[j]})")
        scored.append({"image": images[i], "patient": patients[i], "label": labels[j], "score": float(s[i, j]),
                       **{k: row[k] for k in ("hit", "no_saliency", "n_tied", "n_tied_inside", "iobb", "random_point",
                                              "centre_hit")},
                       "point_x": row["point"][0], "point_y": row["point"][1], "n_boxes": len(found)})
    if boxes is not None:
        for label in summary["boxes"]["findings"]:       # the model's labels with a box, in its order
            summary["labels"][label] = localisation.summarise(
                [r for r in scored if r["label"] == label], min_patients=cfg.min_patients,
                n_resamples=cfg.bootstrap_resamples, seed=cfg.seed, auroc_ci=result["labels"][label]["ci"])
    return {"summary": summary, "scored": scored, "gallery": gallery, "heat": heat, "inputs": inputs, "ref": ref}


_NO_HEATMAPS = {"summary": None, "scored": [], "gallery": [], "heat": {}, "inputs": {}, "ref": {}}


# --------------------------------------------------------------------------- files

def _write_tables(out_dir: Path, result: dict, labels: list[str], test: Scored, heat: dict) -> None:
    s, y, patients, images = test
    cols = {"image": images, "patient": patients}
    for j, label in enumerate(labels):
        cols[label] = y[:, j]
        cols[f"{label}_score"] = s[:, j]
    write_predictions(out_dir / "predictions.csv", pd.DataFrame(cols))
    rows = [{"label": L, "auroc": e["auroc"], **intervals.ci_columns(e["ci"]), "chexnet": e["chexnet"],
             "too_few": e.get("too_few")} for L, e in result["labels"].items()]
    rows.append({"label": "mean", "auroc": result["mean_auroc"],
                 **intervals.ci_columns(result["bootstrap"]["mean_auroc_ci"]),
                 "chexnet": result["chexnet_mean_same_labels"]})
    write_csv(out_dir / "auroc.csv", rows, float_format="%.4f")
    write_csv(out_dir / "calibration.csv", [
        {"label": L, "auprc": e.get("auprc"), "prevalence": e.get("prevalence"),
         "brier": (e.get("calibration") or {}).get("brier"), "ece": (e.get("calibration") or {}).get("ece"),
         "threshold_val_youden": e.get("threshold_val_youden"), "operating_point_split": e.get("operating_point_split"),
         "val_positives": e["val_positives"],
         "val_positive_patients": e["val_positive_patients"],
         "threshold_few_positives": e.get("threshold_few_positives"),
         **{k: (e.get("test_operating_point") or {}).get(k) for k in ("sensitivity", "specificity", "ppv", "npv")},
         **_interval_columns(e)}
        for L, e in result["labels"].items()])
    write_csv(out_dir / "subgroups.csv", [
        {"attribute": g["attribute"], "group": g["group"], "n_images": g["n_images"], "n_patients": g["n_patients"],
         "label": L, "auroc": e["auroc"], **intervals.ci_columns(e["ci"]),
         "n_pos": e["n_pos"], "n_neg": e["n_neg"], "n_pos_patients": e["n_pos_patients"],
         "n_neg_patients": e["n_neg_patients"], "note": e["note"]}
        for g in (result.get("subgroups") or {}).get("groups", []) for L, e in g["labels"].items()])
    write_csv(out_dir / "underdiagnosis.csv", underdiagnosis.table(result["underdiagnosis"]), underdiagnosis.COLUMNS)
    if heat["summary"] is not None:
        write_csv(out_dir / "localisation.csv", heat["scored"], LOCALISATION_COLUMNS)
        _write_gallery(out_dir / "saliency.npz", heat, labels, test)


def _interval_columns(e: dict) -> dict:
    """A finding's intervals as CSV columns: AUPRC, Brier, ECE and the rates at its operating point."""
    si, op = e.get("score_intervals") or {}, e.get("test_operating_point_intervals") or {}
    cis = {**{k: si.get(f"{k}_ci") for k in ("auprc", "brier", "ece")},
           **{k: (op.get(k) or {}).get("ci") for k in ("sensitivity", "specificity", "ppv", "npv")}}
    return {col: v for k, ci in cis.items() for col, v in intervals.ci_columns(ci, f"{k}_ci").items()}


LOCALISATION_COLUMNS = ("image", "patient", "label", "score", "hit", "no_saliency", "point_x", "point_y", "n_tied",
                        "n_tied_inside", "iobb", "random_point", "centre_hit", "n_boxes")


def _write_gallery(path: Path, heat: dict, labels: list[str], test: Scored) -> None:
    """The gallery's inputs (normalised, as the model saw them), heatmaps and boxes (plain arrays and
    JSON text: the report reads them with ``allow_pickle=False``)."""
    s, y, patients, images = test
    gallery = heat["gallery"]
    meta = [{"image": images[i], "label": labels[j], "kind": kind, "score": float(s[i, j]),
             "boxes": [list(b) for b in heat["ref"].get((i, j), [])],
             "point": localisation.score(heat["heat"][(i, j)], [(0.0, 0.0, 1.0, 1.0)])["point"]}   # where it points
            for i, j, kind in gallery]
    crop = heat["summary"]["crop"]
    arrays = {"inputs": np.asarray([heat["inputs"][images[i]][0].numpy() for i, _, _ in gallery],
                                   np.float16).reshape(-1, crop, crop),
              "heatmaps": np.asarray([heat["heat"][(i, j)] for i, j, _ in gallery], np.float16).reshape(-1, crop, crop),
              "meta": np.array(json.dumps(meta))}
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez_compressed(fh, **arrays)
