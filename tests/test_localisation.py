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

from chexflow.data import images, loader, nih
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
    seen = loader.gpu_augment(torch.from_numpy(shard.copy())[None], out_size=crop, train=False, cfg=None, generator=None)[0, 0]
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
    assert got["hit"] and not got["flat"] and got["point"] == [7, 2]
    assert got["iobb"] == pytest.approx(1.0)            # the detected box lies inside the reference
    assert got["random_point"] == pytest.approx(0.2) and not got["centre_hit"]    # centre (5, 5): below the box
    got = L.score(heat, [(0.0, 0.0, 7.0, 10.0)])        # x 0..7: the detected box x 6..9 overlaps 1 of 3 columns
    assert not got["hit"] and got["iobb"] == pytest.approx(1 / 3) and got["centre_hit"]
    flat = L.score(np.zeros((10, 10)), boxes)
    assert flat["flat"] and not flat["hit"] and flat["iobb"] == 0.0


def test_summary_hit_rate_ci_and_chance():
    rows = [{"hit": k < 8, "flat": False, "iobb": 0.5, "random_point": 0.1, "centre_hit": k < 2} for k in range(10)]
    got = L.summarise(rows)
    assert (got["n"], got["hits"], got["hit_rate"]) == (10, 8, 0.8)
    z, p, n = 1.959963984540054, 0.8, 10                 # Wilson by hand
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert got["ci"] == pytest.approx([centre - half, centre + half])
    assert got["chance"] == pytest.approx(0.2) and got["above_chance"]       # max(random 0.1, centre 0.2)
    worse = L.summarise([{**r, "hit": k < 2} for k, r in enumerate(rows)])
    assert not worse["above_chance"]
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
    assert b["ci"] is None and ("too few for a CI" in b["note"] or b["note"] == "one class only")
    unknown = next(g for g in groups if g["attribute"] == "sex" and g["group"] == "unknown")
    assert unknown["n_images"] == 1
    with pytest.raises(subgroups.SubgroupError, match="have no row"):
        subgroups.read_fields(path, ["nope.png"], age_edges=(18,))
    rows.drop(columns=["View Position"]).to_csv(path, index=False)
    with pytest.raises(subgroups.SubgroupError, match=r"missing column\(s\) \['View Position'\]"):
        subgroups.read_fields(path, order, age_edges=(18,))
