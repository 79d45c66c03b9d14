"""Underdiagnosis by subgroup, as radiology fairness audits report it (Seyyed-Kalantari et al.,
Nature Medicine 2021): how often the model calls "no finding" where there is one.

The call: an image is called "no finding" when every finding's score lies below its threshold chosen
on validation (Youden's J, ``threshold_val_youden``). The truth uses the same findings: an image "has a
finding" when a finding with a threshold is labelled positive on it. A finding without a threshold
(one class in validation) can be neither called nor counted: an image positive only for such
findings would be "missed" whatever its score, so it is set aside, and the record names those
findings and the images set aside (``set_aside``). Two rates, each with a patient-bootstrap CI
(``metrics.patient_resample_counts``: all images of a drawn patient come along; resamples whose
denominator is empty are dropped):

  image level    of the images with a finding, the share called "no finding" (the paper's rate: the
                 false-positive rate of "no finding");
  patient level  of the patients with at least one image with a finding, the share whose every image
                 with a finding is called "no finding" (the model never flags them).

Per subgroup (sex, age band, view; the fields of ``subgroups.read_fields``) and per pairwise
intersection of them, each over the images in the cell. A cell with fewer than ``min_count`` patients
with a finding shows its rates without a bootstrap CI and says why; the report lists intersections only
where they are large enough. Every cell gives the exact (Clopper-Pearson) interval of its patient rate
(patients are independent units): the interval of the small cells, and of the cells where none (or
all) of the patients are missed, where the percentile bootstrap collapses to the rate.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations

import numpy as np
import pandas as pd

from chexflow.evaluate.metrics import patient_resample_counts
from chexflow.evaluate.subgroups import SEXES, VIEWS, age_band_names

ATTRIBUTES = ("sex", "age_band", "view")
DEFINITION = ("an image is called \"no finding\" when every finding's score lies below its validation-chosen "
              "threshold; it has a finding when a finding with such a threshold is labelled on it (an image positive "
              "only for findings without one is set aside); image level: of the images with a finding, the share "
              "called \"no finding\"; patient level: of the patients with an image with a finding, the share whose "
              "every such image is called \"no finding\"")


def called_no_finding(scores: np.ndarray, thresholds: Sequence[float | None]) -> np.ndarray:
    """Per image: True when every score with a threshold lies below it (``scores`` [N, L])."""
    used = [j for j, t in enumerate(thresholds) if t is not None]
    if not used:
        raise ValueError("no finding has a validation-chosen threshold: nothing can be called")
    return np.all(scores[:, used] < np.asarray([thresholds[j] for j in used], float), axis=1)


def rates(has_finding: np.ndarray, missed: np.ndarray, patients: np.ndarray, *, min_count: int, n_resamples: int,
          seed: int, alpha: float = 0.05, set_aside: np.ndarray | None = None) -> dict:
    """The image- and patient-level rates of one cell (see the module doc), each ``{"n", "missed", "rate",
    "ci"}`` (the patient level also ``ci_exact``, in every cell), the cell's patients and images, how many
    of its images were set aside (``set_aside``: positive only for findings without a threshold), and
    ``note`` (why there is no bootstrap CI, or why it collapsed)."""
    patients = np.asarray(patients)
    miss = has_finding & missed
    _, pidx = np.unique(patients, return_inverse=True)
    n_pat = int(pidx.max()) + 1 if pidx.size else 0
    pat_has = np.bincount(pidx, weights=has_finding.astype(float), minlength=n_pat) > 0
    flagged = np.bincount(pidx, weights=(has_finding & ~missed).astype(float), minlength=n_pat)
    pat_missed = pat_has & (flagged == 0)
    out = {"n_images": int(patients.size), "n_patients": n_pat,
           "n_images_set_aside": 0 if set_aside is None else int(set_aside.sum()),
           "image": _point(int(has_finding.sum()), int(miss.sum())),
           "patient": _point(int(pat_has.sum()), int(pat_missed.sum())), "note": ""}
    p = out["patient"]
    p["ci_exact"] = exact_ci(p["missed"], p["n"], alpha=alpha) if p["n"] else None
    if p["n"] < min_count:
        out["note"] = f"too few patients with a finding for a CI ({p['n']}, {min_count} needed)"
        return out
    _, counts = patient_resample_counts(patients, n_resamples, np.random.default_rng(seed))
    img_w = counts[:, pidx].astype(float)                 # image i's multiplicity in each resample
    q = [100.0 * alpha / 2.0, 100.0 * (1.0 - alpha / 2.0)]
    for key, num, den in (("image", img_w @ miss.astype(float), img_w @ has_finding.astype(float)),
                          ("patient", counts @ pat_missed.astype(float), counts @ pat_has.astype(float))):
        ok = den > 0
        out[key]["ci"] = [float(v) for v in np.percentile(num[ok] / den[ok], q)] if ok.any() else None
        out[key]["n_resamples_used"] = int(ok.sum())
    if p["missed"] in (0, p["n"]):
        out["note"] = (f"{'none' if p['missed'] == 0 else 'all'} missed: the bootstrap CI collapses to the rate; "
                       f"exact {100 * (1 - alpha):g}% CI of the patient rate {p['ci_exact'][0]:.3f}-{p['ci_exact'][1]:.3f}")
    return out


def exact_ci(k: int, n: int, *, alpha: float = 0.05) -> list[float]:
    """Clopper-Pearson interval of k/n (scipy): patients are independent units, so at patient level
    the exact binomial interval is valid too; it bounds a rate the bootstrap cannot (0 or n of n)."""
    from scipy.stats import binomtest
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=1.0 - alpha, method="exact")
    return [float(ci.low), float(ci.high)]


def _point(n: int, missed: int) -> dict:
    return {"n": n, "missed": missed, "rate": missed / n if n else None, "ci": None}


def audit(y: np.ndarray, s: np.ndarray, patients: Sequence, labels: Sequence[str],
          thresholds: Mapping[str, float | None], fields: pd.DataFrame | None, *, age_edges: Sequence[int],
          min_count: int, n_resamples: int, seed: int, images: Sequence[str] | None = None) -> dict:
    """The underdiagnosis record: the definition, the findings the call and the truth use (and those
    without a threshold), the images set aside, the rates over all test images, per subgroup and per
    pairwise intersection (``fields`` None: no subgroups). ``images``: the images' names, for the record
    of those set aside."""
    y = np.asarray(y, float)
    patients = np.asarray(patients)
    thr = [thresholds.get(label) for label in labels]
    if all(t is None for t in thr):
        return {"definition": DEFINITION, "overall": None, "groups": [], "intersections": [],
                "labels_used": [], "labels_without_threshold": list(labels), "min_count": min_count,
                "note": "no finding has a validation-chosen threshold: nothing can be called"}
    used = np.array([t is not None for t in thr])
    positive = y == 1.0                                   # unknown (NaN) is not positive
    has_finding = positive[:, used].any(axis=1)
    set_aside = positive[:, ~used].any(axis=1) & ~has_finding
    missed = called_no_finding(np.asarray(s, float), thr)

    def cell(sel: np.ndarray, **names) -> dict:
        return {**names, **rates(has_finding[sel], missed[sel], patients[sel], min_count=min_count,
                                 n_resamples=n_resamples, seed=seed, set_aside=set_aside[sel])}

    out = {"definition": DEFINITION, "min_count": min_count, "n_resamples": n_resamples, "seed": seed,
           "labels_used": [lab for lab, t in zip(labels, thr) if t is not None],
           "labels_without_threshold": [lab for lab, t in zip(labels, thr) if t is None],
           "set_aside": _set_aside(set_aside, positive[:, ~used], patients, images,
                                   [lab for lab, t in zip(labels, thr) if t is None]),
           "overall": cell(np.ones(len(y), bool), attribute="all", group="all"), "groups": [], "intersections": []}
    if fields is None:
        return out
    order = {"sex": list(SEXES.values()), "age_band": age_band_names(age_edges), "view": list(VIEWS)}
    values = {a: fields[a].to_numpy() for a in ATTRIBUTES}
    for attr in ATTRIBUTES:
        out["groups"] += [cell(values[attr] == g, attribute=attr, group=g) for g in order[attr]]
    for a, b in combinations(ATTRIBUTES, 2):
        out["intersections"] += [cell((values[a] == ga) & (values[b] == gb), attribute=f"{a} x {b}",
                                      group=f"{ga}, {gb}") for ga in order[a] for gb in order[b]]
    return out


def _set_aside(mask: np.ndarray, unused_positive: np.ndarray, patients: np.ndarray, images: Sequence[str] | None,
               unused: list[str]) -> dict:
    """The images positive only for findings without a threshold: how many, of how many patients, per
    finding, and their names (when given)."""
    return {"why": "positive only for findings without a validation-chosen threshold, which the call cannot "
                   "flag: counted neither as with nor as without a finding",
            "n_images": int(mask.sum()), "n_patients": int(np.unique(patients[mask]).size),
            "by_finding": {lab: int((unused_positive[:, k] & mask).sum()) for k, lab in enumerate(unused)},
            "images": None if images is None else [str(images[i]) for i in np.flatnonzero(mask)]}


def table(record: dict) -> list[dict]:
    """The record as CSV rows (``underdiagnosis.csv``): one per cell, overall first."""
    cells = [record["overall"]] if record.get("overall") else []
    rows = []
    for kind, group in (("overall", cells), ("subgroup", record["groups"]), ("intersection", record["intersections"])):
        for c in group:
            row = {"kind": kind, "attribute": c["attribute"], "group": c["group"], "n_images": c["n_images"],
                   "n_patients": c["n_patients"], "images_set_aside": c["n_images_set_aside"]}
            for level in ("image", "patient"):
                e = c[level]
                row.update({f"{level}s_with_finding": e["n"], f"{level}s_missed": e["missed"],
                            f"{level}_rate": e["rate"], f"{level}_ci_low": (e["ci"] or [None, None])[0],
                            f"{level}_ci_high": (e["ci"] or [None, None])[1]})
            row.update(zip(("patient_exact_ci_low", "patient_exact_ci_high"), c["patient"].get("ci_exact") or [None, None]))
            rows.append({**row, "note": c["note"]})
    return rows


COLUMNS = ("kind", "attribute", "group", "n_images", "n_patients", "images_set_aside", "images_with_finding",
           "images_missed", "image_rate", "image_ci_low", "image_ci_high", "patients_with_finding", "patients_missed",
           "patient_rate", "patient_ci_low", "patient_ci_high", "patient_exact_ci_low", "patient_exact_ci_high", "note")
