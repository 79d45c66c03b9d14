"""Localisation, saliency and subgroups of the evaluation (issue 19 items 1 and 3): the box list,
the geometry of the preprocessing, the pointing game and IoBB by hand, Grad-CAM against its
definition, subgroup AUROCs against scikit-learn."""
from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score

from chexflow.data import augment, images, nih
from chexflow.evaluate import localisation as L
from chexflow.evaluate import saliency, subgroups
from chexflow.train.models import build_model


# --------------------------------------------------------------------------- the box list
def test_box_list_round_trip_in_the_release_format(tmp_path):
    path = tmp_path / nih.BOX_LIST_NAME
    nih.write_box_list(path, [("a.png", "Infiltration", 10.5, 20, 30, 40), ("b.png", "Mass", 0, 0, 1024, 1024)])
    lines = path.read_text().splitlines()
    assert lines[0] == "Image Index,Finding Label,Bbox [x,y,w,h],,,"          # NIH's header, trailing empties
    assert lines[1] == "a.png,Infiltrate,10.5,20,30,40,,,"                  # NIH spells it Infiltrate
    got = nih.read_box_list(path)
    assert got.to_dict("records") == [
        {"image": "a.png", "label": "Infiltration", "x": 10.5, "y": 20.0, "w": 30.0, "h": 40.0},
        {"image": "b.png", "label": "Mass", "x": 0.0, "y": 0.0, "w": 1024.0, "h": 1024.0}]


@pytest.mark.parametrize("row, message", [
    ("a.png,Atelectasis,1,2,0,4,,,", r"row 2 \(a.png, Atelectasis\): not a box"),
    ("a.png,Atelectasis,1,2,x,4,,,", "not a box"),
    ("a.png,Atelectasis,1000,2,30,4,,,", "outside the 1024 x 1024 px image"),
    ("a.png,Cancer,1,2,3,4,,,", r"unknown finding\(s\) \['Cancer'\]"),
])
def test_box_list_refuses_bad_rows_by_name(tmp_path, row, message):
    path = tmp_path / nih.BOX_LIST_NAME
    path.write_text("Image Index,Finding Label,Bbox [x,y,w,h],,,\n" + row + "\n")
    with pytest.raises(nih.NIHError, match=message):
        nih.read_box_list(path)
    path.write_text("image,label,x,y,w,h\n")
    with pytest.raises(nih.NIHError, match="expected the columns"):
        nih.read_box_list(path)


# --------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("width, height, stored, crop", [(300, 200, 64, 32), (160, 240, 48, 40), (128, 128, 64, 32)])
def test_box_maps_through_the_real_preprocessing(width, height, stored, crop):
    """A bright box drawn on an original of any shape, sent through the shard decode (central square,
    resize to the stored side) and the evaluation transform (resize to the crop): it lands where
    to_eval_frame says."""
    box = (width * 0.55, height * 0.3, width * 0.2, height * 0.25)
    img = np.full((height, width), 20, np.uint8)
    x, y, w, h = (int(round(v)) for v in box)
    img[y:y + h, x:x + w] = 230
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    shard = images.decode_grey(buf.getvalue(), name="t.png", size=stored)
    seen = augment.gpu_augment(torch.from_numpy(shard.copy())[None], out_size=crop, train=False, cfg=None, generator=None)[0, 0]
    bright = (seen > seen.min() + 0.5 * (seen.max() - seen.min())).numpy()
    rows, cols = np.flatnonzero(bright.any(axis=1)), np.flatnonzero(bright.any(axis=0))
    x0, y0, x1, y1 = L.to_eval_frame((x, y, w, h), L.Frame(width, height, stored, crop))
    tol = 1.0 + crop / stored     # the resizes' bilinear blur: about a pixel at each edge
    assert abs(cols[0] - x0) <= tol and abs(cols[-1] + 1 - x1) <= tol
    assert abs(rows[0] - y0) <= tol and abs(rows[-1] + 1 - y1) <= tol


def test_box_outside_the_central_square_is_dropped_and_edges_clipped():
    frame = L.Frame(width=400, height=200, stored=100, crop=50)            # square: x 100..300
    assert L.to_eval_frame((10, 10, 50, 50), frame) is None                # left of the square
    assert L.to_eval_frame((80, 0, 40, 20), frame) == (0.0, 0.0, 5.0, 5.0)  # clipped at x=100 -> 0
    assert L.to_eval_frame((100, 100, 200, 100), frame) == (0.0, 25.0, 50.0, 50.0)


# --------------------------------------------------------------------------- scores
def test_pointing_game_iobb_and_baselines_by_hand():
    heat = np.zeros((10, 10))
    heat[1:4, 6:9] = 0.9                 # a 3 x 3 region >= half the maximum: detected box x 6..9, y 1..4
    heat[2, 7] = 1.0                     # the maximum at column 7, row 2
    heat[8, 1] = 0.7                     # a smaller region elsewhere: not the largest
    boxes = [(5.0, 0.0, 10.0, 4.0)]      # x 5..10, y 0..4: covers 5 x 4 of 100 pixel centres
    got = L.score(heat, boxes)
    assert got["hit"] and not got["no_saliency"] and got["point"] == [7.5, 2.5] and got["n_tied"] == 1
    assert got["iobb"] == pytest.approx(1.0)            # the detected box lies inside the reference
    assert got["random_point"] == pytest.approx(0.2) and not got["centre_hit"]    # centre (5, 5): below the box
    got = L.score(heat, [(0.0, 0.0, 7.0, 10.0)])        # x 0..7: the detected box x 6..9 overlaps 1 of 3 columns
    assert not got["hit"] and got["iobb"] == pytest.approx(1 / 3) and got["centre_hit"]
    for flat_map in (np.zeros((10, 10)), np.full((10, 10), 0.3)):      # all zero, or constant: no saliency
        flat = L.score(flat_map, boxes)
        assert flat["no_saliency"] and flat["hit"] is None and flat["point"] == [None, None] and flat["iobb"] == 0.0


def test_tied_maxima_point_at_the_one_nearest_their_centroid_whatever_the_scan_order():
    """A hand-built map with tied maxima inside and outside a box: argmax would take the first in scan
    order (row 1, inside); the rule takes the tied pixel nearest the centroid of all of them, the same
    for the map and its transpose, and says how many tie and how many of them lie in the box."""
    box = [(0.0, 0.0, 4.0, 4.0)]                          # pixel centres of columns and rows 0..3
    heat = np.zeros((10, 10), np.float32)
    heat[1, 1] = heat[1, 2] = 1.0                         # two tied maxima in the box ...
    heat[7, 8] = heat[8, 8] = 1.0                         # ... and two far outside it
    heat[5, 5] = 1.0 - 1e-7                               # within TIE_RTOL of the maximum: ties too
    heat[0, 9] = 0.999                                    # a near maximum that does not tie
    got = L.score(heat, box)
    # centroid (x 4.8, y 4.4): squared distances 26, 19.4, 17, 23.2 and 0.4 -> pixel (5, 5), outside the box
    assert got["point"] == [5.5, 5.5]
    assert (got["n_tied"], got["n_tied_inside"], got["hit"]) == (5, 2, False)
    assert np.unravel_index(np.argmax(heat), heat.shape) == (1, 1)       # argmax alone would have called it a hit
    t = L.score(heat.T.copy(), [(0.0, 0.0, 4.0, 4.0)])
    assert t["point"] == [5.5, 5.5] and t["hit"] is False
    heat[7, 8] = heat[8, 8] = heat[5, 5] = 0.5            # only the two in the box remain: equally near, row-major
    got = L.score(heat, box)
    assert got["point"] == [1.5, 1.5] and got["hit"] and got["n_tied_inside"] == got["n_tied"] == 2


def test_a_hit_needs_a_maximum_in_the_box_and_the_hits_lie_in_their_range():
    """The issue's case: two tied maxima in opposite corners, a box in the middle. Their centroid lies
    in the box, no maximum does: a miss (it was a hit with n_tied_inside 0, beside hits_range [0, 0])."""
    heat = np.zeros((10, 10))
    heat[0, 0] = heat[9, 9] = 1.0
    got = L.score(heat, [(3.0, 3.0, 7.0, 7.0)])
    assert (got["hit"], got["n_tied"], got["n_tied_inside"], got["point"]) == (False, 2, 0, [0.5, 0.5])
    summary = L.summarise([{**got, "no_saliency": False, "patient": "p0"}])
    assert summary["hits"] == 0 and summary["hits_range"] == [0, 0]
    # maps of few levels (many ties) and boxes at random: every map's hit lies between "all tied maxima
    # inside" and "one inside", so the finding's count lies in its range
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(300):
        m = rng.integers(0, 3, (12, 12)).astype(float)
        x0, x1 = np.sort(rng.uniform(0, 12, 2))
        y0, y1 = np.sort(rng.uniform(0, 12, 2))
        boxes = [(x0, y0, x1, y1), (x1, y1, 12.0, 12.0)]
        r = L.score(m, boxes)
        if r["no_saliency"]:
            continue
        assert (r["n_tied_inside"] == r["n_tied"]) <= r["hit"] <= (r["n_tied_inside"] > 0)
        rows.append({**r, "patient": f"p{len(rows) % 40}"})
    summary = L.summarise(rows)
    assert summary["hits_range"][0] <= summary["hits"] <= summary["hits_range"][1] and summary["n_tied"] > 200


def _rows(hits: int, misses: int, flat: int, *, random_point: float | list[float], centres: int,
          patients: list[str] | None = None) -> list[dict]:
    """Maps (hits first, then misses, then flat ones); each its own patient unless ``patients`` says."""
    n = hits + misses
    share = random_point if isinstance(random_point, list) else [random_point] * n
    who = patients or [f"p{k}" for k in range(n + flat)]
    rows = [{"hit": k < hits, "no_saliency": False, "n_tied": 1, "n_tied_inside": int(k < hits), "iobb": 0.5,
             "random_point": share[k], "centre_hit": k < centres, "patient": who[k]} for k in range(n)]
    return rows + [{"hit": None, "no_saliency": True, "n_tied": 0, "n_tied_inside": 0, "iobb": 0.0,
                    "random_point": 0.5, "centre_hit": False, "patient": who[n + k]} for k in range(flat)]


def _poisson_binomial_pmf(shares: list[float]) -> np.ndarray:
    """P(k hits) of independent maps hit with their own probabilities: convolution, one map at a time."""
    pmf = np.array([1.0])
    for p in shares:
        pmf = np.convolve(pmf, [1.0 - p, p])
    return pmf


def test_the_centre_is_a_paired_baseline_mcnemar_on_the_discordant_maps():
    """The issue's Emphysema: 16 of 19 maps hit, the centre 12 of the same 19 (every map the centre
    hits, the heatmap hits too), one map per patient. As a known probability: binomtest p = 0.042,
    "above chance"; paired, the 4 patients only the heatmap hits against the 0 only the centre hits:
    the sign-flip over patients is McNemar's exact test, p = 1/16."""
    from scipy.stats import binomtest
    got = L.summarise(_rows(16, 3, 3, random_point=0.2, centres=12))
    assert (got["n"], got["n_no_saliency"], got["n_pointed"], got["hits"]) == (22, 3, 19, 16)
    assert got["hit_rate"] == pytest.approx(16 / 19) and got["centre_point"] == pytest.approx(12 / 19)
    assert round(binomtest(16, 19, 12 / 19, alternative="greater").pvalue, 3) == 0.042      # the unpaired test
    assert got["discordant"] == [4, 0]
    assert got["p_above_centre"] == pytest.approx(binomtest(4, 4, 0.5, alternative="greater").pvalue) == 0.0625
    assert got["p_above_random"] == pytest.approx(_poisson_binomial_pmf([0.2] * 19)[16:].sum())
    assert got["p_above"] == got["p_above_centre"] and got["verdict"] == "not distinguishable"
    assert "the centre: 12/19 on the same maps, p = 0.0625 (sign-flip over patients)" in got["verdict_text"]
    assert "unit: patients; 19 patients, 19 maps; one-sided, each at 0.025" in got["verdict_text"]
    assert got["ci_interval"] == "patient bootstrap" and got["ci"][0] < 16 / 19 < got["ci"][1]
    # discordant both ways: the centre hits maps 0-2 (with the heatmap) and map 12 (which the heatmap misses)
    rows = _rows(12, 8, 0, random_point=0.1, centres=3)
    rows[12]["centre_hit"] = True
    got = L.summarise(rows)
    only_map = sum(r["hit"] and not r["centre_hit"] for r in rows)
    only_centre = sum(r["centre_hit"] and not r["hit"] for r in rows)
    assert (only_map, only_centre) == (9, 1) and got["discordant"] == [9, 1]
    assert got["p_above_centre"] == pytest.approx(binomtest(9, 10, 0.5, alternative="greater").pvalue)   # 11/1024
    assert got["p_above_centre"] < 0.025 and got["verdict"] == "above chance"


def test_the_random_point_is_a_poisson_binomial_each_map_its_own_share():
    """Each map's box covers its own share of the image: the exact test is the Poisson-binomial, not a
    binomial at the mean share (checked by convolution; the binomial's p differs)."""
    from scipy.stats import binomtest
    shares = [0.02, 0.05, 0.05, 0.1, 0.1, 0.15, 0.3, 0.5, 0.6, 0.03, 0.04, 0.05]
    got = L.summarise(_rows(6, 6, 0, random_point=shares, centres=0))
    pmf = _poisson_binomial_pmf(shares)
    assert got["p_above_random"] == pytest.approx(pmf[6:].sum(), rel=1e-9)
    assert got["p_below"] == pytest.approx(pmf[:7].sum(), rel=1e-9)
    at_mean = binomtest(6, 12, float(np.mean(shares)), alternative="greater").pvalue
    assert abs(at_mean - got["p_above_random"]) > 0.2 * got["p_above_random"]
    # the centre hits none of them: 6 discordant maps, McNemar p = 1/64; above both
    assert got["p_above_centre"] == pytest.approx(0.5 ** 6) and got["verdict"] == "above chance"


def test_one_two_sided_test_at_five_percent_and_the_other_verdicts():
    """The verdict tests once, two-sided at 5%: 2.5% per direction. A one-sided p of 0.03 against both
    baselines would have passed the two one-sided 5% tests; here it does not."""
    shares = [0.3] * 20
    pmf = _poisson_binomial_pmf(shares)
    k = next(k for k in range(21) if pmf[k:].sum() < 0.05)          # 10 of 20: p = 0.048
    got = L.summarise(_rows(k, 20 - k, 0, random_point=shares, centres=0))
    assert got["p_above"] == pytest.approx(pmf[k:].sum()) and 0.025 < got["p_above"] < 0.05
    assert got["verdict"] == "not distinguishable"
    assert got["alpha"] == 0.05
    # few maps: even 5/5 against a 0.6 share gives 0.6 ** 5 = 0.078 >= 0.025
    few = L.summarise(_rows(4, 1, 0, random_point=0.6, centres=0))
    assert few["verdict"] == "too few to tell" and "even every map a hit would not beat" in few["verdict_text"]
    assert few["p_above_random"] == pytest.approx(_poisson_binomial_pmf([0.6] * 5)[4:].sum())
    # the centre hits 4 of 5: all 5 hit would leave 1 discordant map, p >= 1/2
    assert L.summarise(_rows(5, 0, 0, random_point=0.01, centres=4))["verdict"] == "too few to tell"
    below = L.summarise(_rows(1, 29, 0, random_point=0.3, centres=3), auroc_ci=[0.6, 0.7])
    assert below["verdict"] == "below chance" and below["elsewhere"]
    assert below["p_below"] == pytest.approx(_poisson_binomial_pmf([0.3] * 30)[:2].sum())
    assert not L.summarise(_rows(1, 29, 0, random_point=0.3, centres=3), auroc_ci=[0.45, 0.7])["elsewhere"]
    none = L.summarise(_rows(0, 0, 4, random_point=0.3, centres=0))
    assert none["verdict"] == "no saliency" and none["hit_rate"] is None and none["n_no_saliency"] == 4
    assert L.summarise([])["hit_rate"] is None


# --------------------------------------------------------------------------- Grad-CAM
def _gradcam_by_definition(model, layer, x, targets):
    """Selvaraju et al.: ReLU(sum_k mean_ij(dy/dA_k) A_k), upsampled bilinearly."""
    acts = {}
    handle = layer.register_forward_hook(lambda m, i, out: acts.__setitem__("a", out))
    out = model(x)
    handle.remove()
    a = acts["a"]
    grads = torch.autograd.grad(out[torch.arange(len(targets)), torch.tensor(targets)].sum(), a)[0]
    cam = torch.relu((grads.mean(dim=(2, 3), keepdim=True) * a).sum(dim=1, keepdim=True))
    return torch.nn.functional.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]


def test_gradcam_matches_its_definition_and_the_layer_is_chosen_by_resolution():
    torch.manual_seed(0)
    model = build_model("resnet18", in_channels=1, num_outputs=14).eval()
    name, layer, side = saliency.choose_layer(model, crop=32, in_channels=1, min_side=7, device="cpu")
    assert (name, side) == ("layer1", 8)                 # 32 px: layer4 is 1 x 1, layer1 8 x 8
    assert saliency.choose_layer(model, crop=224, in_channels=1, min_side=7, device="cpu")[::2] == ("layer4", 7)
    assert saliency.choose_layer(model, crop=32, in_channels=1, min_side=7, device="cpu", layer="layer3")[2] == 2
    with pytest.raises(ValueError, match="not a backbone stage"):
        saliency.choose_layer(model, crop=32, in_channels=1, min_side=7, device="cpu", layer="fc")
    x = torch.randn(5, 1, 32, 32)
    targets = [0, 3, 13, 3, 7]
    got = saliency.gradcam(model, layer, x, targets, batch_size=2)
    want = _gradcam_by_definition(model, layer, x, targets).detach().numpy()
    assert got.shape == (5, 32, 32) and got.min() >= 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max()))


# --------------------------------------------------------------------------- subgroups
def _table(tmp_path, n):
    rng = np.random.default_rng(1)
    rows = pd.DataFrame({"Image Index": [f"i{k}.png" for k in range(n)], "Finding Labels": "No Finding",
                         "Patient ID": [str(k // 2) for k in range(n)],
                         "Patient Age": rng.integers(5, 95, n).astype(str),
                         "Patient Gender": rng.choice(["M", "F"], n), "View Position": rng.choice(["PA", "AP"], n)})
    rows.loc[0, "Patient Age"] = "414"       # the 2017 table's impossible ages
    rows.loc[1, "Patient Gender"] = "X"
    rows.loc[2, "View Position"] = "LL"
    path = tmp_path / nih.LABEL_CSV_NAME
    rows.to_csv(path, index=False)
    return path, rows


def test_subgroup_fields_are_checked_and_aurocs_match_scikit_learn(tmp_path):
    n = 400
    path, rows = _table(tmp_path, n)
    order = list(rows["Image Index"][::-1])          # the test order is not the table's
    fields = subgroups.read_fields(path, order, age_edges=(18, 40, 60, 80))
    assert fields.loc["i0.png", "age_band"] is None and fields.loc["i1.png", "sex"] is None
    assert fields.loc["i2.png", "view"] is None and fields.loc["i3.png", "view"] in ("PA", "AP")
    age = int(rows.loc[5, "Patient Age"])
    want_band = "<18" if age < 18 else ">=80" if age >= 80 else next(f"{a}-{b - 1}" for a, b in ((18, 40), (40, 60), (60, 80)) if a <= age < b)
    assert fields.loc["i5.png", "age_band"] == want_band
    rng = np.random.default_rng(2)
    y = (rng.random((n, 2)) < 0.3).astype(float)
    y[:, 1] = 0.0
    y[:3, 1] = 1.0                                         # finding B: 3 positives in all
    s = y + rng.normal(size=y.shape)
    patients = np.array([str(k // 2) for k in range(n)])[::-1]
    groups = subgroups.subgroup_aurocs(y, s, patients, ["A", "B"], fields, age_edges=(18, 40, 60, 80),
                                       min_count=5, n_resamples=200, seed=0)
    male = next(g for g in groups if g["group"] == "male")
    sel = (fields["sex"] == "male").to_numpy()
    assert male["n_images"] == sel.sum() and male["labels"]["A"]["auroc"] == pytest.approx(roc_auc_score(y[sel, 0], s[sel, 0]))
    assert male["mean_labels"] == ["A"] and male["mean_auroc"] == pytest.approx(male["labels"]["A"]["auroc"])
    lo, hi = male["mean_ci"]
    assert lo < male["mean_auroc"] < hi
    b = male["labels"]["B"]
    assert b["ci"] is None and (b["note"].startswith("too few: ") or b["note"] == "one class only")
    unknown = next(g for g in groups if g["attribute"] == "sex" and g["group"] == "unknown")
    assert unknown["n_images"] == 1
    with pytest.raises(subgroups.SubgroupError, match="have no row"):
        subgroups.read_fields(path, ["nope.png"], age_edges=(18,))
    rows.drop(columns=["View Position"]).to_csv(path, index=False)
    with pytest.raises(subgroups.SubgroupError, match=r"missing column\(s\) \['View Position'\]"):
        subgroups.read_fields(path, order, age_edges=(18,))


def test_subgroup_ci_rule_counts_patients_not_images(tmp_path):
    """The issue's female Hernia: 7 positive images of 1 patient get no CI; 5 positive patients do."""
    n = 60
    table = pd.DataFrame({"Image Index": [f"i{k}.png" for k in range(n)], "Finding Labels": "No Finding",
                          "Patient ID": [str(k) for k in range(n)], "Patient Age": "50",
                          "Patient Gender": "F", "View Position": "PA"})
    path = tmp_path / nih.LABEL_CSV_NAME
    table.to_csv(path, index=False)
    images = list(table["Image Index"])
    patients = np.array([f"p{k}" for k in range(n)], dtype=object)
    patients[:7] = "p0"                                    # images 0..6: one patient
    y = np.zeros((n, 2))
    y[:7, 0] = 1.0                                          # A: 7 positive images, 1 positive patient
    y[10:15, 1] = 1.0                                       # B: 5 positive images of 5 patients
    s = y + np.random.default_rng(0).normal(size=y.shape)
    fields = subgroups.read_fields(path, images, age_edges=(18, 40, 60, 80))
    groups = subgroups.subgroup_aurocs(y, s, patients, ["A", "B"], fields, age_edges=(18, 40, 60, 80),
                                       min_count=5, n_resamples=200, seed=0)
    female = next(g for g in groups if g["group"] == "female")
    a, b = female["labels"]["A"], female["labels"]["B"]
    assert (a["n_pos"], a["n_pos_patients"], a["n_neg_patients"]) == (7, 1, n - 7)
    assert a["ci"] is None and a["auroc"] == pytest.approx(roc_auc_score(y[:, 0], s[:, 0]))
    assert a["note"] == "too few: 1 positive / 53 negative patients (5 of each needed)"
    assert (b["n_pos"], b["n_pos_patients"]) == (5, 5) and b["ci"] is not None and b["note"] == ""
    assert female["mean_labels"] == ["B"]


def test_maps_cluster_by_patient_so_the_verdict_counts_patients():
    """The issue's Pneumothorax shape: 28 maps of one patient all hit, one map each of 6 others all miss,
    boxes covering a tenth of each map, the centre never in a box. Counted as 34 independent maps it is
    28 hits against 3.4 expected (p ~ 1e-20). Per patient the hit shares are 1, 0, 0, 0, 0, 0, 0: mean 1/7
    against 0.1, Hoeffding's bound exp(-7 KL(1/7 || 0.1)) = exp(-7 x 0.009134) = 0.938; the centre: one
    patient differs, sign-flip p = 1/2. Not distinguishable, and the text names the unit and its counts."""
    rows = _rows(28, 6, 0, random_point=0.1, centres=0, patients=["a"] * 28 + [f"b{k}" for k in range(6)])
    got = L.summarise(rows, min_patients=5)
    assert got["p_above_random"] == pytest.approx(0.93806, abs=1e-4) and got["p_above_centre"] == 0.5
    assert got["verdict"] == "not distinguishable" and got["n_patients"] == 7 and got["unit"] == "patient"
    assert "unit: patients; 7 patients, 34 maps" in got["verdict_text"]
    assert got["test_random"] == "Hoeffding's bound on the mean of the patients' hit shares"
    # 7 patients of 2 maps, every map a hit: 0.1 ** 7 against the random point, 2 ** -7 against the centre
    both = L.summarise(_rows(14, 0, 0, random_point=0.1, centres=0, patients=[f"p{k // 2}" for k in range(14)]))
    assert both["p_above_random"] == pytest.approx(1e-7) and both["p_above_centre"] == pytest.approx(1 / 128)
    assert both["verdict"] == "above chance" and both["verdict_text"].startswith(
        "the heatmap's peak falls in the box more often than a random point and than the image centre")
    # 3 maps each, all missed, boxes covering 0.3: 10 patients give 0.7 ** 10 = 0.028 (not below at 0.025;
    # as 30 independent maps it would be 0.7 ** 30 = 2e-5), 11 patients 0.7 ** 11 = 0.0198: below chance
    ten = L.summarise(_rows(0, 30, 0, random_point=0.3, centres=0, patients=[f"p{k // 3}" for k in range(30)]))
    assert ten["p_below"] == pytest.approx(0.7 ** 10) and ten["verdict"] == "not distinguishable"
    eleven = L.summarise(_rows(0, 33, 0, random_point=0.3, centres=0, patients=[f"p{k // 3}" for k in range(33)]))
    assert eleven["p_below"] == pytest.approx(0.7 ** 11) and eleven["verdict"] == "below chance"
    assert "less often than a random point (unit: patients; 11 patients, 33 maps" in eleven["verdict_text"]
    for word in ("because", "reaches its AUROC", "other cues"):
        assert word not in eleven["verdict_text"]


def test_below_the_minimum_of_patients_no_verdict_and_no_interval():
    got = L.summarise(_rows(8, 0, 0, random_point=0.1, centres=0, patients=[f"p{k // 2}" for k in range(8)]),
                      min_patients=5)
    assert got["verdict"] == "too few" and got["verdict_text"] == "too few: 4 patients (5 needed), 8 maps: no verdict"
    assert got["p_above"] is None and got["ci"] is None and got["mean_iobb_ci"] is None and got["hits"] == 8
    assert got["too_few"] == "too few: 4 patients (5 needed)"


def test_a_non_finite_pixel_is_refused_and_the_centre_uses_pixel_centres():
    heat = np.zeros((10, 10))
    heat[2, 3] = 1.0
    for bad in (np.nan, np.inf):
        broken = heat.copy()
        broken[7, 7] = bad
        with pytest.raises(L.SaliencyError, match=r"^img.png \(Mass\): 1 of 100 Grad-CAM pixels are NaN or infinite"):
            L.score(broken, [(0.0, 0.0, 5.0, 5.0)], where="img.png (Mass)")
    # a box smaller than a pixel around the image's corner point (5, 5) holds no pixel centre: share 0,
    # and the centre (pixel 5, 5, its centre at 5.5) misses it too
    tiny = L.score(heat, [(4.9, 4.9, 5.1, 5.1)])
    assert tiny["random_point"] == 0.0 and tiny["centre_hit"] is False
    assert L.score(heat, [(5.2, 5.2, 5.8, 5.8)])["centre_hit"] is True      # holds the centre pixel's centre
