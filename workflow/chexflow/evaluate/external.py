"""External validation: the fine-tuned model on another dataset's test split, beside its internal test.

The model (the evaluation's ``model.pt``, whose run id must be the one its internal record names)
scores the external test split at the crop it was trained at. Its findings are matched to the
dataset's labels through the label map (``chexflow.data.labelmap``); the findings without a match,
on either side, are listed in the record and the report, never dropped silently. For each matched
finding the record holds the internal AUROC (from the internal ``predictions.csv``) and the external
one, each with its patient-bootstrap CI, and the drop ``internal - external`` with a CI from independent
bootstraps of the two test sets (``metrics.independent_bootstrap_auroc_diff``): the sets share no
patient, so each is resampled on its own, as Zech et al. (PLOS Medicine 2018) compare a model's AUROC
on its own hospital's and other hospitals' test sets. The internal CIs are those of the internal
evaluation (the same resamples). Unknown labels (NaN, e.g. CheXpert's uncertain under ``ignore``) are
left out of each finding's AUROC on that image.

The external set gets the internal evaluation's audits of its matched findings, with the same functions and
settings: each finding's calibration (beside the internal one, from the internal record) and, given the
external set's label table, its AUROC by subgroup (sex, age band, view; ``evaluate.min_patients``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from chexflow import watchdog
from chexflow.data import labelmap
from chexflow.data.manifest import read_manifest, split_shards
from chexflow.evaluate.config import EvaluateConfig
from chexflow.evaluate.external_record import ExternalInputError
from chexflow.evaluate import intervals, subgroups, underdiagnosis
from chexflow.evaluate.metrics import calibration, independent_bootstrap_auroc_diff, positives
from chexflow.evaluate.record import read_metrics, read_predictions, write_csv, write_predictions
from chexflow.evaluate.run import predict
from chexflow.fsutil import write_text_atomic
from chexflow.train.checkpoint import load_model

STATISTIC = ("drop = internal AUROC - external AUROC; 95% CI: percentile bootstrap, each test set's patients "
             "resampled independently (the sets share no patient), resample k of the drop = resample k of the "
             "internal set - resample k of the external set")


# what "no finding" means on an external set: its table labels only the matched findings
UNDERDIAGNOSIS_SCOPE = ("the internal validation's call, applied to the external test set; an image counts as "
                        "having a finding when one of the matched findings is positive, and as normal when none is "
                        "(its table's other findings are not the model's: unknown here)")


class TestSet(NamedTuple):
    """One test set's matched findings: targets and scores ``[N, pairs]`` (the label map's pairs, in order)
    and each image's patient (the unit of the bootstraps)."""
    targets: np.ndarray
    scores: np.ndarray
    patients: np.ndarray


def run(cfg: EvaluateConfig, *, model_path: Path, manifest: Path, internal_metrics: Path,
        internal_predictions: Path, out_dir: Path, label_table: Path | None = None) -> dict:
    """Evaluate ``model_path`` on the test split of ``manifest`` against the internal test
    (``internal_metrics``, ``internal_predictions``, the evaluation of the same model) into ``out_dir``:
    ``metrics.json`` (the record), ``predictions.csv`` and ``auroc.csv``. ``label_table``: the external
    set's table of sex, age and view (its split table, or NIH's label file) for the subgroup AUROCs."""
    internal = read_metrics(Path(internal_metrics))
    model_labels = list(internal["labels"])
    model, info = load_model(model_path, expect={"task": "multilabel", "labels": model_labels,
                                                  "run_id": internal.get("model_run_id")})
    m = read_manifest(Path(manifest))
    if m.get("task") != "multilabel":
        raise ExternalInputError(f"{manifest}: {m.get('dataset')} is not a multi-label dataset of findings")
    if "test" not in m.get("splits", {}):
        raise ExternalInputError(f"{manifest}: {m.get('dataset')} has no test split")
    found = labelmap.match(model_labels, list(m["labels"]))
    if not found.pairs:
        raise ExternalInputError(f"{manifest}: {m.get('dataset')}'s findings {list(m['labels'])} match none of the "
                                 f"model's {model_labels} (chexflow.data.labelmap)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    scored = predict(model, split_shards(manifest, "test"), crop=info["crop"], batch_size=cfg.batch_size,
                     device=device)
    patients, images = scored.patients, scored.images
    names = [a for a, _ in found.pairs]
    ours = [model_labels.index(a) for a in names]
    theirs = [list(m["labels"]).index(b) for _, b in found.pairs]
    ext = TestSet(scored.targets[:, theirs], scored.scores[:, ours], np.asarray(patients))
    pred = read_predictions(Path(internal_predictions), model_labels)
    inner = TestSet(pred[names].to_numpy(float), pred[[f"{a}_score" for a in names]].to_numpy(float),
                    pred["patient"].astype(str).to_numpy())
    if len(pred) != internal["n_images"]:
        raise ExternalInputError(f"{internal_predictions}: {len(pred)} rows, but {internal_metrics} counts "
                                 f"{internal['n_images']} test images: not the same evaluation")
    watchdog.unpaced("statistics")          # the bootstraps and audits: no batch's pace predicts them
    stat = independent_bootstrap_auroc_diff(inner, ext, names, n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    result = _record(cfg, m, manifest, found, stat, internal, ext, inner, info)
    result.update(n_images=int(len(images)), n_patients=int(len(set(patients))))
    every = np.full(scored.scores.shape, np.nan)
    every[:, ours] = scored.targets[:, theirs]
    call = _internal_call(internal, model_labels, internal_metrics)
    _audit(cfg, result, ext, names, images, label_table, internal, (every, scored.scores, model_labels, call))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tables(out_dir, result, found, images, patients, ext)
    write_text_atomic(out_dir / "metrics.json", json.dumps(result, indent=1, default=float))
    return result


def _record(cfg: EvaluateConfig, m: dict, manifest: Path, found: labelmap.Match, stat: dict, internal: dict,
            ext: TestSet, inner: TestSet, info: dict) -> dict:
    findings = []
    name = m.get("dataset")
    for k, (ours, theirs) in enumerate(found.pairs):
        e = stat["labels"][ours]
        sides = {"internal": {"auroc": e["a"], "ci": e["a_ci"], **_counts(inner.targets[:, k], inner.patients)},
                 "external": {"auroc": e["b"], "ci": e["b_ci"], **_counts(ext.targets[:, k], ext.patients)}}
        few = {side: intervals.too_few(c["n_pos_patients"], c["n_neg_patients"], cfg.min_patients)
               for side, c in sides.items()}
        for side, words in few.items():
            sides[side].update(too_few=words, ci=None if words else sides[side]["ci"])   # the rule withholds the CI
        drop = {"diff": e["diff"], "ci": e["ci"], "p_le_0": e["p_le_0"], "n_resamples_used": e["n_resamples_used"],
                "n_resamples_dropped": e["n_resamples_dropped"]}
        blocked = "; ".join(f"{side}: {w}" for side, w in few.items() if w)
        if blocked:
            drop.update(ci=None, p_le_0=None)
        findings.append({"finding": ours, "external_label": theirs, **sides,
                         "drop": {**drop, **drop_verdict(drop, name, too_few=blocked or None)},
                         "calibration": {"internal": (internal["labels"][ours] or {}).get("calibration")}})
    return {"dataset": m.get("dataset"), "title": m.get("title"), "split_source": m.get("split_source"),
            "synthetic": bool(m.get("synthetic")), "manifest": str(manifest), "labelling": m.get("labelling"),
            "model_run_id": info["run_id"],
            "label_map": found.record(), "findings": findings,
            "mean": {"findings": stat["mean"]["labels"], "internal": stat["mean"]["a"], "external": stat["mean"]["b"],
                     "drop": stat["mean"]["diff"], "ci": stat["mean"]["ci"],
                     "n_resamples_used": stat["mean"]["n_resamples_used"],
                     **drop_verdict({"diff": stat["mean"]["diff"], "ci": stat["mean"]["ci"]}, name)},
            "bootstrap": {"n_resamples": stat["n_resamples"], "seed": stat["seed"], "alpha": stat["alpha"],
                          "n_patients_internal": stat["n_patients_a"], "n_patients_external": stat["n_patients_b"],
                          "mean_rule": stat["rule"]},
            "statistic": STATISTIC}


def _audit(cfg: EvaluateConfig, result: dict, ext: TestSet, names: list[str], images: list[str],
           label_table: Path | None, internal: dict, everything: tuple) -> None:
    """The internal evaluation's audits on the external set (``evaluate.run``'s calls and settings), into
    ``result``: each matched finding's ``calibration`` (ECE, Brier, bins) with its intervals beside the
    internal one's; ``subgroups`` with a label table; ``underdiagnosis`` at the internal validation's
    "no finding" call, beside the internal test set's overall cell. ``everything``: the external targets
    of every model label (NaN where the label map matched none), the scores, the model's labels, the call."""
    for k, entry in enumerate(result["findings"]):
        y, s = ext.targets[:, k], ext.scores[:, k]
        known = ~np.isnan(y)
        cal = entry["calibration"]
        cal["external"] = (calibration(y, s, n_bins=cfg.calibration_bins)
                           if len(np.unique(y[known])) == 2 else None)
        cal["internal_intervals"] = (internal["labels"][entry["finding"]] or {}).get("score_intervals")
        cal["external_intervals"] = None if cal["external"] is None or entry["external"].get("too_few") else \
            intervals.score_intervals(y[known], s[known], ext.patients[known], n_bins=cfg.calibration_bins,
                                      n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    fields = None
    if label_table is not None:
        fields, result["subgroups"] = subgroups.from_table(cfg, label_table, images, ext.targets, ext.scores,
                                                           ext.patients, names)
    call = everything[3]
    if call is not None:
        y_all, s_all, labels, _ = everything
        audit = underdiagnosis.audit(y_all, s_all, ext.patients, labels, call, fields, age_edges=cfg.age_bands,
                                     min_patients=cfg.min_patients, n_resamples=cfg.bootstrap_resamples,
                                     seed=cfg.seed, images=images)
        result["underdiagnosis"] = {**audit, "internal_overall": internal["underdiagnosis"].get("overall"),
                                    "internal_verdict": internal["underdiagnosis"].get("verdict"),
                                    "scope": UNDERDIAGNOSIS_SCOPE}


def _internal_call(internal: dict, labels: list[str], where: Path) -> dict | None:
    """The internal evaluation's "no finding" call (metrics.json ``underdiagnosis.call``), checked as
    untrusted input; None when that evaluation has no audit."""
    call = (internal.get("underdiagnosis") or {}).get("call")
    if call is None:
        return None
    thr = call.get("threshold") if isinstance(call, dict) else "?"
    findings = call.get("findings") if isinstance(call, dict) else None
    if not (thr is None or (isinstance(thr, (int, float)) and not isinstance(thr, bool) and np.isfinite(thr))) \
            or not isinstance(findings, list) or not set(findings) <= set(labels):
        raise ExternalInputError(f"{where}: underdiagnosis.call must "
                                 "name a finite threshold (or null) and findings among the model's labels, got "
                                 f"{call!r}"[:300])
    return call


def drop_verdict(drop: dict, dataset: str | None, *, too_few: str | None = None) -> dict:
    """What the drop's CI says (``verdict``: "too few", "undefined", "lower", "higher", "no difference
    shown"), with its words (``verdict_text``): decided here, stored in the record, rendered by the report.
    ``too_few``: the small-count rule's words for either test set (no CI, no verdict)."""
    ci = drop.get("ci")
    if drop.get("diff") is None:
        return {"verdict": "undefined", "verdict_text": "undefined: one class in a test set"}
    if too_few:
        return {"verdict": "too few", "verdict_text": f"{too_few}: no CI, no verdict"}
    if ci is None:
        return {"verdict": "no CI", "verdict_text": "no CI"}
    if ci[0] > 0:
        return {"verdict": "lower", "verdict_text": f"lower on {dataset} (95% CI of the drop above 0)"}
    if ci[1] < 0:
        return {"verdict": "higher", "verdict_text": f"higher on {dataset} (95% CI of the drop below 0)"}
    return {"verdict": "no difference shown", "verdict_text": "no difference shown (95% CI of the drop includes 0)"}


def _counts(y: np.ndarray, patients: np.ndarray) -> dict:
    pos = positives(y, patients)
    return {"n_pos": pos["images"], "n_neg": int((y == 0).sum()), "n_unknown": int(np.isnan(y).sum()),
            "n_pos_patients": pos["patients"], "n_neg_patients": int(np.unique(np.asarray(patients)[y == 0]).size)}


def _write_tables(out_dir: Path, result: dict, found: labelmap.Match, images: list[str], patients: list[str],
                  ext: TestSet) -> None:
    cols: dict = {"image": images, "patient": patients}
    for k, (ours, theirs) in enumerate(found.pairs):
        cols[ours] = ext.targets[:, k]
        cols[f"{ours}_score"] = ext.scores[:, k]
    write_predictions(out_dir / "predictions.csv", pd.DataFrame(cols))
    rows = [{"finding": f["finding"], "external_label": f["external_label"],
             **{f"{side}_{k}": v for side in ("internal", "external")
                for k, v in {"auroc": f[side]["auroc"], **intervals.ci_columns(f[side]["ci"])}.items()},
             "drop": f["drop"]["diff"], **intervals.ci_columns(f["drop"]["ci"], "drop_ci")} for f in result["findings"]]
    mean = result["mean"]
    rows.append({"finding": "mean", "internal_auroc": mean["internal"], "external_auroc": mean["external"],
                 "drop": mean["drop"], **intervals.ci_columns(mean["ci"], "drop_ci")})
    write_csv(out_dir / "auroc.csv", rows, float_format="%.4f")

