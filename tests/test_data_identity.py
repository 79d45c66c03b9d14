"""A result is a function of its data: a training run's id covers the manifest's content that
training reads (train and val), so a run whose data changed starts afresh (saying so), never resumes
the old run's checkpoints; the test split is not part of it (test shards rebuilt alone keep the run),
and evaluation proves from the shards that no test patient is a train or val patient and records the
test split's own digest. Checked through the real workflow on the demo (a release that failed for
its data and was repaired, a grown release, another validation fraction), each ending with a model
whose training patients are disjoint from the test patients, read from the files. The NIH pilot ->
full release path is in test_nih_release.py."""
from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from chexflow import host
from chexflow.data.manifest import ManifestError
from chexflow.evaluate import leakage
from chexflow.evaluate import run as evaluate
from chexflow.evaluate.config import EvaluateConfig
from chexflow.train import checkpoint as ckpt
from chexflow.train import identity
from conftest import REPO, snakemake
from test_trainer_paths import cfg_of

TARGET = "results/evaluate/metrics.json"


def test_data_identity_is_the_manifests_content_not_its_file(demo_manifest, tmp_path):
    """The run id changes with what shapes training (a train or val shard's bytes, a split's counts, the
    labels, the image size), not with the manifest's path, layout, time or bookkeeping (coverage,
    rejects), nor with the test split, which training never reads."""
    cfg = cfg_of()
    base = identity.run_id(cfg, demo_manifest, None)
    m = json.loads(demo_manifest.read_text())
    moved = tmp_path / "elsewhere" / "manifest.json"
    moved.parent.mkdir()
    moved.write_text(json.dumps({**m, "coverage": {"n_listed": 1}, "n_rejects": 7, "title": "x"}, sort_keys=True))
    assert identity.run_id(cfg, moved, None) == base

    def changed(edit) -> str:
        other = json.loads(demo_manifest.read_text())
        edit(other)
        path = tmp_path / "changed.json"
        path.write_text(json.dumps(other))
        return identity.run_id(cfg, path, None)
    first = m["splits"]["train"]["shards"][0]
    edits = {"shard": lambda o: o["splits"]["train"]["shards"][0].update(sha256="0" * 64),
             "val shard": lambda o: o["splits"]["val"]["shards"][0].update(sha256="1" * 64),
             "order": lambda o: o["splits"]["train"]["shards"].reverse(),
             "count": lambda o: o["splits"]["val"].update(n_images=o["splits"]["val"]["n_images"] + 1),
             "labels": lambda o: o["labels"].pop(),
             "size": lambda o: o.update(image_size=o["image_size"] * 2)}
    ids = {name: changed(edit) for name, edit in edits.items()}
    assert base not in ids.values() and len(set(ids.values())) == len(ids)
    test_only = {"test shard": lambda o: o["splits"]["test"]["shards"][0].update(sha256="2" * 64),
                 "test count": lambda o: o["splits"]["test"].update(n_images=o["splits"]["test"]["n_images"] + 9),
                 "no test": lambda o: o["splits"].pop("test")}
    assert {name: changed(edit) for name, edit in test_only.items()} == dict.fromkeys(test_only, base)
    old = identity.data_summary(demo_manifest)
    assert sorted(old["splits"]) == ["train", "val"]
    new = json.loads(json.dumps(old))
    new["splits"]["train"]["shards"] = [["f" * 64, first["count"]]] + new["splits"]["train"]["shards"][1:]
    new["splits"]["val"]["n_images"] += 5
    assert identity.data_changes(old, new) == (
        f"train: shards: 1 new, 1 gone of {len(old['splits']['train']['shards'])}; "
        f"val: images {old['splits']['val']['n_images']} -> {old['splits']['val']['n_images'] + 5}")
    older = {**old, "splits": {**old["splits"], "test": {"n_images": 3}}}      # a summary that covered test
    assert identity.data_changes(older, old) == ("none in the splits training reads (recorded when the run id "
                                                 "covered the test split too)")
    # the test split's own digest: of its counts and shards, not of the rest of the manifest
    test = identity.split_summary(demo_manifest, "test")
    assert test["sha256"] == identity.split_summary(moved, "test")["sha256"]
    changed(test_only["test count"])
    assert test["sha256"] != identity.split_summary(tmp_path / "changed.json", "test")["sha256"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({k: v for k, v in m.items() if k != "labels"}))
    with pytest.raises(ManifestError, match=f"{broken}: not a dataset manifest of the shard stage .*'labels'"):
        identity.run_id(cfg, broken, None)


def test_evaluation_proves_no_test_patient_is_a_train_or_val_patient_from_the_shards(demo_manifest, tmp_path):
    """The record of the demo's test split (its digest, the patients read from the shards, against an
    independent read with tarfile); a manifest whose test split lists a train shard is refused naming
    the shared patients, before any model is loaded (here there is none)."""
    rec = leakage.checked_test_split(demo_manifest)
    m = json.loads(demo_manifest.read_text())
    root = demo_manifest.parent

    def patients(split: str) -> set[str]:
        return set().union(*(_shard_patients(root / s["path"]) for s in m["splits"][split]["shards"]))
    assert rec["sha256"] == identity.split_summary(demo_manifest, "test")["sha256"] and rec["shared_patients"] == 0
    assert rec["n_patients"] == len(patients("test")) == m["splits"]["test"]["n_patients"]
    assert rec["patients_of"] == {"train": len(patients("train")), "val": len(patients("val"))}
    copy = tmp_path / "shards"
    shutil.copytree(root, copy)
    m["splits"]["test"]["shards"].append(m["splits"]["train"]["shards"][0])
    (copy / "manifest.json").write_text(json.dumps(m))
    shared = sorted(_shard_patients(root / m["splits"]["train"]["shards"][0]["path"]))
    shown = ", ".join(shared[:leakage.SHOWN]) + (f" and {len(shared) - leakage.SHOWN} more"
                                                 if len(shared) > leakage.SHOWN else "")
    with pytest.raises(leakage.PatientLeakError, match=re.escape(
            f"{copy / 'manifest.json'}: {len(shared)} test patient(s) are train patients too ({shown})")):
        evaluate.run(EvaluateConfig(), model_path=tmp_path / "no-model.pt", manifest=copy / "manifest.json",
                     out_dir=tmp_path / "evaluate")
    assert isinstance(leakage.PatientLeakError("x"), ManifestError)       # a refusal of input data (exit 7)


def test_a_malformed_identity_in_another_runs_checkpoint_is_not_trusted(demo_manifest, tmp_path):
    ident = identity.identity(cfg_of(), demo_manifest, None)
    hostile = {**ident.record(), "data": "other", "summary": {"splits": ["not", "a", "mapping"]}}
    ckpt.save_atomic({"identity": hostile}, ckpt.checkpoint_path(tmp_path, 3, "0123456789abcdef"))
    logs: list[str] = []
    identity.explain_fresh_start(tmp_path, ident, logs.append)
    assert logs == [f"data changed: the manifest's content differs (since step-000000003-0123456789abcdef.pt, run "
                    f"0123456789abcdef; starting afresh as run {ident.run_id})"]


def _config(n_images: int, val_fraction: float) -> dict:
    """The smallest demo fine-tuning (random init: no pretraining job) and its evaluation."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["demo_release"].update(n_images=n_images, image_size=32, images_per_archive=60)
    # split_seed 4: with val_fraction 0.001, the one validation patient has a single image
    cfg["shards"]["nih_demo"].update(image_size=32, samples_per_shard=40, val_fraction=val_fraction, split_seed=4)
    cfg["training"]["backend"] = "single"
    cfg["finetune"].update(init="random", epochs=1, batch_size=8)
    cfg["finetune"]["data"]["crop"] = 32
    cfg["evaluate"]["bootstrap_resamples"] = 20
    cfg["ablation"]["enabled"] = False
    return cfg


def _run(work: Path, cfg: dict):
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    return snakemake(work, "--configfile", str(work / "config.yaml"), "--", TARGET, timeout=900)


def _shard_patients(path: Path) -> set[str]:
    with tarfile.open(path) as tar:
        return {json.loads(tar.extractfile(m).read())["patient"] for m in tar.getmembers()
                if m.name.endswith(".meta.json")}


def _trained_patients(work: Path, dataset: str) -> set[str]:
    """The patients the model in results/finetune/model.pt trained on, from its record: the sha256 of
    its training shards, found among the manifest's shards by their bytes."""
    record = torch.load(work / "results/finetune/model.pt", weights_only=True)
    root = work / "data/shards" / dataset
    by_sha = {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in root.glob("parts/*/*.tar")}
    wanted = [sha for sha, _ in record["data"]["splits"]["train"]["shards"]]
    assert set(wanted) <= set(by_sha), "the model's training shards are not the current shards"
    return set().union(*(_shard_patients(by_sha[sha]) for sha in wanted))


def check_disjoint(work: Path, dataset: str = "nih_demo") -> set[str]:
    """The final model trained on this manifest's data, and on no test patient of the split table
    (returns the patients it trained on)."""
    manifest = work / "data/shards" / dataset / "manifest.json"
    record = torch.load(work / "results/finetune/model.pt", weights_only=True)
    assert record["data"] == identity.data_summary(manifest)
    splits = pd.read_csv(work / "data/shards" / dataset / "splits.csv", dtype=str)
    test = set(splits.loc[splits["split"] == "test", "patient"])
    trained = _trained_patients(work, dataset)
    assert trained and test and not trained & test
    metrics = json.loads((work / TARGET).read_text())
    assert metrics["model_run_id"] == record["run_id"] and metrics["model_run_id_checked"]
    assert metrics["test_split"]["sha256"] == identity.split_summary(manifest, "test")["sha256"]
    # the patients of the test shards (a pilot's are those of the split table's test images it found)
    root = work / "data/shards" / dataset
    in_test_shards = set().union(*(_shard_patients(root / s["path"])
                                   for s in json.loads(manifest.read_text())["splits"]["test"]["shards"]))
    assert in_test_shards and in_test_shards <= test
    assert metrics["test_split"]["shared_patients"] == 0 and metrics["test_split"]["n_patients"] == len(in_test_shards)
    # where each number was measured: the training's host (from the model file) and the evaluation's
    assert metrics["training_host"] == record["host"] and metrics["host"]["cpu_model"] == host.cpu_model()
    assert record["host"]["backend"] == record["config"]["backend"] and not host.problems(metrics["host"])
    return trained


def _train_log(work: Path) -> str:
    return (work / "logs/finetune/train.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_changed_data_starts_afresh_through_the_workflow(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # (d) a validation split of one patient's image: no epoch validates (exit 4), nothing written
    proc = _run(work, _config(120, 0.001))
    assert proc.returncode != 0
    assert "no model written" in _train_log(work) and not (work / "results/finetune/model.pt").exists()
    val = json.loads((work / "data/shards/nih_demo/manifest.json").read_text())["splits"]["val"]
    assert val["n_images"] == 1
    nan_run = [p.name for p in (work / "results/finetune/checkpoints").glob("step-*.pt")]
    assert nan_run
    # ... repaired by fixing the data: the rerun starts afresh (not the finished NaN run: exit 4 forever)
    proc = _run(work, _config(120, 0.15))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    log = _train_log(work)
    assert re.search(r"data changed: train: .*; val: images 1 -> \d+, patients 1 -> ", log)
    assert not re.search(r"resuming from \S+ at step", log)
    first = check_disjoint(work)
    first_id = torch.load(work / "results/finetune/model.pt", weights_only=True)["run_id"]
    assert all(first_id not in name for name in nan_run)

    # (a) the release grown from 120 to 180 images: fine-tuning starts afresh, its model is retrained
    proc = _run(work, _config(180, 0.15))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    log = _train_log(work)
    assert "data changed: train: images " in log and not re.search(r"resuming from \S+ at step", log)
    grown = torch.load(work / "results/finetune/model.pt", weights_only=True)
    assert grown["run_id"] != first_id
    check_disjoint(work)
    # what resuming would have done: some of the first model's training patients are test patients now
    splits = pd.read_csv(work / "data/shards/nih_demo/splits.csv", dtype=str)
    assert first & set(splits.loc[splits["split"] == "test", "patient"])

    # (b) shards.nih_demo.val_fraction 0.15 -> 0.3: split, shards and fine-tuning again, afresh
    proc = _run(work, _config(180, 0.3))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    log = _train_log(work)
    assert "data changed: " in log and "val: images " in log and not re.search(r"resuming from \S+ at step", log)
    assert torch.load(work / "results/finetune/model.pt", weights_only=True)["run_id"] not in (first_id,
                                                                                               grown["run_id"])
    check_disjoint(work)
