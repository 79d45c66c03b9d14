"""The external validation's statistic (``metrics.independent_bootstrap_auroc_diff``): the AUROC drop
between two test sets that share no patient, each resampled by patient on its own. Checked against
cases worked out on paper, against each set's own bootstrap, and against scipy's bootstrap of two
independent samples. And unknown labels (NaN) through every statistic of the evaluation."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from sklearn.metrics import roc_auc_score

from chexflow.evaluate.metrics import bootstrap_auroc, independent_bootstrap_auroc_diff


def _set(y, s, patients=None):
    y = np.asarray(y, float).reshape(-1, 1)
    s = np.asarray(s, float).reshape(-1, 1)
    return y, s, np.asarray(patients if patients is not None else [f"p{i}" for i in range(len(y))])


def test_separable_minus_uninformative_is_one_half_in_every_resample():
    """A: every positive scores above every negative (AUROC 1 in any resample holding both classes); B:
    every score tied (AUROC 0.5 in any such resample). Each defined resample's drop is 0.5: so are the
    point and both ends of the CI."""
    a = _set([1, 1, 0, 0, 1, 0], [0.9, 0.8, 0.1, 0.2, 0.7, 0.3])
    b = _set([1, 0, 1, 0, 0], [0.5] * 5)
    out = independent_bootstrap_auroc_diff(a, b, ["F"], n_resamples=300, seed=4)
    e = out["labels"]["F"]
    assert (e["a"], e["b"], e["diff"]) == (1.0, 0.5, 0.5)
    assert e["ci"] == [0.5, 0.5] and e["a_ci"] == [1.0, 1.0] and e["b_ci"] == [0.5, 0.5]
    assert e["p_le_0"] == 0.0
    # a resample counts only where both sets hold both classes of the finding
    assert 0 < e["n_resamples_used"] < 300
    assert out["mean"]["diff"] == 0.5 and out["mean"]["ci"] == [0.5, 0.5] and out["mean"]["labels"] == ["F"]
    assert (out["n_patients_a"], out["n_patients_b"]) == (6, 5)


def test_each_side_is_its_own_bootstrap_drawn_independently():
    """A's resamples are those of A's own evaluation (bootstrap_auroc with the same seed: the internal CI
    is the one the internal record reports); B's come from another stream: the two sides are not the
    same draws even for sets of one size."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=(40, 2)).astype(float)
    s = y * 0.6 + rng.random((40, 2))
    pa = np.repeat([f"a{i}" for i in range(20)], 2)
    pb = np.repeat([f"b{i}" for i in range(20)], 2)
    out = independent_bootstrap_auroc_diff((y, s, pa), (y, s, pb), ["F", "G"], n_resamples=200, seed=7)
    own_a = bootstrap_auroc(y, s, pa, ["F", "G"], n_resamples=200, seed=7)
    own_b = bootstrap_auroc(y, s, pb, ["F", "G"], n_resamples=200, seed=[7, 1])
    for lab in ("F", "G"):
        assert out["labels"][lab]["a_ci"] == own_a["labels"][lab]["ci"]
        assert out["labels"][lab]["b_ci"] == own_b["labels"][lab]["ci"]
        assert out["labels"][lab]["diff"] == 0.0          # the same images on both sides
        # independent draws: the difference of two equal point estimates still varies
        lo, hi = out["labels"][lab]["ci"]
        assert lo < 0 < hi


def test_unknown_labels_are_left_out_of_that_finding():
    """An image whose finding is unknown (NaN: an uncertain label under U-Ignore) counts for nothing in
    that finding: the result is the one without it (its patient, holding another image, stays)."""
    y = [1, 0, 1, 0, np.nan, 1, 0]
    s = [0.7, 0.4, 0.6, 0.5, 0.99, 0.3, 0.2]
    pats = ["p0", "p1", "p2", "p3", "p3", "p4", "p5"]
    keep = [0, 1, 2, 3, 5, 6]
    b = _set([1, 0, 0, 1], [0.6, 0.1, 0.7, 0.2])
    with_nan = independent_bootstrap_auroc_diff(_set(y, s, pats), b, ["F"], n_resamples=150, seed=2)
    without = independent_bootstrap_auroc_diff(_set(np.take(y, keep), np.take(s, keep), np.take(pats, keep)), b,
                                               ["F"], n_resamples=150, seed=2)
    assert with_nan == without
    known = ~np.isnan(y)
    assert with_nan["labels"]["F"]["a"] == roc_auc_score(np.asarray(y)[known], np.asarray(s)[known])


def test_matches_scipy_bootstrap_of_two_independent_samples():
    """One image per patient: the patient bootstrap of each set is scipy's resampling of its
    observations, the two samples resampled independently (``paired=False``); the percentile CIs of the
    difference agree within Monte Carlo error."""
    rng = np.random.default_rng(11)
    ya = rng.integers(0, 2, 80).astype(float)
    sa = ya * 1.2 + rng.normal(size=80)
    yb = rng.integers(0, 2, 70).astype(float)
    sb = yb * 0.5 + rng.normal(size=70)
    ours = independent_bootstrap_auroc_diff(_set(ya, sa), _set(yb, sb), ["F"], n_resamples=2000, seed=3)["labels"]["F"]

    def auroc(y, s):      # Mann-Whitney from ranks, row by row (vectorised for scipy)
        n_pos = y.sum(axis=-1)
        ranks = stats.rankdata(s, axis=-1)
        return ((ranks * y).sum(axis=-1) - n_pos * (n_pos + 1) / 2) / (n_pos * (y.shape[-1] - n_pos))

    def drop(ia, ib, axis=-1):
        ia, ib = ia.astype(int), ib.astype(int)
        return auroc(ya[ia], sa[ia]) - auroc(yb[ib], sb[ib])

    assert auroc(ya, sa) == pytest.approx(roc_auc_score(ya, sa))
    ref = stats.bootstrap((np.arange(80.0), np.arange(70.0)), drop, paired=False, vectorized=True,
                          n_resamples=2000, method="percentile", random_state=5)
    assert ours["diff"] == pytest.approx(roc_auc_score(ya, sa) - roc_auc_score(yb, sb))
    assert ours["ci"] == pytest.approx([ref.confidence_interval.low, ref.confidence_interval.high], abs=0.03)
    # the spread of the difference is that of two independent estimates: var(A - B) = var(A) + var(B)
    width = ours["ci"][1] - ours["ci"][0]
    wa, wb = (np.diff(ours[k])[0] for k in ("a_ci", "b_ci"))
    assert width == pytest.approx(np.hypot(wa, wb), rel=0.15)
    # Zech et al. compared the two AUCs with DeLong's unpaired test: its variance of the difference is the
    # sum of each AUC's DeLong variance; with one image per patient the bootstrap's CI has its width
    assert width == pytest.approx(2 * stats.norm.ppf(0.975) * np.sqrt(_delong_var(ya, sa) + _delong_var(yb, sb)),
                                  rel=0.15)


def _delong_var(y: np.ndarray, s: np.ndarray) -> float:
    """DeLong et al. (1988): the variance of one AUC from its structural components."""
    pos, neg = s[y == 1], s[y == 0]
    psi = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    return psi.mean(axis=1).var(ddof=1) / pos.size + psi.mean(axis=0).var(ddof=1) / neg.size


def test_a_finding_undefined_on_one_side_has_no_drop():
    a = _set([1, 0, 1, 0], [0.9, 0.1, 0.8, 0.2])
    b = _set([0, 0, 0], [0.3, 0.2, 0.1])            # no positive external image
    out = independent_bootstrap_auroc_diff(a, b, ["F"], n_resamples=50, seed=0)
    e = out["labels"]["F"]
    assert e["a"] == 1.0 and e["b"] is None and e["diff"] is None and e["ci"] is None and e["n_resamples_used"] == 0
    assert out["mean"] == {"labels": [], "n_resamples_used": 0, "a": None, "b": None, "ci": None, "diff": None}


def test_every_statistic_of_the_evaluation_counts_known_labels_only():
    """Unknown labels (NaN: an uncertain one under U-Ignore) through the evaluation's other statistics: a
    finding's AUROC, CI, calibration and PR curve are those of its known rows; a subgroup counts known
    positives and negatives; underdiagnosis counts an image as having a finding only on a known positive."""
    from chexflow.evaluate import metrics, subgroups, underdiagnosis
    rng = np.random.default_rng(1)
    n = 80
    y = rng.integers(0, 2, (n, 2)).astype(float)
    s = np.clip(rng.random((n, 2)) * 0.8 + y * 0.3, 0, 1)
    y[rng.random((n, 2)) < 0.25] = np.nan
    patients = np.array([f"p{i // 2}" for i in range(n)])
    labels = ["A", "B"]
    boot = bootstrap_auroc(y, s, patients, labels, n_resamples=100, seed=0)
    for j, lab in enumerate(labels):
        known = ~np.isnan(y[:, j])
        assert boot["labels"][lab]["auroc"] == pytest.approx(roc_auc_score(y[known, j], s[known, j]))
        assert metrics.calibration(y[:, j], s[:, j]) == metrics.calibration(y[known, j], s[known, j])
        assert metrics.precision_recall(y[:, j], s[:, j]) == metrics.precision_recall(y[known, j], s[known, j])
    fields = pd.DataFrame({"sex": ["male", "female"] * (n // 2), "age_band": ["40-59"] * n, "view": ["PA"] * n})
    groups = subgroups.subgroup_aurocs(y, s, patients, labels, fields, age_edges=(18, 40, 60, 80), min_count=3,
                                       n_resamples=50, seed=0)
    male = next(g for g in groups if g["group"] == "male")
    sel = fields["sex"].to_numpy() == "male"
    for j, lab in enumerate(labels):
        ys, ss = y[sel, j], s[sel, j]
        known = ~np.isnan(ys)
        e = male["labels"][lab]
        assert (e["n_pos"], e["n_neg"]) == ((ys == 1).sum(), (ys == 0).sum())
        assert e["auroc"] == pytest.approx(roc_auc_score(ys[known], ss[known]))
    audit = underdiagnosis.audit(y, s, patients, labels, {"threshold": 0.5, "findings": labels}, None,
                                 age_edges=(18, 40, 60, 80), min_patients=3, n_resamples=50, seed=0)
    has = (y == 1).any(axis=1)
    missed = (s < 0.5).all(axis=1)
    normal = ~has                   # unknown is not positive: an image of NaN and 0 labels is normal
    assert audit["overall"]["companion"]["n"] == normal.sum()
    assert audit["overall"]["companion"]["k"] == (normal & missed).sum()
    assert audit["overall"]["image"]["n"] == has.sum() and audit["overall"]["image"]["missed"] == (has & missed).sum()


def test_the_drop_verdict_is_the_evaluations_and_withheld_below_the_minimum():
    """The issue's case: one external positive in 21 images, "lower" by a CI of the drop above zero. The
    verdict is decided in chexflow.evaluate (stored in the record), withheld by the small-count rule;
    the report renders the stored words and decides nothing."""
    from chexflow.evaluate.external import drop_verdict
    from chexflow.report import external_view
    lower = {"diff": 0.3, "ci": [0.1, 0.5]}
    assert drop_verdict(lower, "chexpert") == {"verdict": "lower",
                                               "verdict_text": "lower on chexpert (95% CI of the drop above 0)"}
    assert drop_verdict({"diff": -0.2, "ci": [-0.4, -0.01]}, "x")["verdict"] == "higher"
    assert drop_verdict({"diff": 0.1, "ci": [-0.1, 0.3]}, "x")["verdict"] == "no difference shown"
    assert drop_verdict({"diff": None, "ci": None}, "x")["verdict"] == "undefined"
    few = drop_verdict({"diff": 0.4, "ci": None}, "chexpert", too_few="external: too few: 1 positive / 20 negative "
                       "patients (5 of each needed)")
    assert few == {"verdict": "too few", "verdict_text": "external: too few: 1 positive / 20 negative patients (5 of "
                                                         "each needed): no CI, no verdict"}
    side = {"auroc": 0.9, "ci": None, "n_pos": 1, "n_neg": 20, "n_unknown": 0, "too_few": "too few: 1 positive / 20 "
            "negative patients (5 of each needed)"}
    record = {"findings": [{"finding": "Pneumothorax", "external_label": "Pneumothorax", "internal": side,
                            "external": side, "drop": {"diff": 0.4, "ci": None, **few}}],
              "mean": {"findings": ["Pneumothorax"], "internal": 0.9, "external": 0.5, "drop": 0.4, "ci": None,
                       "verdict": "no CI", "verdict_text": "no CI"},
              "label_map": {"model_only": [], "data_only": []}, "n_images": 21, "n_patients": 21,
              "bootstrap": {}}
    view = external_view.external_view({"chexpert": record})
    assert view[0]["rows"][0]["verdict"] == few["verdict_text"] and not view[0]["rows"][0]["lower"]
    assert external_view.limitations(view) == []          # no "lower for Pneumothorax" from one positive


@pytest.mark.parametrize("call", [{"threshold": "0.3", "findings": ["A"]}, {"threshold": float("nan"), "findings": ["A"]},
                                  {"threshold": True, "findings": ["A"]}, {"threshold": 0.3, "findings": ["Z"]},
                                  {"threshold": 0.3, "findings": "A"}, "0.3"])
def test_the_internal_call_an_external_audit_applies_is_checked_as_untrusted_input(tmp_path, call):
    """metrics.json's "no finding" call reaches the external audit only as a finite threshold (or null) over
    the model's findings; anything else is one line naming the file."""
    from chexflow.evaluate.external import _internal_call
    from chexflow.evaluate.external_record import ExternalInputError
    where = tmp_path / "metrics.json"
    assert _internal_call({"underdiagnosis": {"call": {"threshold": 0.3, "findings": ["A"]}}}, ["A", "B"],
                          where)["threshold"] == 0.3
    assert _internal_call({"underdiagnosis": {"call": {"threshold": None, "findings": []}}}, ["A"], where) is not None
    assert _internal_call({}, ["A"], where) is None
    with pytest.raises(ExternalInputError, match=f"^{where}: underdiagnosis.call must name a finite threshold"):
        _internal_call({"underdiagnosis": {"call": call}}, ["A", "B"], where)
