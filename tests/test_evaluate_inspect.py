"""`chexflow evaluate` and `chexflow report` on a small demo release, end to end through the CLI
(issue 19): calibration, PR, NPV, subgroups and localisation checked against independent
computations from the files the evaluation wrote (scikit-learn, the label table, the box list), and
the report's new sections and the model card, also in the real headless Chromium."""
from __future__ import annotations

import html as html_lib
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import average_precision_score, brier_score_loss, roc_auc_score, roc_curve

from chexflow.data import nih
from chexflow.train import checkpoint as ckpt
from chexflow.train.models import build_model
from conftest import build_demo_dataset, cli_env, module_scratch
from test_report import CHROMIUM, _table

CROP = 32


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, request):
    with module_scratch(tmp_path_factory, request, "inspect") as root:
        manifest = build_demo_dataset(root)
        torch.manual_seed(0)
        model = build_model("resnet18", in_channels=1, num_outputs=14)
        ckpt.save_atomic(ckpt.model_record(
            state_dict=model.state_dict(), run_id="inspect0", stage="finetune", dataset="nih_demo", task="multilabel",
            labels=list(nih.LABELS), arch="resnet18", in_channels=1, crop=CROP, epoch=2, val_metric=0.5,
            val_metric_name="mean_auroc", config={"init": "random", "seed": 0}), root / "model.pt")
        cfg = {"batch_size": 64, "bootstrap_resamples": 100, "seed": 0, "min_patients": 2,
               "saliency": {"top_k": 2}}
        raw = root / "raw"
        proc = subprocess.run(
            [sys.executable, "-m", "chexflow", "evaluate", "--config-json", json.dumps(cfg), "--model", str(root / "model.pt"),
             "--manifest", str(manifest), "--out-dir", str(root / "evaluate"), "--label-table", str(raw / nih.LABEL_CSV_NAME),
             "--boxes", str(raw / nih.BOX_LIST_NAME), "--box-frame", "32"],
            env=cli_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield root


def _metrics(root: Path) -> dict:
    return json.loads((root / "evaluate" / "metrics.json").read_text())


def test_calibration_pr_and_npv_match_scikit_learn(evaluated):
    m = _metrics(evaluated)
    pred = pd.read_csv(evaluated / "evaluate" / "predictions.csv")
    checked = 0
    for label, e in m["labels"].items():
        known = pred[label].notna()
        y, s = pred.loc[known, label].to_numpy(int), pred.loc[known, f"{label}_score"].to_numpy(float)
        if np.unique(y).size < 2:
            assert "calibration" not in e
            continue
        assert e["auprc"] == pytest.approx(average_precision_score(y, s), abs=1e-4)
        assert e["calibration"]["brier"] == pytest.approx(brier_score_loss(y, s), abs=1e-5)
        assert sum(b["count"] for b in e["calibration"]["bins"]) == len(y)
        if "test_operating_point" in e:
            op = e["test_operating_point"]
            if e["operating_point_split"] == "validation":
                thr = e["threshold_val_youden"]
                assert e["threshold_few_positives"] == (min(e["val_positives"], e["val_positive_patients"]) < 10)
            else:                     # one class in validation: evaluation's fallback, Youden's J on test
                assert e["operating_point_split"] == "test" and "threshold_val_youden" not in e
                fpr, tpr, _ = roc_curve(y, s)
                thr = op["threshold"]
                assert op["sensitivity"] + op["specificity"] - 1 == pytest.approx(max(tpr - fpr), abs=1e-6)
            neg_pred = s < thr
            if neg_pred.sum() and abs(s - thr).min() > 1e-5:        # no score at the rounded threshold
                assert op["npv"] == pytest.approx((y[neg_pred] == 0).mean())
        assert e["n_pos_patients"] == pred.loc[known & (pred[label] == 1), "patient"].nunique()
        checked += 1
    assert checked >= 10


def test_subgroups_match_the_label_table(evaluated):
    m = _metrics(evaluated)
    pred = pd.read_csv(evaluated / "evaluate" / "predictions.csv")
    table = pd.read_csv(evaluated / "raw" / nih.LABEL_CSV_NAME).set_index("Image Index")
    sex = table.loc[pred["image"], "Patient Gender"].to_numpy()
    groups = {(g["attribute"], g["group"]): g for g in m["subgroups"]["groups"]}
    for code, name in (("F", "female"), ("M", "male")):
        g, sel = groups[("sex", name)], sex == code
        assert g["n_images"] == sel.sum() and g["n_patients"] == pred.loc[sel, "patient"].nunique()
        for label, e in g["labels"].items():
            y, s = pred.loc[sel, label], pred.loc[sel, f"{label}_score"]
            pos_pat = pred.loc[sel & (pred[label] == 1), "patient"].nunique()
            neg_pat = pred.loc[sel & (pred[label] == 0), "patient"].nunique()
            assert (e["n_pos_patients"], e["n_neg_patients"]) == (pos_pat, neg_pat)
            if y.nunique() == 2:
                assert e["auroc"] == pytest.approx(roc_auc_score(y, s), abs=1e-4)
                assert (e["ci"] is None) == (min(pos_pat, neg_pat) < 2)     # the rule counts patients
            else:
                assert e["auroc"] is None and e["note"] == "one class only"
    view = table.loc[pred["image"], "View Position"].to_numpy()
    assert groups[("view", "PA")]["n_images"] + groups[("view", "AP")]["n_images"] == np.isin(view, ["PA", "AP"]).sum()
    rows = pd.read_csv(evaluated / "evaluate" / "subgroups.csv")
    assert set(rows["attribute"]) == {"sex", "age_band", "view"}


def test_localisation_scores_every_boxed_positive_of_the_test_split(evaluated):
    m = _metrics(evaluated)
    pred = pd.read_csv(evaluated / "evaluate" / "predictions.csv").set_index("image")
    boxes = nih.read_box_list(evaluated / "raw" / nih.BOX_LIST_NAME, frame=32)
    boxes = boxes[boxes["image"].isin(pred.index)]
    positive = [pred.loc[r.image, r.label] == 1 for r in boxes.itertuples()]
    want = boxes[positive].groupby("label")["image"].nunique()
    loc = m["localisation"]
    assert loc["layer"] == "layer1" and loc["layer_side"] == 8 and loc["crop"] == CROP
    got = {label: e["n"] for label, e in loc["labels"].items() if e["n"]}
    assert got == want.to_dict()
    rows = pd.read_csv(evaluated / "evaluate" / "localisation.csv")
    for label, e in loc["labels"].items():
        mine = rows[rows["label"] == label]
        pointed = mine[~mine["no_saliency"].astype(bool)]
        assert (e["n"], e["n_no_saliency"], e["n_pointed"]) == (len(mine), len(mine) - len(pointed), len(pointed))
        assert e["hits"] == int((pointed["hit"].astype(str) == "True").sum())
        assert mine.loc[mine["no_saliency"].astype(bool), "hit"].isna().all()     # no saliency: neither hit nor miss
        if len(pointed):
            assert e["random_point"] == pytest.approx(pointed["random_point"].mean(), abs=1e-5)
            # patients are the unit: per patient its share of hits, the centre's, a random point's
            per = pd.DataFrame({"patient": pointed["patient"].astype(str), "h": pointed["hit"].astype(str) == "True",
                                "e": pointed["centre_hit"].astype(str) == "True",
                                "c": pointed["random_point"]}).groupby("patient").mean()
            d = (per["h"] - per["e"]).to_numpy()
            d = d[d != 0]
            assert e["n_patients"] == len(per) and e["unit"] == "patient"
            if e["verdict"] == "too few":             # the small-count rule: no test, no verdict
                assert len(per) < m["min_patients"] and e["p_above"] is None and e["discordant"] is None
                continue
            assert e["discordant"] == [int((per["h"] > per["e"]).sum()), int((per["h"] < per["e"]).sum())]
            if 0 < d.size <= 12:                # the sign-flip test by enumeration of every sign pattern
                sums = np.array([np.dot(d, signs) for signs in itertools.product((1, -1), repeat=d.size)])
                assert e["p_above_centre"] == pytest.approx(np.mean(sums >= d.sum() - 1e-12))
            if (pointed.groupby("patient").size() == 1).all():
                pmf = np.array([1.0])               # Poisson-binomial by convolution, one map at a time
                for share in pointed["random_point"]:
                    pmf = np.convolve(pmf, [1.0 - share, share])
                assert e["p_above_random"] == pytest.approx(pmf[e["hits"]:].sum(), rel=1e-4, abs=1e-12)
            elif per["h"].mean() > per["c"].mean():    # Hoeffding's bound on the patients' mean hit share
                a, b = per["h"].mean(), per["c"].mean()
                kl = a * np.log(a / b) + ((1 - a) * np.log((1 - a) / (1 - b)) if a < 1 else 0.0)
                assert e["p_above_random"] == pytest.approx(np.exp(-len(per) * kl), rel=1e-4)
            assert e["hits_range"][0] <= e["hits"] <= e["hits_range"][1]
    # the gallery's heatmaps point where localisation.csv says: the tied maximum nearest their centroid
    with np.load(evaluated / "evaluate" / "saliency.npz", allow_pickle=False) as z:
        meta, heat = json.loads(str(z["meta"])), z["heatmaps"].astype(float)
    assert meta and {x["kind"] for x in meta} <= {"TP", "FP"}
    by = rows.set_index(["image", "label"])
    checked = 0
    for k, x in enumerate(meta):
        if x["boxes"]:
            row = by.loc[(x["image"], x["label"])]
            if row["no_saliency"]:
                assert x["point"] == [None, None]
                continue
            px, py = x["point"]
            assert (px, py) == pytest.approx((row["point_x"], row["point_y"]), abs=1e-5)
            hit = any(x0 <= px <= x1 and y0 <= py <= y1 for x0, y0, x1, y1 in x["boxes"])
            assert str(row["hit"]) == str(hit)
            near = np.argwhere(heat[k] >= heat[k].max() * (1 - 2e-3))       # float16 in the gallery
            assert near[:, 1].min() + 0.5 <= px <= near[:, 1].max() + 0.5
            checked += 1
    assert checked


def _underdiagnosis_by_hand(root: Path) -> dict:
    """Image- and patient-level underdiagnosis from predictions.csv, the thresholds in metrics.json and
    the label table, with pandas: overall and by sex (an image positive only for findings without a
    threshold has no finding the call could flag: set aside)."""
    m = _metrics(root)
    pred = pd.read_csv(root / "evaluate" / "predictions.csv", dtype={"patient": str})
    call = m["underdiagnosis"]["call"]          # chosen on validation: the highest score of its findings below it
    used = call["findings"]
    assert used == [lab for lab, e in m["labels"].items() if "threshold_val_youden" in e]
    pred["finding"] = (pred[used] == 1).any(axis=1)      # the findings the call uses: truth and call alike
    pred["called_none"] = pred[[f"{lab}_score" for lab in used]].max(axis=1) < call["threshold"]
    table = pd.read_csv(root / "raw" / nih.LABEL_CSV_NAME).set_index("Image Index")
    pred["sex"] = table.loc[pred["image"], "Patient Gender"].map({"M": "male", "F": "female"}).to_numpy()
    out = {}
    for name, part in [("all", pred), *[(sex, pred[pred["sex"] == sex]) for sex in ("male", "female")]]:
        f = part[part["finding"]]
        per_patient = f.groupby("patient")["called_none"].all()
        out[name] = (len(f), int(f["called_none"].sum()), len(per_patient), int(per_patient.sum()))
    return out


def test_underdiagnosis_matches_the_predictions(evaluated):
    m = _metrics(evaluated)
    rec = m["underdiagnosis"]
    want = _underdiagnosis_by_hand(evaluated)
    cells = {"all": rec["overall"], **{g["group"]: g for g in rec["groups"] if g["attribute"] == "sex"}}
    for name, (n_img, missed_img, n_pat, missed_pat) in want.items():
        c = cells[name]
        assert (c["image"]["n"], c["image"]["missed"], c["patient"]["n"], c["patient"]["missed"]) == \
            (n_img, missed_img, n_pat, missed_pat), name
        if c["patient"]["ci"]:
            assert c["patient"]["ci"][0] <= c["patient"]["rate"] <= c["patient"]["ci"][1]
    assert n_img > 0 and rec["labels_used"]
    pred = pd.read_csv(evaluated / "evaluate" / "predictions.csv")
    aside = (pred[rec["labels_without_threshold"]] == 1).any(axis=1) & ~(pred[rec["labels_used"]] == 1).any(axis=1)
    assert rec["set_aside"]["images"] == pred.loc[aside, "image"].tolist()
    rows = pd.read_csv(evaluated / "evaluate" / "underdiagnosis.csv")
    assert rows.loc[0, "kind"] == "overall" and rows.loc[0, "images_missed"] == want["all"][1]
    assert set(rows["kind"]) == {"overall", "subgroup", "intersection"}
    assert rows.loc[0, "image_rate"] == pytest.approx(want["all"][1] / want["all"][0], abs=1e-5)


def _report(root: Path, out: Path) -> subprocess.CompletedProcess:
    ev, train = root / "evaluate", root / "train.jsonl"
    train.write_text("".join(json.dumps({"epoch": e, "train_loss": 1 / e, "val_metric": 0.5, "val_metric_name": "mean_auroc",
                                         "world_size": 1}) + "\n" for e in (1, 2, 3)))
    tree = {"evaluation": {"metrics": str(ev / "metrics.json"), "predictions": str(ev / "predictions.csv"),
                           "saliency": str(ev / "saliency.npz")},
            "training": {"pretrain": str(train), "finetune": str(train)},
            "manifests": {"finetune": str(root / "shards" / "manifest.json")}}
    return subprocess.run([sys.executable, "-m", "chexflow", "report", "--out", str(out), "--model-card",
                           str(out.with_name("model_card.md")), "--inputs-json", json.dumps(tree)],
                          env=cli_env(), capture_output=True, text=True, timeout=600)


def test_report_sections_and_model_card(evaluated, tmp_path):
    proc = _report(evaluated, tmp_path / "report.html")
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (tmp_path / "report.html").read_text()
    m = _metrics(evaluated)
    for section in ("calibration", "subgroups", "underdiagnosis", "localisation", "published", "model-card"):
        assert f'id="{section}"' in html
    loc = {r[0]: r for r in _table(html, "localisation-table")["tbody"]}
    for label, e in m["localisation"]["labels"].items():
        if e["n"]:
            assert loc[label.replace("_", " ")][1:4] == [str(e["n"]), str(e["n_no_saliency"]),
                                                        f"{e['hits']} / {e['n_pointed']}"]
            assert loc[label.replace("_", " ")][-1].endswith(e["verdict_text"])
    und = _table(html, "underdiagnosis-table")["tbody"]
    overall = m["underdiagnosis"]["overall"]
    assert und[0][:5] == ["All test images", "", str(overall["image"]["n"]), str(overall["image"]["missed"]),
                          f"{overall['image']['rate']:.3f}"]
    assert und[0][6:9] == [str(overall["patient"]["n"]), str(overall["patient"]["missed"]),
                           f"{overall['patient']['rate']:.3f}"]
    pub = {r[0]: r for r in _table(html, "published-table")["tbody"]}
    assert pub["EVA-X-B (ViT-B/16)"][1] == "0.835" and pub["Medical MAE (ViT-S/16)"][1] == "0.823"
    assert pub["XProtoNet"][1] == "0.822" and "official NIH split lists" in pub["XProtoNet"][2]
    assert "for orientation only" in html.split('id="published"')[1].split("</section>")[0]
    sub = _table(html, "subgroup-table")["tbody"]
    assert [r[:3] for r in sub[:2]] == [["Sex", g["group"], str(g["n_images"])] for g in m["subgroups"]["groups"][:2]]
    assert "The model tested is epoch 2's" in html and "tested model: epoch 2" in html
    card = (tmp_path / "model_card.md").read_text()
    assert card.startswith("# Model card: resnet18 fine-tuned on") and "SYNTHETIC" in card
    for head in ("## Data and split", "## Training recipe", "## Test metrics", "## Calibration and operating points",
                 "## Subgroups", "## Underdiagnosis", "## Localisation", "## Intended use",
                 "## Limitations this run shows"):
        assert head in card
    o = overall
    assert (f"| All test images | {o['image']['n']} | {o['image']['rate']:.3f} | "
            f"{o['image']['ci'][0]:.3f}-{o['image']['ci'][1]:.3f} | {o['patient']['n']} | {o['patient']['rate']:.3f} |") in card
    assert "EVA-X-B (ViT-B/16) 0.835" in card and "XProtoNet 0.822" in card
    no_ci = [(g, lab, e) for g in m["subgroups"]["groups"] for lab, e in g["labels"].items()
             if e["auroc"] is not None and e["ci"] is None]
    g, lab, e = no_ci[0]          # a cell below the rule: its AUROC without a CI, and why, in the card
    assert f"{lab.replace('_', ' ')} ({e['n_pos_patients']} pos. / {e['n_neg_patients']} neg. patients)" in card
    atel = m["labels"]["Atelectasis"]
    assert f"| Atelectasis | {atel['auroc']:.3f} | {atel['ci'][0]:.3f}-{atel['ci'][1]:.3f} |" in card
    assert "Not a medical device" in card and card in html_lib.unescape(html)


@pytest.mark.slow
def test_new_sections_render_in_headless_chromium(evaluated, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    assert _report(evaluated, tmp_path / "report.html").returncode == 0
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", (tmp_path / "report.html").as_uri()], check=True, capture_output=True,
                         text=True, timeout=180).stdout
    m = _metrics(evaluated)
    scored = [lab for lab, e in m["localisation"]["labels"].items() if e["n"]]
    assert len(_table(dom, "localisation-table")["tbody"]) == len(m["localisation"]["labels"]) and scored
    assert len(_table(dom, "calibration-table")["tbody"]) == 14
    und = m["underdiagnosis"]
    shown = 1 + len(und["groups"]) + sum(not c["too_few"] for c in und["intersections"])
    assert len(_table(dom, "underdiagnosis-table")["tbody"]) == shown
    assert len(_table(dom, "published-table")["tbody"]) == 7 and "XProtoNet" in dom
    assert 'alt="Grad-CAM of' in dom and 'alt="Reliability diagrams per label"' in dom
    assert "Model card: resnet18" in dom
