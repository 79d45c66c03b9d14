"""Underdiagnosis by subgroup (chexflow.evaluate.underdiagnosis), an audit that can fail: the "no finding"
call chosen on validation by hand, a real gap between two groups found, a model that flags everything
not called fair, the small-count rule, images set aside, the CSV rows, and the patient bootstrap against
an independent resampling loop."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binomtest

from chexflow.evaluate import underdiagnosis as U

LABELS = ["A", "B", "C"]
THRESHOLDS = {"A": 0.5, "B": 0.4, "C": None}       # C: no validation threshold, out of the call
KW = {"age_edges": (18, 40, 60, 80), "n_resamples": 400, "seed": 0}


def test_the_call_is_chosen_on_validation_by_youden_on_the_highest_score():
    """Validation: 4 images with a finding (highest scores 0.9, 0.8, 0.7, 0.3) and 4 without (0.6, 0.5,
    0.1, 0.05). Youden's J: at 0.7, TPR 3/4 - FPR 0/4 = 0.75; at 0.3, 4/4 - 2/4 = 0.5; at 0.8, 2/4;
    so the threshold is 0.7: underdiagnosis 1/4 on validation, companion 4/4. C (no threshold) is
    not in the score: its 0.99 does not make the last image abnormal."""
    y = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], float)
    s = np.array([[0.9, 0.1, 0], [0.2, 0.8, 0], [0.7, 0.1, 0], [0.1, 0.3, 0], [0.6, 0.0, 0], [0.5, 0.5, 0],
                  [0.1, 0.0, 0.99], [0.05, 0.0, 0]])
    call = U.no_finding_operating_point(y, s, [f"p{i}" for i in range(8)], LABELS, THRESHOLDS)
    assert call["threshold"] == 0.7 and call["findings"] == ["A", "B"] and call["split"] == "validation"
    assert call["validation"] == {"images_with_finding": 4, "normal_images": 4, "patients_with_finding": 4,
                                  "normal_patients": 4, "underdiagnosis": 0.25, "companion": 1.0}
    none = U.no_finding_operating_point(y, s, list("abcdefgh"), LABELS, {})
    assert none["threshold"] is None and "no finding has a validation-chosen threshold" in none["note"]
    sick = U.no_finding_operating_point(y[:4], s[:4], list("abcd"), LABELS, THRESHOLDS)
    assert sick["threshold"] is None and "no normal image" in sick["note"]


def _two_groups(missed_female: int, missed_male: int, *, normal_called: float = 1.0, n: int = 10):
    """Per sex n patients with one image with finding A and n normal patients with one image. Scores: a
    finding image missed scores 0.2, a flagged one 0.9; a normal image called "no finding" 0.1, else 0.9."""
    y, s, sex = [], [], []
    for group, missed in (("female", missed_female), ("male", missed_male)):
        y += [[1, 0]] * n + [[0, 0]] * n
        s += [[0.2, 0.0]] * missed + [[0.9, 0.0]] * (n - missed)
        called = int(round(normal_called * n))
        s += [[0.1, 0.0]] * called + [[0.9, 0.0]] * (n - called)
        sex += [group] * 2 * n
    fields = pd.DataFrame({"sex": sex, "age_band": ["40-59"] * len(sex), "view": ["PA"] * len(sex)}, dtype=object)
    return np.array(y, float), np.array(s), np.array([f"p{i}" for i in range(len(sex))]), fields


CALL = {"threshold": 0.5, "findings": ["A", "B"]}


def test_a_real_gap_between_two_groups_is_found():
    """6 of 10 women with a finding called "no finding", 0 of 10 men, every normal image called "no
    finding" (companion 1.0): women "higher", men "lower". On paper: rates 0.6 and 0.0; the women's
    exact interval is Clopper-Pearson of 6/10, the men's 0 of 10 patients: [0, 1 - 0.025 ** (1/10)]."""
    y, s, patients, fields = _two_groups(6, 0)
    rec = U.audit(y, s, patients, ["A", "B"], CALL, fields, min_patients=5, **KW)
    assert rec["detectable"] and rec["overall"]["companion"]["rate"] == 1.0
    assert rec["overall"]["image"]["rate"] == 0.3 and "enough for the audit" in rec["verdict"]
    g = {c["group"]: c for c in rec["groups"] if c["attribute"] == "sex"}
    f, m = g["female"], g["male"]
    assert (f["image"]["missed"], f["image"]["n"], m["image"]["missed"]) == (6, 10, 0)
    assert f["patient"]["ci"] == pytest.approx(list(binomtest(6, 10).proportion_ci(method="exact")))
    assert m["image"]["ci"] == pytest.approx([0.0, 1 - 0.025 ** 0.1]) and m["image"]["interval"].startswith("exact")
    assert f["verdict"] == "higher" and m["verdict"] == "lower"
    assert f["gap"] == pytest.approx(0.6) and f["gap_ci"][0] > 0 and f["verdict_text"].startswith(
        "more underdiagnosis than the rest of its attribute (0.600 against 0.000")
    assert f["verdict_text"].endswith("; unit: images with a finding, resampled by patient; 10 patients with a "
                                      "finding in the group, 10 in the rest)")
    same = U.audit(*_two_groups(3, 3)[:3], ["A", "B"], CALL, _two_groups(3, 3)[3], min_patients=5, **KW)
    assert [c["verdict"] for c in same["groups"] if c["attribute"] == "sex"] == ["no gap shown"] * 2


def test_a_model_that_flags_everything_is_not_called_fair():
    """Every image scored 0.99 on validation and test: the call chosen on validation (Youden's J over a
    constant score: the threshold 0.99, J = 0) names nothing "no finding"; underdiagnosis 0 everywhere,
    and the verdict says the audit cannot detect underdiagnosis, never "no gap"."""
    y, _, patients, fields = _two_groups(6, 0)
    flags = np.full_like(y, 0.99)
    call = U.no_finding_operating_point(y, flags, patients, ["A", "B"], {"A": 0.5, "B": 0.5})
    rec = U.audit(y, flags, patients, ["A", "B"], call, fields, min_patients=5, **KW)
    assert rec["overall"]["image"]["rate"] == 0.0 and rec["overall"]["companion"]["rate"] == 0.0
    assert rec["detectable"] is False and "cannot detect underdiagnosis at this operating point" in rec["verdict"]
    assert {c["verdict"] for c in rec["groups"] if c["attribute"] == "sex"} == {"cannot detect"}
    # a call that names 1 of 20 normal images "no finding" in a group (0.05 < 0.10) is no better
    y, s, patients, fields = _two_groups(6, 0, normal_called=0.05, n=20)
    rec = U.audit(y, s, patients, ["A", "B"], CALL, fields, min_patients=5, **KW)
    assert not rec["detectable"] and rec["overall"]["companion"]["k"] == 2
    assert all(c["verdict"] == "cannot detect" for c in rec["groups"] if c["attribute"] == "sex")


def test_below_the_minimum_of_patients_a_cell_is_too_few_with_its_counts():
    """3 patients with a finding per sex, minimum 5: no interval, no verdict, the counts said."""
    y, s, patients, fields = _two_groups(2, 0, n=3)
    rec = U.audit(y, s, patients, ["A", "B"], CALL, fields, min_patients=5, **KW)
    f = next(c for c in rec["groups"] if c["group"] == "female")
    assert f["note"] == "too few: 3 with a finding / 3 normal patients (5 of each needed)"
    assert f["verdict"] == "too few" and f["gap_ci"] is None
    assert f["image"]["ci"] is None and f["patient"]["ci"] is None and f["companion"]["ci"] is None
    assert f["image"]["too_few"] == f["patient"]["too_few"] == f["companion"]["too_few"] == "too few"
    assert (f["image"]["missed"], f["image"]["n"]) == (2, 3)
    assert rec["overall"]["image"]["ci"] is not None          # 6 and 6 patients overall: enough


def test_an_image_positive_only_for_a_finding_without_a_threshold_is_set_aside_not_missed():
    """5 images positive for A (scored 0.9) and 5 positive only for H (not in the call, scored 0.99): the
    call cannot be asked about H, so those 5 are set aside, neither with a finding nor normal."""
    y = np.array([[1, 0]] * 5 + [[0, 1]] * 5 + [[0, 0]] * 2, float)
    s = np.array([[0.9, 0.0]] * 5 + [[0.0, 0.99]] * 5 + [[0.1, 0.0]] * 2)
    patients = np.array([f"p{k}" for k in range(12)])
    images = [f"i{k}.png" for k in range(12)]
    call = {"threshold": 0.5, "findings": ["A"]}
    rec = U.audit(y, s, patients, ["A", "H"], call, None, min_patients=2, images=images, **KW)
    o = rec["overall"]
    assert (o["image"]["n"], o["image"]["missed"], o["companion"]["n"], o["companion"]["k"]) == (5, 0, 2, 2)
    assert o["n_images_set_aside"] == 5 and o["n_images"] == 12 and rec["labels_without_threshold"] == ["H"]
    aside = rec["set_aside"]
    assert (aside["n_images"], aside["n_patients"], aside["by_finding"], aside["images"]) == (5, 5, {"H": 5}, images[5:10])
    row = U.table(rec)[0]
    assert list(row) == list(U.COLUMNS) and (row["images_set_aside"], row["companion_rate"]) == (5, 1.0)


def test_without_a_call_or_fields():
    y, s, patients, fields = _two_groups(6, 0)
    no_call = {"rule": U.RULE, "split": "validation", "findings": [], "threshold": None, "note": "no call"}
    rec = U.audit(y, s, patients, ["A", "B"], no_call, fields, min_patients=5, **KW)
    assert rec["overall"] is None and rec["note"] == "no call" and U.table(rec) == []
    from chexflow.report import templating                 # the report renders a record without a call
    html = templating.environment().get_template("_underdiagnosis.html.j2").render(underdiagnosis=rec)
    assert "<p class=\"note\">no call</p>" in html
    rec = U.audit(y, s, patients, ["A", "B"], CALL, None, min_patients=5, **KW)
    assert rec["overall"]["image"]["rate"] == 0.3 and rec["groups"] == [] and rec["intersections"] == []


def test_patient_bootstrap_ci_matches_an_independent_resampling_loop():
    """200 patients of 1-4 images: the image-level CI against a plain loop that draws patients with
    replacement (another random stream: agreement within Monte Carlo error)."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 5, 200)
    patients = np.repeat([f"p{k:03d}" for k in range(200)], sizes)
    y = (rng.random((patients.size, 2)) < 0.35).astype(float)
    s = rng.random((patients.size, 2))
    rec = U.audit(y, s, patients, ["A", "B"], {"threshold": 0.7, "findings": ["A", "B"]}, None, min_patients=5,
                  age_edges=(18,), n_resamples=4000, seed=1)["overall"]
    has, missed = y.max(axis=1) == 1, s.max(axis=1) < 0.7
    by = {p: np.flatnonzero(patients == p) for p in np.unique(patients)}
    ids = list(by)
    img = []
    for draw in rng.integers(0, len(ids), size=(4000, len(ids))):
        idx = np.concatenate([by[ids[k]] for k in draw])
        img.append((has[idx] & missed[idx]).sum() / has[idx].sum())
    assert rec["image"]["rate"] == pytest.approx((has & missed).sum() / has.sum())
    assert rec["image"]["ci"] == pytest.approx(np.percentile(img, [2.5, 97.5]), abs=0.01)
    assert rec["image"]["interval"] == "patient bootstrap" and rec["image"]["n_resamples_dropped"] == 0


def test_the_report_renders_the_verdicts_and_refuses_a_malformed_record():
    from chexflow.report import analyses
    from chexflow.report.errors import ReportInputError
    y, s, patients, fields = _two_groups(6, 0)
    rec = U.audit(y, s, patients, ["A", "B"], CALL, fields, min_patients=5, **KW)
    view = analyses.underdiagnosis_view({"underdiagnosis": rec})
    assert view["overall"]["image"]["rate"] == 0.3 and view["groups"][0]["attribute_name"] == "Sex"
    said = analyses.limitations({"localisation": None, "subgroups": None, "underdiagnosis": view})
    assert said == ["Underdiagnosis higher than in the rest of the attribute (95% CI of the difference above 0): "
                    "sex female."]
    assert view["n_intersections_left_out"] == sum(c["too_few"] is not None for c in rec["intersections"])
    del rec["groups"][1]["companion"]
    with pytest.raises(ReportInputError, match=r"metrics.json: underdiagnosis.groups\[1\] must be an object"):
        analyses.underdiagnosis_view({"underdiagnosis": rec})
