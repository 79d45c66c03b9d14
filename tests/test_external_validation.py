"""Label-table datasets and external validation through the real chain, once: a CheXpert mirror in
Stanford's layout and a CSV-described folder of PNG, JPEG and DICOM phantoms (tests/folder_datasets.py),
from the mirror to the report in one ``snakemake`` run (module fixture): pretraining on the NIH-layout
phantom corpus, fine-tuning on CheXpert from it, evaluation, external validation on the CSV folder,
report. The assertions read what that run wrote, against the tables as generated. Besides: the
docs' example (NIH -> fine-tune -> external validation on CheXpert) parses and plans."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from sklearn.metrics import roc_auc_score

from chexflow.data import chexpert, labelmap
from conftest import REPO, job_counts, module_scratch, snakemake
from folder_datasets import CSV_FINDINGS, make_chexpert, make_csv_folder

POLICY = {"default": "ignore", "Atelectasis": "ones"}


def _config(mirror: Path, folder) -> dict:
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["study"]["finetune_dataset"] = "chexpert"
    cfg["datasets"]["chexpert"] = {"mirror": str(mirror)}
    cfg["datasets"]["hospital_b"] = folder.declaration()
    tiny = {"image_size": 64, "samples_per_shard": 64, "train_parts": 1, "max_reject_fraction": 0.0}
    cfg["shards"]["chexpert"] = {**tiny, "val_fraction": 0.25, "uncertain": POLICY, "views": "frontal"}
    cfg["shards"]["hospital_b"] = tiny
    # the shortest NIH-layout pretraining: 120 phantoms of 32 px, one epoch
    cfg["demo_pretrain_release"] = {"n_images": 120, "image_size": 32, "images_per_archive": 120, "test_fraction": 0.1,
                                    "seed": 7}
    cfg["shards"]["nih_demo_pretrain"] = {"image_size": 32, "samples_per_shard": 200, "val_fraction": 0.15,
                                          "max_reject_fraction": 0.0}
    cfg["training"]["backend"] = "single"
    cfg["pretrain"].update(epochs=1, batch_size=32)
    cfg["finetune"].update(epochs=1, batch_size=16)
    cfg["evaluate"].update(bootstrap_resamples=100, external=["hospital_b"])
    cfg["evaluate"]["saliency"]["top_k"] = 1
    cfg["ablation"]["enabled"] = False
    return cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory, request):
    with module_scratch(tmp_path_factory, request, "external") as root:
        mirror = make_chexpert(root / "mirror")
        folder = make_csv_folder(root / "hospital_b")
        work = root / "work"
        work.mkdir()
        (work / "config.yaml").write_text(yaml.safe_dump(_config(mirror.root, folder)))
        proc = snakemake(work, "--configfile", str(work / "config.yaml"), timeout=1200)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        yield {"work": work, "mirror": mirror, "folder": folder, "jobs": job_counts(proc.stdout + proc.stderr)}


def _json(run, rel: str) -> dict:
    return json.loads((run["work"] / rel).read_text())


def _frontal(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["Frontal/Lateral"] == "Frontal"]


def _truth(cell: str, policy: str) -> float:
    """A table's cell as a target, worked out here from CheXpert's convention (not through chexflow)."""
    return {"1.0": 1.0, "0.0": 0.0, "": 0.0, "-1.0": {"ones": 1.0, "zeros": 0.0, "ignore": np.nan}[policy]}[cell]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_chexpert_mirror_to_shards_with_its_policy(run):
    """Downloaded tables, shards by the policy: laterals left out, valid.csv the test split, uncertain
    labels unknown where the policy says ignore (counted in the manifest), no patient in two splits."""
    assert run["jobs"]["download_file"] == 4 + 2 + 1 and run["jobs"]["evaluate_external"] == 1
    m = _json(run, "data/shards/chexpert/manifest.json")
    train_rows, valid_rows = (_frontal(run["mirror"].rows[t]) for t in ("train", "valid"))
    assert m["splits"]["test"]["n_images"] == len(valid_rows) and m["n_rejects"] == 0
    assert m["splits"]["train"]["n_images"] + m["splits"]["val"]["n_images"] == len(train_rows)
    assert m["labelling"]["uncertain"] == {label: POLICY.get(label, "ignore") for label in chexpert.LABELS}
    assert m["labelling"]["views"] == "frontal" and m["split_source"] == chexpert.SPLIT_SOURCE
    for label in chexpert.LABELS:
        policy = POLICY.get(label, "ignore")
        unknown = sum(np.isnan(_truth(r[label], policy)) for r in train_rows)
        got = sum((m["splits"][s].get("unknown_counts") or {}).get(label, 0) for s in ("train", "val"))
        assert got == unknown, label
        assert sum(m["splits"][s]["label_counts"][label] for s in ("train", "val")) == \
            sum(_truth(r[label], policy) == 1.0 for r in train_rows)
    splits = pd.read_csv(run["work"] / "data/shards/chexpert/splits.csv", dtype=str, keep_default_na=False)
    assert splits.groupby("patient")["split"].nunique().max() == 1
    assert set(splits.loc[splits["split"] == "test", "image"]) == \
        {r["Path"].removeprefix("CheXpert-v1.0-small/") for r in valid_rows}
    assert not splits["image"].str.contains("lateral").any()


@pytest.mark.slow
def test_fine_tuned_from_the_nih_pretrained_model_and_evaluated_on_known_labels(run):
    log = (run["work"] / "logs/finetune/train.log").read_text()
    assert re.search(r"initialised \d+ backbone tensors from results/pretrain/model.pt", log)
    model = torch.load(run["work"] / "results/finetune/model.pt", weights_only=True)
    assert model["labels"] == list(chexpert.LABELS) and model["config"]["init"] == "pretrained"
    metrics = _json(run, "results/evaluate/metrics.json")
    pred = pd.read_csv(run["work"] / "results/evaluate/predictions.csv").set_index("image")
    valid = {r["Path"].removeprefix("CheXpert-v1.0-small/"): r for r in _frontal(run["mirror"].rows["valid"])}
    for label in chexpert.LABELS:
        truth = np.array([_truth(valid[i][label], "ignore") for i in pred.index])
        np.testing.assert_array_equal(pred[label].to_numpy(), truth)
        e = metrics["labels"][label]
        assert (e["n_pos"], e["n_neg"]) == (int((truth == 1).sum()), int((truth == 0).sum()))
        if e["auroc"] is not None:
            assert e["auroc"] == pytest.approx(roc_auc_score(truth, pred[f"{label}_score"]), abs=1e-5)
        assert e["chexnet"] is None                     # CheXNet's numbers are not CheXpert's
    assert metrics["chexnet_mean_same_labels"] is None and metrics["published_comparable"] is False
    # sex, age and view from the table feed the audits: the groups hold the test images the table says
    groups = {(g["attribute"], g["group"]): g["n_images"] for g in metrics["subgroups"]["groups"]}
    sexes = pd.Series([r["Sex"] for r in valid.values()]).value_counts()
    assert (groups[("sex", "male")], groups[("sex", "female")], groups[("sex", "unknown")]) == \
        (sexes.get("Male", 0), sexes.get("Female", 0), sexes.get("Unknown", 0))
    assert groups[("age_band", "<18")] == sum(int(r["Age"]) < 18 for r in valid.values())
    assert groups[("view", "PA")] + groups[("view", "AP")] == len(valid)
    und = metrics["underdiagnosis"]          # the "no finding" call needs normal and abnormal validation images
    if und["call"]["threshold"] is None:      # this tiny split's validation may hold no image without a finding
        assert 0 in (und["call"]["validation"]["normal_images"], und["call"]["validation"]["images_with_finding"])
        assert und["overall"] is None and "no call can be chosen" in und["note"]
    else:
        assert und["overall"]["n_images"] == len(valid)


@pytest.mark.slow
def test_external_validation_record(run):
    """The CSV folder's test split scored for the findings the label map matches; internal AUROCs and CIs
    are the internal evaluation's own; external AUROCs are sklearn's over the known labels; the drop is
    their difference; the findings without a match are listed."""
    rec = _json(run, "results/external/hospital_b/metrics.json")
    internal = _json(run, "results/evaluate/metrics.json")
    pairs = [tuple(p) for p in rec["label_map"]["pairs"]]
    assert pairs == list(labelmap.match(chexpert.LABELS, list(CSV_FINDINGS)).pairs) == [
        ("Cardiomegaly", "Cardiomegaly"), ("Atelectasis", "Atelectasis"), ("Pleural Effusion", "Effusion")]
    assert rec["label_map"]["data_only"] == ["Mass"]
    assert rec["label_map"]["model_only"] == [x for x in chexpert.LABELS if x not in dict(pairs)]
    assert ["Mass", "Lung Lesion"] == rec["label_map"]["near_not_matched"][0][:2]
    pred = pd.read_csv(run["work"] / "results/external/hospital_b/predictions.csv").set_index("image")
    table = {r["file"]: r for r in run["folder"].rows}
    test_rows = [r for r in run["folder"].rows if r["subset"] == "test" and r["projection"] != "LL"]
    assert sorted(pred.index) == sorted(r["file"] for r in test_rows)
    assert {Path(i).suffix for i in pred.index} == {".png", ".jpg", ".dcm"} and any(" " in i for i in pred.index)
    assert rec["n_images"] == len(test_rows) and rec["dataset"] == "hospital_b"
    for f in rec["findings"]:
        ours, theirs = f["finding"], f["external_label"]
        truth = np.array([_truth(table[i][CSV_FINDINGS[theirs]], "ignore") for i in pred.index])
        np.testing.assert_array_equal(pred[ours].to_numpy(), truth)
        known = ~np.isnan(truth)
        ext = f["external"]
        assert (ext["n_pos"], ext["n_neg"], ext["n_unknown"]) == \
            ((truth == 1).sum(), (truth == 0).sum(), (~known).sum())
        both = np.unique(truth[known]).size == 2
        assert (ext["auroc"] is not None) == both
        if both:
            want = roc_auc_score(truth[known], pred.loc[known, f"{ours}_score"])
            assert ext["auroc"] == pytest.approx(want, abs=1e-5)
        # the internal side: the internal evaluation's AUROC and CI (the same resamples)
        assert f["internal"]["auroc"] == internal["labels"][ours]["auroc"]
        assert f["internal"]["ci"] == internal["labels"][ours]["ci"]
        if f["drop"]["diff"] is not None:
            assert f["drop"]["diff"] == pytest.approx(f["internal"]["auroc"] - ext["auroc"])
    assert rec["bootstrap"]["n_resamples"] == 100 and rec["model_run_id"] == internal["model_run_id"]
    table_csv = pd.read_csv(run["work"] / "results/external/hospital_b/auroc.csv").set_index("finding")
    assert list(table_csv.index) == [f["finding"] for f in rec["findings"]] + ["mean"]


@pytest.mark.slow
def test_external_set_gets_the_internal_audits_and_only_its_test_split_sharded(run):
    """The matched findings' calibration beside the internal record's (the Brier score worked out here from
    predictions.csv), AUROC by subgroup from the external split table (the groups hold the test images the
    table says); the CSV folder only evaluate.external uses: its test split alone in one shard job."""
    rec = _json(run, "results/external/hospital_b/metrics.json")
    internal = _json(run, "results/evaluate/metrics.json")
    pred = pd.read_csv(run["work"] / "results/external/hospital_b/predictions.csv").set_index("image")
    for f in rec["findings"]:
        assert f["calibration"]["internal"] == internal["labels"][f["finding"]].get("calibration")
        y, s = pred[f["finding"]].to_numpy(), pred[f"{f['finding']}_score"].to_numpy()
        known = ~np.isnan(y)
        ext = f["calibration"]["external"]
        assert (ext is not None) == (np.unique(y[known]).size == 2)
        if ext is not None:
            assert ext["n"] == known.sum() and ext["brier"] == pytest.approx(np.mean((s[known] - y[known]) ** 2),
                                                                             abs=1e-6)
        # each ECE and Brier score with its interval, the internal one's as the internal record has it
        assert f["calibration"]["internal_intervals"] == internal["labels"][f["finding"]].get("score_intervals")
        ext_iv = f["calibration"]["external_intervals"]
        assert (ext_iv is not None) == (ext is not None and not f["external"]["too_few"])
        if ext_iv is not None:
            assert ext_iv["ece_ci"][0] <= ext_iv["ece_ci"][1] and ext_iv["brier_ci"][0] <= ext["brier"] <= 1
    # underdiagnosis at the internal validation's call: its images with a matched finding and its normal ones
    und = rec["underdiagnosis"]
    assert und["call"] == internal["underdiagnosis"]["call"] and "matched findings" in und["scope"]
    assert und["internal_overall"] == internal["underdiagnosis"]["overall"]
    names = [f["finding"] for f in rec["findings"]]
    targets = pred[names].to_numpy()
    if und["call"]["threshold"] is None:
        assert und["overall"] is None and und["note"]
    else:
        used = [n for n in names if n in und["call"]["findings"]]
        has = (pred[used].to_numpy() == 1).any(axis=1)
        assert und["overall"]["image"]["n"] == has.sum() and und["overall"]["n_images"] == len(targets)
    test_rows = [r for r in run["folder"].rows if r["subset"] == "test" and r["projection"] != "LL"]
    groups = {(g["attribute"], g["group"]): g["n_images"] for g in rec["subgroups"]["groups"]}
    assert (groups[("sex", "male")], groups[("sex", "female")]) == (sum(r["sex"] == "M" for r in test_rows),
                                                                    sum(r["sex"] == "F" for r in test_rows))
    assert (groups[("view", "PA")], groups[("view", "AP")]) == (sum(r["projection"] == "PA" for r in test_rows),
                                                                sum(r["projection"] == "AP" for r in test_rows))
    m = _json(run, "data/shards/hospital_b/manifest.json")
    assert list(m["splits"]) == ["test"] and m["splits"]["test"]["n_images"] == len(test_rows)
    assert [p.name for p in (run["work"] / "data/shards/hospital_b/parts").iterdir()] == ["part_001"]


@pytest.mark.slow
def test_report_and_model_card_state_the_external_validation(run):
    html = (run["work"] / "results/report/chexflow_report.html").read_text()
    section = html.split('<section id="external">')[1].split("</section>")[0]
    rec = _json(run, "results/external/hospital_b/metrics.json")
    for f in rec["findings"]:
        assert f"<td class=\"l\">{f['finding']}</td><td class=\"l\">{f['external_label']}</td>" in section
    assert "independent" in section and "Zech et al." in section
    unmatched = section.split('id="external-unmatched-hospital_b"')[1]
    assert "Enlarged Cardiomediastinum" in unmatched and "hospital_b's Mass" in unmatched
    assert "Mass is not Lung Lesion" in unmatched
    assert "valid.csv" in html and "the official test set is not public" in html
    assert "uncertain read as positive (U-Ones) for Atelectasis" in html
    card = (run["work"] / "results/finetune/model_card.md").read_text()
    ext = card.split("## External validation")[1].split("## Intended use")[0]
    assert "Hospital B (phantoms)" in ext and "| Pleural Effusion | Effusion |" in ext
    assert "Not externally validated (no matching label)" in ext
    # the internal audits on the external set, beside the internal ones
    assert 'id="external-calibration-hospital_b"' in section and 'id="external-subgroups-hospital_b"' in section
    assert "Underdiagnosis on both test sets" in section and rec["underdiagnosis"]["scope"].replace("'", "&#39;") in section
    assert "0.000-0.000" not in section


def _docs_example() -> str:
    text = (REPO / "docs/datasets.md").read_text()
    block = text.split("### Example: NIH, then external validation on CheXpert")[1]
    return block.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_docs_example_nih_then_external_validation_on_chexpert_plans(tmp_path):
    """The docs' example is a whole override of config.yaml that plans as given (mirrors set): NIH
    fine-tuning, CheXpert's tables downloaded and sharded, its external validation and the report."""
    example = yaml.safe_load(_docs_example())
    assert example["study"]["finetune_dataset"] == "nih" and example["evaluate"]["external"] == ["chexpert"]
    shutil.copy(REPO / "config.yaml", tmp_path / "config.yaml")       # the checkout's, as a user has it
    (tmp_path / "example.yaml").write_text(_docs_example())
    dry = snakemake(tmp_path, "-n", "--configfile", str(tmp_path / "example.yaml"))
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = job_counts(dry.stdout)
    assert jobs["evaluate_external"] == 1 and jobs["render_report"] == 1
    assert "data/raw/chexpert/train.csv" in dry.stdout
    assert "data/shards/chexpert/parts/valid/manifest.json" in dry.stdout
    assert "data/shards/chexpert/parts/train_" not in dry.stdout       # an external test set: valid.csv's job alone
    assert "results/external/chexpert/metrics.json" in dry.stdout
