"""Intervals beside every number (chexflow.evaluate.intervals): the small-count rule's words, a rate's
patient bootstrap and its exact fallback at 0 or 1, and the bootstrap of AUPRC, Brier and ECE checked
against scikit-learn on the expanded resample (an image of weight k as k copies)."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, brier_score_loss

from chexflow.evaluate import intervals, metrics


def test_the_small_count_rule_names_its_counts():
    assert intervals.too_few(5, 5, 5) is None and intervals.too_few(7, None, 5) is None
    assert intervals.too_few(3, 40, 5) == "too few: 3 positive / 40 negative patients (5 of each needed)"
    assert intervals.too_few(4, None, 5) == "too few: 4 patients (5 needed)"


def test_a_rate_of_one_gets_the_exact_interval_over_its_patients_not_a_collapsed_bootstrap():
    """The issue's Pneumonia: sensitivity 1.0 on 7 images of 6 patients. Every resample gives 1.0, so the
    percentile bootstrap would show 1.000-1.000; the exact interval over the 6 patients (all with every
    image flagged) is [0.025 ** (1/6), 1] = [0.541, 1]."""
    patients = np.array(["a", "a", "b", "c", "d", "e", "f"])
    got = intervals.rate(np.ones(7, bool), np.ones(7, bool), patients, minimum=5, n_resamples=200, seed=0)
    assert (got["k"], got["n"], got["n_patients"], got["rate"]) == (7, 7, 6, 1.0)
    assert got["ci"] == pytest.approx([0.025 ** (1 / 6), 1.0]) and got["interval"] == intervals.EXACT
    none = intervals.rate(np.zeros(7, bool), np.ones(7, bool), patients, minimum=5, n_resamples=200, seed=0)
    assert none["ci"] == pytest.approx([0.0, 1 - 0.025 ** (1 / 6)])
    few = intervals.rate(np.ones(7, bool), np.ones(7, bool), patients, minimum=7, n_resamples=200, seed=0)
    assert few["ci"] is None and few["too_few"] == "too few: 6 patients (7 needed)" and few["rate"] == 1.0


def test_a_rate_between_zero_and_one_is_the_patient_bootstrap_of_a_plain_loop():
    rng = np.random.default_rng(2)
    patients = np.repeat(np.arange(60), 2)
    hit, den = rng.random(120) < 0.4, rng.random(120) < 0.8
    got = intervals.rate(hit, den, patients, minimum=5, n_resamples=300, seed=4)
    pidx, counts = metrics.patient_draws(patients, 300, 4)          # the same draws, one at a time
    vals = [np.repeat(hit & den, c[pidx]).sum() / np.repeat(den, c[pidx]).sum() for c in counts]
    assert got["ci"] == pytest.approx(np.percentile(vals, [2.5, 97.5])) and got["interval"] == "patient bootstrap"
    assert got["n_resamples_dropped"] == 0


def _ece(t, p, n_bins):
    """ECE by its definition, bin by bin (equal-width bins, the last closed)."""
    b = np.minimum((p * n_bins).astype(int), n_bins - 1)
    return sum(abs(t[b == k].mean() - p[b == k].mean()) * (b == k).mean() for k in range(n_bins) if (b == k).any())


def test_auprc_brier_and_ece_of_each_resample_are_scikit_learns_on_the_expanded_sample():
    rng = np.random.default_rng(0)
    patients = np.repeat(np.arange(40), 3)
    t = (rng.random(120) < 0.3).astype(float)
    # rounded (ties, as float32 scores give), then off the bin edges (where assignments may differ by convention)
    p = np.round(np.clip(rng.random(120) * 0.6 + t * 0.3, 0, 0.98), 2) + 0.005
    got = intervals.score_intervals(t, p, patients, n_bins=10, n_resamples=200, seed=1)
    pidx, counts = metrics.patient_draws(patients, 200, 1)
    auprc, brier, ece = [], [], []
    for c in counts:
        w = c[pidx]
        te, pe = np.repeat(t, w), np.repeat(p, w)
        if 0 < te.sum() < te.size:
            auprc.append(average_precision_score(te, pe))
            brier.append(brier_score_loss(te, pe))
            ece.append(_ece(te, pe, 10))
    assert got["n_resamples_used"] == len(auprc) and got["n_resamples_dropped"] == 200 - len(auprc)
    for key, vals in (("auprc_ci", auprc), ("brier_ci", brier), ("ece_ci", ece)):
        assert got[key] == pytest.approx(np.percentile(vals, [2.5, 97.5]), abs=1e-12), key
    assert metrics.calibration(t, p)["ece"] == pytest.approx(_ece(t, p, 10))


def test_a_mean_without_spread_gets_no_interval():
    got = intervals.mean(np.zeros(12), np.repeat(np.arange(6), 2), minimum=5, n_resamples=100, seed=0)
    assert got["value"] == 0.0 and got["ci"] is None
    spread = intervals.mean(np.arange(12.0), np.repeat(np.arange(6), 2), minimum=5, n_resamples=100, seed=0)
    assert spread["ci"][0] < 5.5 < spread["ci"][1] and spread["interval"] == "patient bootstrap"


def test_the_operating_point_rates_and_f1_by_hand():
    """6 patients, one image each: labels 1 1 1 0 0 0, flagged 1 1 0 1 0 0. TP 2, FN 1, FP 1, TN 2:
    sensitivity 2/3, specificity 2/3, PPV 2/3, NPV 2/3, F1 = 4 / (4 + 1 + 1) = 2/3; with a minimum of 4
    patients each rate over 3 patients is too few, F1 (over the 4 patients with a TP, FP or FN) is not."""
    t = np.array([1, 1, 1, 0, 0, 0], float)
    s = np.array([0.9, 0.8, 0.1, 0.7, 0.2, 0.3])
    got = intervals.operating_point_intervals(t, s, list("abcdef"), 0.5, minimum=4, n_resamples=200, seed=0)
    for key in ("sensitivity", "specificity", "ppv", "npv"):
        assert got[key]["rate"] == pytest.approx(2 / 3) and got[key]["too_few"] == "too few: 3 patients (4 needed)"
    f1 = got["f1"]
    assert (f1["k"], f1["n"], f1["n_patients"]) == (4, 6, 4) and f1["rate"] == pytest.approx(2 / 3)
    assert f1["too_few"] is None and f1["ci"][0] <= 2 / 3 <= f1["ci"][1]


def test_the_auroc_against_chance_is_decided_here_and_only_worded_by_the_report():
    from chexflow.report.results_view import AurocRow
    assert [intervals.against_chance(ci) for ci in ([0.51, 0.7], [0.4, 0.6], [0.5, 0.7], [0.2, 0.49], None)] == \
        ["above", "includes", "includes", "below", None]
    row = dict(label="Mass", display="Mass", ours=0.43, ci_low=0.26, ci_high=0.6, n_pos=9, n_neg=400, chexnet=None,
               wang=None)
    assert AurocRow(**row, vs_chance="includes").chance_note == "below 0.5, CI includes chance"
    assert AurocRow(**row, vs_chance="below").chance_note == "below chance (CI below 0.5)"
    assert AurocRow(**row, vs_chance=None).chance_note == "below 0.5, no CI"     # withheld: too few
