"""Tests of chexflow.evaluate.metrics and chexflow.evaluate.published."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from chexflow.evaluate import metrics as M
from chexflow.evaluate import published

LABELS3 = ["A", "B", "C"]


def _patient_data(n_patients: int, images_per_patient: int, n_labels: int, seed: int, *,
                  correlated: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Same generative model at any size: each label positive w.p. 0.3, score = 1.0*y + noise.

    With ``correlated`` every image of a patient is an identical copy (perfect within-patient
    correlation); otherwise images are independent draws sharing only the patient id.
    """
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(n_patients), images_per_patient)
    if correlated:
        y_p = (rng.random((n_patients, n_labels)) < 0.3).astype(float)
        s_p = y_p + rng.normal(size=y_p.shape)
        return y_p[groups], s_p[groups], groups.astype(str)
    n = groups.size
    y = (rng.random((n, n_labels)) < 0.3).astype(float)
    s = y + rng.normal(size=y.shape)
    return y, s, groups.astype(str)


# --------------------------------------------------------------------------- auroc_per_label
def test_auroc_per_label_matches_sklearn_with_nan_masking():
    rng = np.random.default_rng(0)
    y = (rng.random((200, 3)) < 0.4).astype(float)
    s = y * 0.7 + rng.normal(size=y.shape)
    y[rng.random(y.shape) < 0.2] = np.nan
    got = M.auroc_per_label(y, s, LABELS3)
    for j, lab in enumerate(LABELS3):
        known = ~np.isnan(y[:, j])
        assert got[lab] == pytest.approx(roc_auc_score(y[known, j], s[known, j]), abs=1e-12)
    assert M.mean_auroc(got) == pytest.approx(np.mean(list(got.values())))


def test_auroc_per_label_known_values_and_nan_rows_ignored():
    y = np.array([[0, 0], [0, np.nan], [1, 1], [1, 0], [np.nan, 1]], dtype=float)
    s = np.array([[0.1, 0.2], [0.4, 99.0], [0.35, 0.9], [0.8, 0.1], [-5.0, 0.3]])
    got = M.auroc_per_label(y, s, ["a", "b"])
    assert got["a"] == pytest.approx(0.75)  # pos {0.35, 0.8} vs neg {0.1, 0.4}: 3 of 4 pairs
    assert got["b"] == pytest.approx(1.0)   # pos {0.9, 0.3} vs neg {0.2, 0.1}


def test_one_class_column_is_none_and_mean_excludes_it():
    y = np.array([[0, 1, 0], [1, 1, np.nan], [0, 1, np.nan], [1, 1, np.nan]], dtype=float)
    s = np.array([[0.1, 0.5, 0.3], [0.9, 0.2, 0.3], [0.2, 0.1, 0.3], [0.8, 0.4, 0.3]])
    got = M.auroc_per_label(y, s, LABELS3)
    assert got == {"A": 1.0, "B": None, "C": None}
    assert M.mean_auroc(got) == 1.0
    assert M.mean_auroc({"x": 0.6, "y": None, "z": 0.8}) == pytest.approx(0.7)
    assert np.isnan(M.mean_auroc({"x": None}))


def test_auroc_per_label_rejects_bad_input():
    with pytest.raises(ValueError, match="shape"):
        M.auroc_per_label(np.zeros((3, 2)), np.zeros((3, 3)), ["a", "b"])
    with pytest.raises(ValueError, match="label names"):
        M.auroc_per_label(np.zeros((3, 2)), np.zeros((3, 2)), ["a"])
    with pytest.raises(ValueError, match="0, 1 or NaN"):
        M.auroc_per_label(np.full((3, 1), 2.0), np.zeros((3, 1)), ["a"])


# --------------------------------------------------------------------------- bootstrap
def test_weighted_auroc_equals_sklearn_on_expanded_sample():
    rng = np.random.default_rng(3)
    t = (rng.random(300) < 0.3).astype(float)
    s = np.round(t + rng.normal(size=300), 1)  # rounding creates ties
    w = rng.integers(0, 4, size=(5, 300)).astype(float)
    got = M._weighted_auroc_batch(t, s, w)
    for b in range(5):
        idx = np.repeat(np.arange(300), w[b].astype(int))
        assert got[b] == pytest.approx(roc_auc_score(t[idx], s[idx]), abs=1e-12)


def test_bootstrap_ci_contains_point_and_shrinks_with_more_patients():
    y, s, g = _patient_data(150, 2, 3, seed=1)
    small = M.bootstrap_auroc(y, s, g, LABELS3, n_resamples=400, seed=0)
    y4, s4, g4 = _patient_data(600, 2, 3, seed=2)
    big = M.bootstrap_auroc(y4, s4, g4, LABELS3, n_resamples=400, seed=0)
    for res in (small, big):
        for lab in LABELS3:
            e = res["labels"][lab]
            assert e["ci_low"] <= e["auroc"] <= e["ci_high"]
            assert e["n_skipped"] == 0 and e["n_resamples_used"] == 400
            assert e["ci"] == [e["ci_low"], e["ci_high"]]
        m = res["mean_auroc"]
        assert m["ci_low"] <= m["auroc"] <= m["ci_high"]
        assert res["mean_auroc_ci"] == [m["ci_low"], m["ci_high"]]
    assert small["n_patients"] == 150 and big["n_patients"] == 600
    for lab in LABELS3:
        w_small = small["labels"][lab]["ci_high"] - small["labels"][lab]["ci_low"]
        w_big = big["labels"][lab]["ci_high"] - big["labels"][lab]["ci_low"]
        assert w_big < 0.75 * w_small  # ~1/2 expected for 4x the patients
    w_small = small["mean_auroc"]["ci_high"] - small["mean_auroc"]["ci_low"]
    w_big = big["mean_auroc"]["ci_high"] - big["mean_auroc"]["ci_low"]
    assert w_big < 0.75 * w_small


def test_bootstrap_is_deterministic_given_seed():
    y, s, g = _patient_data(50, 2, 3, seed=4)
    a = M.bootstrap_auroc(y, s, g, LABELS3, n_resamples=100, seed=7)
    b = M.bootstrap_auroc(y, s, g, LABELS3, n_resamples=100, seed=7)
    assert a == b


def test_resample_counts_keep_patients_whole():
    groups = np.array(["p3", "p1", "p3", "p2", "p1", "p3"])
    patient_index, counts = M.patient_resample_counts(groups, 50, np.random.default_rng(0))
    assert counts.shape == (50, 3)
    assert (counts.sum(axis=1) == 3).all()  # P patients drawn per resample
    # images of one patient share one index -> identical multiplicity in every resample
    weights = counts[:, patient_index]
    for pid in np.unique(groups):
        cols = weights[:, groups == pid]
        assert (cols == cols[:, :1]).all()
    assert len(np.unique(patient_index)) == 3


def test_patient_resampling_is_wider_than_image_resampling():
    # 8 identical images per patient: image-level resampling would pretend 8x the data.
    y, s, g = _patient_data(120, 8, 1, seed=5, correlated=True)
    by_patient = M.bootstrap_auroc(y, s, g, ["A"], n_resamples=400, seed=0)["labels"]["A"]
    by_image = M.bootstrap_auroc(y, s, np.arange(len(g)), ["A"], n_resamples=400, seed=0)["labels"]["A"]
    assert by_patient["auroc"] == by_image["auroc"]
    w_patient = by_patient["ci_high"] - by_patient["ci_low"]
    w_image = by_image["ci_high"] - by_image["ci_low"]
    assert w_patient > 2.0 * w_image  # sqrt(8) ~ 2.8 expected


def test_bootstrap_skips_and_counts_one_class_resamples():
    # one positive patient among 6: many resamples miss it -> skipped, counted
    y = np.array([[1.0], [0.0], [0.0], [0.0], [0.0], [0.0]])
    s = np.array([[0.9], [0.1], [0.2], [0.3], [0.4], [0.5]])
    g = np.arange(6)
    res = M.bootstrap_auroc(y, s, g, ["A"], n_resamples=200, seed=0)
    e = res["labels"]["A"]
    assert 0 < e["n_skipped"] < 200
    assert e["n_skipped"] + e["n_resamples_used"] == 200
    assert e["ci_low"] == e["ci_high"] == 1.0
    assert res["mean_auroc"]["n_resamples_used"] == e["n_resamples_used"]


def test_bootstrap_label_undefined_in_point_estimate():
    y = np.array([[1, 0], [0, 0], [1, 0], [0, 0]], dtype=float)
    s = np.array([[0.9, 0.1], [0.1, 0.2], [0.8, 0.3], [0.3, 0.4]])
    res = M.bootstrap_auroc(y, s, ["a", "b", "c", "d"], ["A", "B"], n_resamples=20, seed=0)
    assert res["labels"]["B"] == {"auroc": None, "ci_low": None, "ci_high": None, "ci": None,
                                  "n_resamples_used": 0, "n_skipped": 20}
    assert res["mean_auroc"]["auroc"] == 1.0


@pytest.mark.slow
def test_bootstrap_speed_full_size():
    rng = np.random.default_rng(0)
    n, n_labels = 5000, 14
    groups = rng.integers(0, 1500, n)
    y = (rng.random((n, n_labels)) < 0.1).astype(float)
    s = y + rng.normal(size=y.shape)
    t0 = time.perf_counter()
    M.bootstrap_auroc(y, s, groups, [f"L{i}" for i in range(n_labels)], n_resamples=1000, seed=0)
    assert time.perf_counter() - t0 < 30.0  # ~2 s on 2 cores; generous for loaded CI machines


# --------------------------------------------------------------------------- thresholds
def test_youden_threshold_separable():
    y = np.array([0, 0, 0, 1, 1, 1, np.nan], dtype=float)
    s = np.array([0.1, 0.2, 0.3, 0.7, 0.8, 0.9, 0.5])
    thr = M.youden_threshold(y, s)
    assert 0.3 < thr <= 0.7
    op = M.operating_point(y, s, thr)
    assert op["sensitivity"] == 1.0 and op["specificity"] == 1.0
    assert op["ppv"] == 1.0 and op["f1"] == 1.0
    assert (op["tp"], op["fp"], op["tn"], op["fn"]) == (3, 0, 3, 0)


def test_operating_point_values_and_undefined_ppv():
    y = np.array([1, 1, 0, 0, 0], dtype=float)
    s = np.array([0.9, 0.2, 0.8, 0.1, 0.3])
    op = M.operating_point(y, s, 0.5)  # tp=1 fn=1 fp=1 tn=2
    assert op["sensitivity"] == pytest.approx(0.5)
    assert op["specificity"] == pytest.approx(2 / 3)
    assert op["ppv"] == pytest.approx(0.5)
    assert op["f1"] == pytest.approx(0.5)
    assert op["npv"] == pytest.approx(2 / 3)  # tn=2 of the 3 predicted negative
    assert M.operating_point(y, s, 2.0)["ppv"] is None  # nothing predicted positive
    assert M.operating_point(y, s, -1.0)["npv"] is None  # nothing predicted negative
    with pytest.raises(ValueError, match="both classes"):
        M.youden_threshold(np.zeros(4), np.arange(4.0))


def test_top1_accuracy():
    logits = np.array([[0.1, 0.9, 0.0], [2.0, 1.0, 0.0], [0.0, 0.1, 0.2], [1.0, 0.0, 3.0]])
    assert M.top1_accuracy(logits, np.array([1, 0, 2, 0])) == 0.75
    torch = pytest.importorskip("torch")
    assert M.top1_accuracy(torch.tensor(logits), torch.tensor([1, 0, 2, 2])) == 1.0


def test_metrics_module_does_not_import_torch():
    code = ("import sys; import chexflow.evaluate.metrics, chexflow.evaluate.published; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


# --------------------------------------------------------------------------- published
def test_published_numbers():
    assert list(published.CHEXNET_AUROC)[0] == "Atelectasis" and len(published.CHEXNET_AUROC) == 14
    assert set(published.CHEXNET_AUROC) == set(published.WANG2017_AUROC)
    assert published.CHEXNET.mean == pytest.approx(0.841, abs=5e-4)
    assert published.CHEXNET_AUROC["Cardiomegaly"] == 0.9248
    assert published.CHEXNET.get("Cardiomegaly") == 0.9248 and published.CHEXNET.get("mean") is None
    # a published mean is taken over the labels of the run's own mean, from the per-label values
    assert published.CHEXNET.mean_over(["Cardiomegaly", "Hernia"]) == pytest.approx((0.9248 + 0.9164) / 2)
    thirteen = [lab for lab in published.CHEXNET_AUROC if lab != "Hernia"]
    assert published.CHEXNET.mean_over(thirteen) == pytest.approx(
        (sum(published.CHEXNET_AUROC.values()) - 0.9164) / 13)
    assert published.CHEXNET.mean_over([]) is None and published.CHEXNET.mean_over(["Cardiomegaly", "x"]) is None
    assert published.WANG2017.mean == pytest.approx(0.745, abs=5e-4)
    assert published.ARNOWENG.mean == 0.847 and published.ZECH.mean == 0.836
    try:
        from chexflow.data.nih import LABELS
    except ImportError:
        pytest.skip("chexflow.data.nih not available yet")
    assert list(published.CHEXNET_AUROC) == list(LABELS)


def test_paired_bootstrap_auroc_diff_is_paired_and_matches_point_estimates():
    rng = np.random.default_rng(3)
    n, labels = 400, ["a", "b", "c"]
    groups = np.repeat(np.arange(100), 4)
    y = (rng.random((n, 3)) < 0.3).astype(float)
    y[rng.random((n, 3)) < 0.05] = np.nan
    base = rng.normal(size=(n, 3))
    better = np.nan_to_num(y) * 1.0 + base          # same noise, more signal: A beats B on every resample
    worse = np.nan_to_num(y) * 0.5 + base
    res = M.paired_bootstrap_auroc_diff(y, better, worse, groups, labels, n_resamples=300, seed=0)
    ma = M.mean_auroc(M.auroc_per_label(y, better, labels))
    mb = M.mean_auroc(M.auroc_per_label(y, worse, labels))
    assert res["diff"] == pytest.approx(ma - mb) and res["mean_a"] == pytest.approx(ma)
    lo, hi = res["ci"]
    assert 0 < lo < res["diff"] < hi and res["p_le_0"] == 0.0
    assert res["n_patients"] == 100 and res["labels_used"] == labels
    # paired: narrower than what the two unpaired CIs suggest
    ua = M.bootstrap_auroc(y, better, groups, labels, n_resamples=300, seed=0)["mean_auroc_ci"]
    ub = M.bootstrap_auroc(y, worse, groups, labels, n_resamples=300, seed=0)["mean_auroc_ci"]
    assert hi - lo < 0.5 * ((ua[1] - ua[0]) + (ub[1] - ub[0]))
    # the same scores: no difference on any resample
    same = M.paired_bootstrap_auroc_diff(y, worse, worse, groups, labels, n_resamples=50, seed=0)
    assert same["diff"] == 0.0 and same["ci"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="shape"):
        M.paired_bootstrap_auroc_diff(y, better[:10], worse, groups, labels)


# --------------------------------------------------------------------------- the mean over labels (issue 19 4f)
def _resampled_aurocs(y, s, groups, n_resamples, seed):
    """Per-resample, per-label AUROC by scikit-learn on the expanded sample (NaN: one class): the
    resampling scheme (patients drawn with replacement, multinomial counts from default_rng(seed))
    computed independently of chexflow's weighted AUROC."""
    _, pidx = np.unique(groups, return_inverse=True)
    n_p = pidx.max() + 1
    counts = np.random.default_rng(seed).multinomial(n_p, np.full(n_p, 1.0 / n_p), size=n_resamples)
    out = np.full((n_resamples, y.shape[1]), np.nan)
    for b in range(n_resamples):
        rep = counts[b, pidx]
        for j in range(y.shape[1]):
            known = ~np.isnan(y[:, j])
            t = np.repeat(y[known, j], rep[known])
            if np.unique(t).size == 2:
                out[b, j] = roc_auc_score(t, np.repeat(s[known, j], rep[known]))
    return out


def test_bootstrap_mean_uses_only_resamples_where_every_label_is_defined():
    rng = np.random.default_rng(5)
    groups = np.repeat(np.arange(30), 2)
    y = (rng.random((60, 2)) < 0.4).astype(float)
    y[:, 1] = 0.0
    y[[0, 1], 1] = 1.0                       # label B: one positive patient, lost in ~37% of resamples
    s = y + rng.normal(size=y.shape)
    res = M.bootstrap_auroc(y, s, groups, ["A", "B"], n_resamples=300, seed=4)
    per = _resampled_aurocs(y, s, groups, 300, 4)
    complete = ~np.isnan(per).any(axis=1)
    assert 50 < (~complete).sum() < 200
    want = np.percentile(per[complete].mean(axis=1), [2.5, 97.5])
    assert res["mean_auroc_ci"] == pytest.approx(list(want), abs=1e-12)
    assert res["mean_auroc"]["n_resamples_used"] == complete.sum()
    assert res["mean_auroc"]["n_resamples_dropped"] == (~complete).sum() and "dropped" in res["mean_auroc"]["rule"]
    # the per-label CIs still use every resample in which that label is defined
    b_ok = ~np.isnan(per[:, 1])
    assert res["labels"]["B"]["ci"] == pytest.approx(list(np.percentile(per[b_ok, 1], [2.5, 97.5])), abs=1e-12)


def test_paired_difference_per_label_cis_match_an_independent_bootstrap():
    rng = np.random.default_rng(8)
    groups = np.repeat(np.arange(40), 3)
    y = (rng.random((120, 3)) < 0.3).astype(float)
    y[rng.random(y.shape) < 0.05] = np.nan
    a = np.nan_to_num(y) + rng.normal(size=y.shape)
    b = 0.5 * np.nan_to_num(y) + rng.normal(size=y.shape)
    res = M.paired_bootstrap_auroc_diff(y, a, b, groups, LABELS3, n_resamples=200, seed=2)
    diff = _resampled_aurocs(y, a, groups, 200, 2) - _resampled_aurocs(y, b, groups, 200, 2)
    for j, lab in enumerate(LABELS3):
        ok = ~np.isnan(diff[:, j])
        assert res["labels"][lab]["ci"] == pytest.approx(list(np.percentile(diff[ok, j], [2.5, 97.5])), abs=1e-12)
        known = ~np.isnan(y[:, j])
        assert res["labels"][lab]["diff"] == pytest.approx(roc_auc_score(y[known, j], a[known, j])
                                                           - roc_auc_score(y[known, j], b[known, j]))
    complete = ~np.isnan(diff).any(axis=1)
    assert res["ci"] == pytest.approx(list(np.percentile(diff[complete].mean(axis=1), [2.5, 97.5])), abs=1e-12)


# --------------------------------------------------------------------------- calibration, PR, proportions
def test_calibration_hand_computed_and_against_scikit_learn():
    from sklearn.calibration import calibration_curve
    from sklearn.metrics import brier_score_loss
    y = np.array([0, 0, 1, 0, 1, 1, np.nan])
    p = np.array([0.1, 0.2, 0.3, 0.6, 0.7, 0.9, 0.5])
    cal = M.calibration(y, p, n_bins=2)     # bins [0, .5): p .1 .2 .3, y 0 0 1; [.5, 1]: p .6 .7 .9, y 0 1 1
    assert cal["n"] == 6 and cal["prevalence"] == pytest.approx(0.5)
    assert [b["count"] for b in cal["bins"]] == [3, 3]
    assert cal["ece"] == pytest.approx(0.5 * abs(1 / 3 - 0.2) + 0.5 * abs(2 / 3 - 2.2 / 3))
    assert cal["brier"] == pytest.approx((0.01 + 0.04 + 0.49 + 0.36 + 0.09 + 0.01) / 6)
    rng = np.random.default_rng(0)
    y = (rng.random(500) < 0.15).astype(float)
    p = np.clip(0.1 + 0.5 * y * rng.random(500) + 0.2 * rng.random(500), 0, 1)
    cal = M.calibration(y, p, n_bins=10)
    frac, mean = calibration_curve(y, p, n_bins=10, strategy="uniform")
    assert [b["fraction_positive"] for b in cal["bins"]] == pytest.approx(list(frac))
    assert [b["mean_predicted"] for b in cal["bins"]] == pytest.approx(list(mean))
    assert sum(b["count"] for b in cal["bins"]) == 500
    assert cal["ece"] == pytest.approx(sum(b["count"] / 500 * abs(f - m) for b, f, m in zip(cal["bins"], frac, mean)))
    assert cal["brier"] == pytest.approx(brier_score_loss(y, p))
    with pytest.raises(ValueError, match="probabilities"):
        M.calibration(y, p + 1.0)


def test_precision_recall():
    """The Wilson interval this test also checked is gone: the pointing game's hit rate takes its interval
    by patients (chexflow.evaluate.intervals), maps of one patient not being independent."""
    from sklearn.metrics import average_precision_score
    y = np.array([1, 0, 1, 0, 0, np.nan])
    s = np.array([0.9, 0.8, 0.7, 0.2, 0.1, 0.5])
    pr = M.precision_recall(y, s)
    assert pr["auprc"] == pytest.approx((1.0 + 2 / 3) / 2)   # precision 1 at recall .5, 2/3 at recall 1
    assert pr["auprc"] == pytest.approx(average_precision_score([1, 0, 1, 0, 0], s[:5]))
    assert pr["prevalence"] == pytest.approx(0.4)


def test_positives_per_image_and_per_patient():
    y = np.array([1, 1, 0, 1, np.nan, 0])
    got = M.positives(y, ["p1", "p1", "p2", "p3", "p4", "p4"])
    assert got == {"images": 3, "patients": 2, "known_images": 5}


def test_each_reference_names_its_split():
    """Wang et al. used the official NIH lists, the others their own random splits: the caveat says
    so per reference instead of calling every published number a random split (issue 19 4a)."""
    assert all(r.split for r in published.PUBLISHED)
    assert "official NIH" in published.WANG2017.split and "random" in published.CHEXNET.split
    assert "not the official" in published.ARNOWENG.split and "not the official" in published.ZECH.split
    assert "Wang et al., EVA-X, Medical MAE and XProtoNet used the official NIH lists" in published.SPLIT_CAVEAT
    assert all(r.pretraining for r in published.PUBLISHED)


def test_official_split_state_of_the_art():
    """The best published results on the official test_list.txt: means as reported, the split and the
    pretraining per row; no per-finding values that were not checked against the sources."""
    sota = {r.key: r for r in published.OFFICIAL_SPLIT_STATE_OF_THE_ART}
    assert {k: r.mean for k, r in sota.items()} == {"eva_x": 0.835, "medical_mae": 0.823, "xprotonet": 0.822}
    for r in sota.values():
        assert "official NIH split lists" in r.split and "test_list.txt" in r.split and not r.per_label
        assert r.citation and r.url.startswith("https://") and r.pretraining
    assert "2405.05237" in sota["eva_x"].citation and "520k" in sota["eva_x"].pretraining
    assert "WACV 2023" in sota["medical_mae"].citation and "266,340" in sota["medical_mae"].pretraining
    assert "CVPR 2021" in sota["xprotonet"].citation and "ImageNet" in sota["xprotonet"].pretraining
    assert set(sota) <= {r.key for r in published.PUBLISHED}


def test_gain_over_seeds_resamples_patients_once_for_every_seed():
    """The seed-averaged difference's CI: per resample, each seed's difference averaged over labels
    (complete resamples only), then over seeds; checked against scikit-learn on expanded samples."""
    from scipy import stats
    rng = np.random.default_rng(11)
    groups = np.repeat(np.arange(30), 2)
    y = (rng.random((60, 2)) < 0.35).astype(float)
    runs = [(y + rng.normal(size=y.shape), 0.4 * y + rng.normal(size=y.shape)) for _ in range(3)]
    res = M.paired_bootstrap_over_seeds(y, runs, groups, ["A", "B"], n_resamples=150, seed=6)
    diffs = [_resampled_aurocs(y, a, groups, 150, 6) - _resampled_aurocs(y, b, groups, 150, 6) for a, b in runs]
    complete = ~np.isnan(np.stack(diffs)).any(axis=(0, 2))
    per = np.mean([d[complete].mean(axis=1) for d in diffs], axis=0)
    assert res["ci"] == pytest.approx(list(np.percentile(per, [2.5, 97.5])), abs=1e-12)
    point = [np.mean([roc_auc_score(y[:, j], a[:, j]) - roc_auc_score(y[:, j], b[:, j]) for j in range(2)]) for a, b in runs]
    assert res["per_seed"] == pytest.approx(point) and res["diff"] == pytest.approx(np.mean(point))
    lo, hi = stats.t.interval(0.95, 2, loc=np.mean(point), scale=stats.sem(point))
    assert res["t_ci"] == pytest.approx([lo, hi])
    one = M.paired_bootstrap_over_seeds(y, runs[:1], groups, ["A", "B"], n_resamples=150, seed=6)
    assert one["t_ci"] is None and one["ci"] == pytest.approx(
        M.paired_bootstrap_auroc_diff(y, *runs[0], groups, ["A", "B"], n_resamples=150, seed=6)["ci"])
