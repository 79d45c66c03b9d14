"""Underdiagnosis by subgroup (chexflow.evaluate.underdiagnosis): the rates of a hand-computed case at
image and patient level, per subgroup and intersection, the CSV rows, and the patient-bootstrap CI
against an independent resampling loop."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binomtest

from chexflow.evaluate import underdiagnosis as U

LABELS = ["A", "B", "C"]
THRESHOLDS = {"A": 0.5, "B": 0.4, "C": None}       # C: no validation threshold, out of the call


def _case():
    """7 images of 5 patients (the comments give the call: every thresholded score below -> "no finding")."""
    y = np.array([[1, 0, 0],     # p1 i0: A, scores below both thresholds -> missed
                  [1, 0, 0],     # p1 i1: A, A 0.7 >= 0.5 -> flagged
                  [0, 1, 0],     # p2 i2: B, B 0.3 < 0.4 -> missed
                  [0, 0, 0],     # p2 i3: no finding
                  [0, 0, 0],     # p3 i4: no finding (flagged: not counted)
                  [1, 1, 0],     # p4 i5: flagged
                  [0, 1, 1]],    # p5 i6: B 0.45 -> flagged
                 float)
    s = np.array([[0.2, 0.1, 0.99], [0.7, 0.1, 0.0], [0.1, 0.3, 0.0], [0.1, 0.1, 0.0], [0.9, 0.0, 0.0],
                  [0.6, 0.6, 0.0], [0.1, 0.45, 0.0]])
    patients = np.array(["p1", "p1", "p2", "p2", "p3", "p4", "p5"])
    fields = pd.DataFrame({"sex": ["female"] * 4 + ["male"] * 3, "age_band": ["40-59"] * 7,
                           "view": ["PA", "AP", "PA", "PA", "AP", "PA", "PA"]}, dtype=object)
    return y, s, patients, fields


def test_rates_by_hand_at_image_and_patient_level():
    y, s, patients, fields = _case()
    assert U.called_no_finding(s, [0.5, 0.4, None]).tolist() == [True, False, True, True, False, False, False]
    rec = U.audit(y, s, patients, LABELS, THRESHOLDS, fields, age_edges=(18, 40, 60, 80), min_count=2,
                  n_resamples=200, seed=0)
    assert rec["labels_used"] == ["A", "B"] and rec["labels_without_threshold"] == ["C"]
    o = rec["overall"]
    # images with a finding: i0 i1 i2 i5 i6; called "no finding": i0, i2
    assert (o["image"]["n"], o["image"]["missed"], o["image"]["rate"]) == (5, 2, 0.4)
    # patients with a finding: p1 p2 p4 p5; every finding image called "no finding": p2 only (p1's i1 is flagged)
    assert (o["patient"]["n"], o["patient"]["missed"], o["patient"]["rate"]) == (4, 1, 0.25)
    assert (o["n_images"], o["n_patients"]) == (7, 5)
    groups = {(g["attribute"], g["group"]): g for g in rec["groups"]}
    female, male = groups[("sex", "female")], groups[("sex", "male")]
    assert (female["image"]["missed"], female["image"]["n"], female["patient"]["missed"], female["patient"]["n"]) \
        == (2, 3, 1, 2)
    assert (male["image"]["rate"], male["patient"]["rate"]) == (0.0, 0.0)
    # none missed: the bootstrap collapses at 0; the exact interval bounds it (Clopper-Pearson, 0 of 2: 1 - 0.025 ** 0.5)
    assert male["patient"]["ci"] == [0.0, 0.0] and male["patient"]["ci_exact"] == pytest.approx([0.0, 1 - 0.025 ** 0.5])
    assert male["note"].startswith("none missed: the bootstrap CI collapses to the rate; exact 95% CI of the patient "
                                   "rate 0.000-0.842")
    assert o["patient"]["ci_exact"] == pytest.approx(
        list(binomtest(1, 4).proportion_ci(confidence_level=0.95, method="exact")))
    assert female["image"]["ci"] is not None and female["note"] == ""      # 1 of 2 patients missed
    # a cell's patient level is over its own images: female x AP holds only p1's flagged i1
    inter = {(c["attribute"], c["group"]): c for c in rec["intersections"]}
    fap = inter[("sex x view", "female, AP")]
    assert (fap["image"]["n"], fap["image"]["missed"], fap["patient"]["n"], fap["patient"]["missed"]) == (1, 0, 1, 0)
    assert fap["image"]["ci"] is None and fap["note"] == "too few patients with a finding for a CI (1, 2 needed)"
    fpa = inter[("sex x view", "female, PA")]          # p1's i0 (missed) and p2's i2 (missed): both patients missed
    assert (fpa["patient"]["n"], fpa["patient"]["missed"], fpa["image"]["rate"]) == (2, 2, 1.0)
    assert len(rec["intersections"]) == 2 * 5 + 2 * 2 + 5 * 2
    rows = U.table(rec)
    assert [r["kind"] for r in rows[:2]] == ["overall", "subgroup"] and len(rows) == 1 + len(rec["groups"]) + 24
    assert rows[0]["image_rate"] == 0.4 and rows[0]["patients_missed"] == 1 and list(rows[0]) == list(U.COLUMNS)


def test_an_image_positive_only_for_a_finding_without_a_threshold_is_set_aside_not_missed():
    """The issue's case: 5 images positive for A (scored 0.9, threshold 0.5) and 5 positive only for H
    (no threshold, scored 0.99): the call cannot flag H, so those 5 are set aside; the rate is 0 of 5,
    not 5 of 10."""
    y = np.array([[1, 0]] * 5 + [[0, 1]] * 5, float)
    s = np.array([[0.9, 0.0]] * 5 + [[0.0, 0.99]] * 5)
    patients = np.array([f"p{k}" for k in range(10)])
    images = [f"i{k}.png" for k in range(10)]
    rec = U.audit(y, s, patients, ["A", "H"], {"A": 0.5, "H": None}, None, age_edges=(18,), min_count=2,
                  n_resamples=50, seed=0, images=images)
    o = rec["overall"]
    assert (o["image"]["n"], o["image"]["missed"], o["image"]["rate"]) == (5, 0, 0.0)
    assert (o["patient"]["n"], o["patient"]["missed"], o["patient"]["rate"]) == (5, 0, 0.0)
    assert o["n_images_set_aside"] == 5 and o["n_images"] == 10
    aside = rec["set_aside"]
    assert (aside["n_images"], aside["n_patients"], aside["by_finding"]) == (5, 5, {"H": 5})
    assert aside["images"] == images[5:] and "without a validation-chosen threshold" in aside["why"]
    assert U.table(rec)[0]["images_set_aside"] == 5
    # an image positive for A and H is not set aside: A is called (here flagged); unknown labels are not positive
    y2 = np.vstack([y, [[1, 1], [np.nan, 1], [0, np.nan]]])
    s2 = np.vstack([s, [[0.1, 0.0], [0.9, 0.0], [0.0, 0.0]]])
    rec = U.audit(y2, s2, np.append(patients, ["p10", "p11", "p12"]), ["A", "H"], {"A": 0.5, "H": None}, None,
                  age_edges=(18,), min_count=2, n_resamples=50, seed=0)
    assert (rec["overall"]["image"]["n"], rec["overall"]["image"]["missed"]) == (6, 1)
    assert rec["set_aside"]["n_images"] == 6 and rec["set_aside"]["images"] is None


def test_every_cell_has_the_exact_interval_of_its_patient_rate():
    """Below min_count the bootstrap CI is left out, the Clopper-Pearson interval is not (scipy's
    binomtest); a cell without a patient with a finding has none."""
    y, s, patients, fields = _case()
    rec = U.audit(y, s, patients, LABELS, THRESHOLDS, fields, age_edges=(18, 40, 60, 80), min_count=3,
                  n_resamples=50, seed=0)
    for c in [rec["overall"], *rec["groups"], *rec["intersections"]]:
        k, n = c["patient"]["missed"], c["patient"]["n"]
        expected = list(binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")) if n else None
        assert c["patient"]["ci_exact"] == (pytest.approx(expected) if n else None), c
    groups = {(g["attribute"], g["group"]): g for g in rec["groups"]}
    female = groups[("sex", "female")]          # 1 of 2 patients missed, below min_count 3
    assert female["patient"]["ci"] is None and female["note"].startswith("too few patients")
    assert female["patient"]["ci_exact"] == pytest.approx([0.0126, 0.9874], abs=1e-4)
    row = next(r for r in U.table(rec) if r["group"] == "female")
    assert row["patient_exact_ci_low"] == pytest.approx(0.0126, abs=1e-4)


def test_without_thresholds_or_fields():
    y, s, patients, _ = _case()
    rec = U.audit(y, s, patients, LABELS, {}, None, age_edges=(18,), min_count=2, n_resamples=10, seed=0)
    assert rec["overall"] is None and "no finding has a validation-chosen threshold" in rec["note"]
    assert U.table(rec) == []
    rec = U.audit(y, s, patients, LABELS, THRESHOLDS, None, age_edges=(18,), min_count=2, n_resamples=10, seed=0)
    assert rec["overall"]["image"]["rate"] == 0.4 and rec["groups"] == [] and rec["intersections"] == []


def test_patient_bootstrap_ci_matches_an_independent_resampling_loop():
    """200 patients of 1-4 images: the CI against a plain loop that draws patients with replacement
    (another random stream: agreement within Monte Carlo error)."""
    rng = np.random.default_rng(5)
    n_pat = 200
    sizes = rng.integers(1, 5, n_pat)
    patients = np.repeat([f"p{k:03d}" for k in range(n_pat)], sizes)
    n = patients.size
    y = (rng.random((n, 2)) < 0.35).astype(float)
    s = rng.random((n, 2))
    thresholds = {"A": 0.6, "B": 0.7}
    rec = U.audit(y, s, patients, ["A", "B"], thresholds, None, age_edges=(18,), min_count=5, n_resamples=4000,
                  seed=1)["overall"]
    has, missed = y.max(axis=1) == 1, (s[:, 0] < 0.6) & (s[:, 1] < 0.7)
    by = {p: np.flatnonzero(patients == p) for p in np.unique(patients)}
    ids = list(by)
    loop = rng.integers(0, len(ids), size=(4000, len(ids)))
    img, pat = [], []
    for draw in loop:
        idx = np.concatenate([by[ids[k]] for k in draw])
        img.append((has[idx] & missed[idx]).sum() / has[idx].sum())
        per = [(has[by[ids[k]]].any(), (has[by[ids[k]]] & ~missed[by[ids[k]]]).sum() == 0) for k in draw]
        pat.append(sum(h and m for h, m in per) / sum(h for h, _ in per))
    assert rec["image"]["rate"] == pytest.approx((has & missed).sum() / has.sum())
    assert rec["image"]["ci"] == pytest.approx(np.percentile(img, [2.5, 97.5]), abs=0.01)
    assert rec["patient"]["ci"] == pytest.approx(np.percentile(pat, [2.5, 97.5]), abs=0.01)


def test_the_report_refuses_a_malformed_record_naming_the_key():
    from chexflow.report import analyses
    from chexflow.report.errors import ReportInputError
    y, s, patients, fields = _case()
    rec = U.audit(y, s, patients, LABELS, THRESHOLDS, fields, age_edges=(18, 40, 60, 80), min_count=2,
                  n_resamples=20, seed=0)
    view = analyses.underdiagnosis_view({"underdiagnosis": rec})
    assert view["overall"]["image"]["rate"] == 0.4 and view["groups"][0]["attribute_name"] == "Sex"
    assert view["n_intersections_left_out"] == sum(c["patient"]["ci"] is None for c in rec["intersections"])
    del rec["groups"][2]["patient"]["missed"]
    with pytest.raises(ReportInputError, match=r"metrics.json: underdiagnosis.groups\[2\] must be an object"):
        analyses.underdiagnosis_view({"underdiagnosis": rec})
    with pytest.raises(ReportInputError, match=r"localisation.labels\['Mass'\] must be an object"):
        analyses.localisation_view({"localisation": {"labels": {"Mass": {"n": 3, "hits": 1}}}, "labels": {}}, None, [])
