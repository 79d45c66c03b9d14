"""Underdiagnosis by subgroup, as radiology fairness audits define it (Seyyed-Kalantari et al., Nature
Medicine 2021): the false-positive rate of the "no finding" call at an operating point chosen on
validation, beside its companion rate, built so that it can fail.

The call (:func:`no_finding_operating_point`), the truth it is measured against, the rates of each cell
(:func:`rates`) and the verdicts (:func:`audit`): docs/evaluation.md, "Underdiagnosis". Intersections get
their rates, not a verdict: each would be one more comparison on fewer patients.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any

import numpy as np
import pandas as pd

from chexflow.evaluate import intervals
from chexflow.evaluate.metrics import percentile_ci, youden_threshold
from chexflow.evaluate.subgroups import SEXES, VIEWS, age_band_names

ATTRIBUTES = ("sex", "age_band", "view")
# below this share of normal images called "no finding", the call flags (nearly) every image: the
# underdiagnosis rates of all groups are squeezed towards 0 and no gap can show (the demo's old call: 1 of 222)
MIN_COMPANION = 0.10
RULE = ("abnormality score: an image's highest score over the findings with a validation-chosen threshold; "
        "\"no finding\" below the call's threshold, chosen on validation by Youden's J (has a finding against has none)")
DEFINITION = ("an image is called \"no finding\" when its highest finding score lies below the validation-chosen "
              "threshold of the call; it has a finding when one of those findings is labelled on it, none when none is "
              "(an image positive only for findings without a threshold is set aside); underdiagnosis: of the images "
              "(patients) with a finding, the share called \"no finding\" (every such image of the patient); companion "
              "rate: of the normal images, the share called \"no finding\"")


def _used(labels: Sequence[str], thresholds: Mapping[str, float | None]) -> np.ndarray:
    return np.array([thresholds.get(lab) is not None for lab in labels])


def abnormality(scores: np.ndarray, used: np.ndarray) -> np.ndarray:
    """Per image: the highest score over the findings ``used`` (a bool mask over the columns)."""
    return np.asarray(scores, float)[:, used].max(axis=1)


def no_finding_operating_point(val_y: np.ndarray, val_s: np.ndarray, val_patients: Sequence[Any],
                               labels: Sequence[str], thresholds: Mapping[str, float | None]) -> dict[str, Any]:
    """The "no finding" call's operating point, chosen on the validation predictions (``val_y`` [N, L] with
    NaN unknown, ``val_s`` [N, L]): the findings it uses (those with a validation threshold in
    ``thresholds``), its threshold on the abnormality score, and what it does on validation. ``threshold``
    is None (with ``note``) when validation holds no normal image or none with a finding."""
    used = _used(labels, thresholds)
    out: dict[str, Any] = {"rule": RULE, "split": "validation", "findings": [lab for lab, u in zip(labels, used) if u],
                           "threshold": None, "note": ""}
    if not used.any():
        return {**out, "note": "no finding has a validation-chosen threshold: nothing can be called"}
    y = np.asarray(val_y, float)
    has = (y[:, used] == 1.0).any(axis=1)
    aside = (y[:, ~used] == 1.0).any(axis=1) & ~has
    keep = ~aside
    score, patients = abnormality(val_s, used)[keep], np.asarray(val_patients)[keep]
    out["validation"] = {"images_with_finding": int(has[keep].sum()), "normal_images": int((~has[keep]).sum()),
                         "patients_with_finding": int(np.unique(patients[has[keep]]).size),
                         "normal_patients": int(np.unique(patients[~has[keep]]).size)}
    if has[keep].all() or not has[keep].any():
        return {**out, "note": "validation holds no normal image or none with a finding: no call can be chosen"}
    thr = youden_threshold(has[keep].astype(float), score)
    called = score < thr
    out["threshold"] = thr
    out["validation"].update(underdiagnosis=float(called[has[keep]].mean()), companion=float(called[~has[keep]].mean()))
    return out


def _patient_level(cond: np.ndarray, called: np.ndarray, patients: np.ndarray, *, alpha: float) -> dict[str, Any]:
    """Of the patients with a ``cond`` image, those whose every ``cond`` image is ``called``: k, n, rate, exact CI."""
    _, pidx = np.unique(patients, return_inverse=True)
    n_pat = int(pidx.max()) + 1 if pidx.size else 0
    has = np.bincount(pidx, weights=cond.astype(float), minlength=n_pat) > 0
    kept = np.bincount(pidx, weights=(cond & ~called).astype(float), minlength=n_pat) == 0
    n, k = int(has.sum()), int((has & kept).sum())
    return {"n": n, "missed": k, "rate": k / n if n else None,
            "ci": intervals.exact_ci(k, n, alpha=alpha) if n else None, "interval": "exact (Clopper-Pearson)",
            "too_few": None}


def _image_level(cond: np.ndarray, called: np.ndarray, patients: np.ndarray, **kw: Any) -> dict[str, Any]:
    r = intervals.rate(called, cond, patients, **kw)
    return {**r, "missed": r["k"]}


def rates(has_finding: np.ndarray, normal: np.ndarray, called: np.ndarray, patients: np.ndarray, *, min_patients: int,
          n_resamples: int, seed: int, alpha: float = 0.05) -> dict[str, Any]:
    """One cell: ``image`` and ``patient`` underdiagnosis, the ``companion`` rate (docs/evaluation.md), the
    cell's images and patients, and ``note`` (the small-count rule's words, where it applies)."""
    patients = np.asarray(patients)
    kw = {"minimum": min_patients, "n_resamples": n_resamples, "seed": seed, "alpha": alpha}
    out = {"n_images": int(patients.size), "n_patients": int(np.unique(patients).size),
           "image": _image_level(has_finding, called, patients, **kw),
           "patient": _patient_level(has_finding, called, patients, alpha=alpha),
           "companion": _image_level(normal, called, patients, **kw)}
    out["too_few"] = intervals.too_few(int(np.unique(patients[has_finding]).size),
                                       int(np.unique(patients[normal]).size), min_patients)
    if out["too_few"]:
        for level in ("image", "patient", "companion"):     # the rule withholds every interval of the cell
            out[level].update(ci=None, interval=None, too_few="too few")
        out["note"] = out["too_few"].replace("positive", "with a finding").replace("negative", "normal")
    else:
        out["note"] = ""
    return out


def audit(y: np.ndarray, s: np.ndarray, patients: Sequence, labels: Sequence[str], call: Mapping[str, Any],
          fields: pd.DataFrame | None, *, age_edges: Sequence[int], min_patients: int, n_resamples: int, seed: int,
          images: Sequence[str] | None = None, alpha: float = 0.05) -> dict[str, Any]:
    """The underdiagnosis record of test predictions ``y``/``s`` [N, L] at the call ``call`` (from
    :func:`no_finding_operating_point` on validation): the definition, the call, the images set aside,
    the cells over all test images, per subgroup (with its verdict) and per pairwise intersection
    (``fields`` None: no subgroups), and ``detectable`` with its words. ``images``: the images' names,
    for the record of those set aside. Another test set (an external one) is audited by passing its own
    predictions with the internal call."""
    base = {"definition": DEFINITION, "call": dict(call), "min_patients": min_patients, "min_companion": MIN_COMPANION,
            "n_resamples": n_resamples, "seed": seed, "groups": [], "intersections": []}
    used = np.array([lab in call.get("findings", ()) for lab in labels])
    if call.get("threshold") is None:
        return {**base, "overall": None, "detectable": None, "verdict": None, "labels_used": [], "set_aside": None,
                "labels_without_threshold": list(labels), "note": call.get("note") or "no call was chosen"}
    y, s, patients = np.asarray(y, float), np.asarray(s, float), np.asarray(patients)
    positive = y == 1.0                                   # unknown (NaN) is not positive
    has = positive[:, used].any(axis=1)
    aside = positive[:, ~used].any(axis=1) & ~has
    normal = ~has & ~aside
    called = abnormality(s, used) < call["threshold"]

    def cell(sel: np.ndarray, **names: str) -> dict:
        return {**names, **rates(has[sel], normal[sel], called[sel], patients[sel], min_patients=min_patients,
                                 n_resamples=n_resamples, seed=seed, alpha=alpha),
                "n_images_set_aside": int(aside[sel].sum())}

    unused = [lab for lab, u in zip(labels, used) if not u]
    out = {**base, "labels_used": [lab for lab, u in zip(labels, used) if u], "labels_without_threshold": unused,
           "set_aside": _set_aside(aside, positive[:, ~used], patients, images, unused),
           "overall": cell(np.ones(len(y), bool), attribute="all", group="all")}
    comp = out["overall"]["companion"]
    out["detectable"] = comp["rate"] is not None and comp["rate"] >= MIN_COMPANION
    out["verdict"] = (f"the call names {comp['k']} of {comp['n']} normal test images \"no finding\" ({comp['rate']:.3f}); "
                      + ("enough for the audit to show a gap" if out["detectable"] else
                         f"below {MIN_COMPANION:g}: the audit cannot detect underdiagnosis at this operating point")
                      if comp["n"] else "no normal test image: the audit cannot detect underdiagnosis")
    if fields is None:
        return out
    order = {"sex": list(SEXES.values()), "age_band": age_band_names(age_edges), "view": list(VIEWS)}
    values = {a: fields[a].to_numpy() for a in ATTRIBUTES}
    w = intervals.weights(patients, n_resamples, seed)       # one draw of the test set's patients for every gap
    for attr in ATTRIBUTES:
        known = np.isin(values[attr], order[attr])
        for g in order[attr]:
            sel = values[attr] == g
            c = cell(sel, attribute=attr, group=g)
            c.update(_gap(c, sel, known & ~sel, has, normal, called, patients, w, out["detectable"], min_patients,
                          alpha))
            out["groups"].append(c)
    for a, b in combinations(ATTRIBUTES, 2):
        out["intersections"] += [cell((values[a] == ga) & (values[b] == gb), attribute=f"{a} x {b}",
                                      group=f"{ga}, {gb}") for ga in order[a] for gb in order[b]]
    return out


def _gap(c: dict, sel: np.ndarray, rest: np.ndarray, has: np.ndarray, normal: np.ndarray, called: np.ndarray,
         patients: np.ndarray, w: np.ndarray, detectable: bool, min_patients: int, alpha: float) -> dict[str, Any]:
    """A subgroup's verdict against the rest of its attribute (docs/evaluation.md, "Underdiagnosis")."""
    rest_few = intervals.too_few(int(np.unique(patients[rest & has]).size), int(np.unique(patients[rest & normal]).size),
                                 min_patients)
    gap: dict[str, Any] = {"gap": None, "gap_ci": None, "gap_resamples_dropped": None}
    if c["too_few"] or rest_few:
        return {**gap, "verdict": "too few", "verdict_text": f"{c['note'] or 'the rest: ' + rest_few}: not compared"}
    comp = c["companion"]
    if not detectable or comp["rate"] < MIN_COMPANION:
        return {**gap, "verdict": "cannot detect",
                "verdict_text": f"cannot detect underdiagnosis at this operating point: {comp['k']} of {comp['n']} normal "
                                f"images called \"no finding\" ({'in the group' if detectable else 'over the test set'}"
                                f", below {MIN_COMPANION:g})"}
    rest_rate = float((called & has & rest).sum() / (has & rest).sum())
    num = lambda m: w @ (called & has & m).astype(float)                           # noqa: E731
    den = lambda m: w @ (has & m).astype(float)                                    # noqa: E731
    ok = (den(sel) > 0) & (den(rest) > 0)
    diff = np.where(ok, num(sel) / np.where(ok, den(sel), 1) - num(rest) / np.where(ok, den(rest), 1), np.nan)
    ci = percentile_ci(diff, alpha) if np.nanmax(diff) > np.nanmin(diff) else None
    gap.update(gap=c["image"]["rate"] - rest_rate, gap_ci=ci, gap_resamples_dropped=int((~ok).sum()),
               rest_rate=rest_rate)
    if ci is None:
        verdict, why = "no gap shown", "every resample gives the same rates in the group and the rest"
    elif ci[0] > 0 or ci[1] < 0:
        verdict = "higher" if ci[0] > 0 else "lower"
        why = f"95% patient-bootstrap CI of the difference {ci[0]:+.3f} to {ci[1]:+.3f} excludes 0"
    else:
        verdict, why = "no gap shown", f"95% patient-bootstrap CI of the difference {ci[0]:+.3f} to {ci[1]:+.3f} includes 0"
    words = {"higher": "more underdiagnosis than", "lower": "less underdiagnosis than", "no gap shown": "no gap to"}
    rests_on = (f"unit: images with a finding, resampled by patient; {c['patient']['n']} patients with a finding in "
                f"the group, {int(np.unique(patients[rest & has]).size)} in the rest")
    return {**gap, "verdict": verdict,
            "verdict_text": f"{words[verdict]} the rest of its attribute ({c['image']['rate']:.3f} against "
                            f"{rest_rate:.3f} of images with a finding called \"no finding\"; {why}; {rests_on})"}


def _set_aside(mask: np.ndarray, unused_positive: np.ndarray, patients: np.ndarray, images: Sequence[str] | None,
               unused: list[str]) -> dict:
    """The images positive only for findings without a threshold: how many, of how many patients, per
    finding, and their names (when given)."""
    return {"why": "positive only for findings without a validation-chosen threshold, which the call does not use: "
                   "counted neither as with nor as without a finding",
            "n_images": int(mask.sum()), "n_patients": int(np.unique(patients[mask]).size),
            "by_finding": {lab: int((unused_positive[:, k] & mask).sum()) for k, lab in enumerate(unused)},
            "images": None if images is None else [str(images[i]) for i in np.flatnonzero(mask)]}


def _ci_pair(e: dict) -> list:
    return list(e.get("ci") or [None, None])


def table(record: dict) -> list[dict]:
    """The record as CSV rows (``underdiagnosis.csv``): one per cell, overall first."""
    cells = [record["overall"]] if record.get("overall") else []
    rows = []
    for kind, group in (("overall", cells), ("subgroup", record["groups"]), ("intersection", record["intersections"])):
        for c in group:
            img, pat, comp = c["image"], c["patient"], c["companion"]
            rows.append(dict(zip(COLUMNS, (
                kind, c["attribute"], c["group"], c["n_images"], c["n_patients"], c["n_images_set_aside"],
                img["n"], img["missed"], img["rate"], *_ci_pair(img), img["interval"],
                pat["n"], pat["missed"], pat["rate"], *_ci_pair(pat),
                comp["n"], comp["k"], comp["rate"], *_ci_pair(comp), comp["interval"],
                c.get("verdict"), c.get("gap"), *(c.get("gap_ci") or [None, None]), c["note"]))))
    return rows


COLUMNS = ("kind", "attribute", "group", "n_images", "n_patients", "images_set_aside", "images_with_finding",
           "images_missed", "image_rate", "image_ci_low", "image_ci_high", "image_interval", "patients_with_finding",
           "patients_missed", "patient_rate", "patient_exact_ci_low", "patient_exact_ci_high", "normal_images",
           "normal_called_no_finding", "companion_rate", "companion_ci_low", "companion_ci_high", "companion_interval",
           "verdict", "gap", "gap_ci_low", "gap_ci_high", "note")
