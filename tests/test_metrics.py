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
    assert M.operating_point(y, s, 2.0)["ppv"] is None  # nothing predicted positive
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
