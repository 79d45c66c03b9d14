"""A result is a function of its data: a training run's id covers the manifest's content, so a run
whose data changed starts afresh (saying so), never resumes the old run's checkpoints; checked
through the real workflow on the demo (a release that failed for its data and was repaired, a grown
release, another validation fraction), each ending with a model whose training patients are
disjoint from the test patients, read from the files. The NIH pilot -> full release path is in
test_nih_release.py."""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from chexflow.train import identity
from conftest import REPO, snakemake

TARGET = "results/evaluate/metrics.json"


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
