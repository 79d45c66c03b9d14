"""The real ChestX-ray14 source (``nih``) on a tiny mirror in the exact release layout
(tests/nih_mirror.py): table checks, coverage of the listed images, a declared pilot, stale-shard
resume, and the whole workflow through a real ``snakemake`` process downloading over HTTP."""
from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from chexflow.data import nih, registry, shards, sources
from chexflow.data.config import ShardConfig
from chexflow.evaluate import published
from conftest import REPO, job_counts, snakemake
from http_server import FileServer
from nih_mirror import generate, make_nih_mirror
from test_data_identity import check_disjoint


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """One phantom release (12 archives of 12 images at 32 px) the unit tests pack mirrors from."""
    return generate(tmp_path_factory.mktemp("generated"), per_archive=12)


def _expected(mirror) -> nih.ReleaseCounts:
    return nih.ReleaseCounts(**mirror.registry["nih"]["content"])


def _cfg(**kw) -> ShardConfig:
    base = dict(dataset="nih", image_size=32, samples_per_shard=8, val_fraction=0.2, max_reject_fraction=0.0,
                max_missing_fraction=0.0)
    return ShardConfig(**{**base, **kw})


# --------------------------------------------------------------------------- published content of the tables

def test_verify_tables_names_every_difference():
    labels = pd.DataFrame({"patient": ["p1", "p1", "p2", "p3"]}, index=["a.png", "b.png", "c.png", "d.png"])
    ok = nih.ReleaseCounts(n_images=4, n_patients=3, n_train_val=3, n_test=1)
    nih.verify_tables(labels, ["a.png", "b.png", "c.png"], ["d.png"], expected=ok)
    with pytest.raises(nih.NIHError) as ei:
        nih.verify_tables(labels, ["a.png", "c.png", "x.png"], ["b.png"], expected=ok, where="mirror/")
    msg = str(ei.value)
    assert msg.startswith("mirror/ are not the published ChestX-ray14 tables")
    assert "n_train_val is 3, expected 3" not in msg
    assert "train_val_list.txt names 1 image(s) without a label row, e.g. ['x.png']" in msg
    assert "1 patient(s) have images in both lists, e.g. ['p1']" in msg
    # the defaults are the published release: a small table fails on all four counts
    with pytest.raises(nih.NIHError, match=r"n_images is 4, expected 112,120; n_patients is 3, expected 30,805; "
                                           r"n_train_val is 3, expected 86,524; n_test is 1, expected 25,596"):
        nih.verify_tables(labels, ["a.png", "b.png", "c.png"], ["d.png"])


def test_split_of_nih_checks_the_tables_even_for_a_pilot(tmp_path, generated):
    with pytest.raises(nih.NIHError, match="n_images is 144, expected 112,120"):
        shards.split_dataset("nih", generated, _cfg(archives=(1,)), tmp_path / "splits.csv")
    expected = nih.ReleaseCounts(**make_nih_mirror(tmp_path / "m", generated).registry["nih"]["content"])
    df = shards.split_dataset("nih", generated, _cfg(archives=(1,)), tmp_path / "splits.csv", expected=expected)
    assert len(df) == 144 and set(df["split"]) == {"train", "val", "test"}
    wrong = nih.ReleaseCounts(**{**expected.__dict__, "n_test": expected.n_test + 1})
    with pytest.raises(nih.NIHError, match=f"n_test is {expected.n_test}, expected {expected.n_test + 1}"):
        shards.split_dataset("nih", generated, _cfg(), tmp_path / "splits.csv", expected=wrong)


# --------------------------------------------------------------------------- test-only registry override

def test_registry_override_only_through_its_environment_variable(tmp_path, capsys):
    assert registry.load_test_registry({}) is None
    content = {"n_images": 5, "n_patients": 2, "n_train_val": 3, "n_test": 2}
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"nih": {"files": {"images_001.tar.gz": {"sha256": "AB" * 32, "size": 7}},
                                        "content": content}}))
    reg = registry.load_test_registry({sources.TEST_REGISTRY_ENV: str(path)})
    assert f"{sources.TEST_REGISTRY_ENV}={path}" in capsys.readouterr().err
    src = sources.with_test_pins(registry.get_source("nih"), reg)
    a1 = src.file("images_001.tar.gz")
    assert (a1.md5, a1.sha256, a1.size) == (None, "ab" * 32, 7)
    assert a1.url == registry.get_source("nih").file("images_001.tar.gz").url      # only the pins change
    assert src.file("images_002.tar.gz") == registry.get_source("nih").file("images_002.tar.gz")
    assert registry.get_source("nih").file("images_001.tar.gz").md5 == "fe8ed0a6961412fddcbb3603c11b3698"
    assert sources.registry_content(reg, "nih") == content
    (tmp_path / "bad.json").write_text(json.dumps({"nih": {"files": {"images_013.tar.gz": {"sha256": "0" * 64}}}}))
    bad = registry.load_test_registry({sources.TEST_REGISTRY_ENV: str(tmp_path / "bad.json")})
    with pytest.raises(sources.RegistryOverrideError, match="no file.*images_013.tar.gz"):
        sources.with_test_pins(registry.get_source("nih"), bad)
    (tmp_path / "bad2.json").write_text(json.dumps({"nihh": {}}))
    with pytest.raises(sources.RegistryOverrideError, match="unknown source 'nihh'"):
        registry.load_test_registry({sources.TEST_REGISTRY_ENV: str(tmp_path / "bad2.json")})


# --------------------------------------------------------------------------- coverage of the listed images

def test_listed_image_missing_from_every_archive(tmp_path, generated):
    mirror = make_nih_mirror(tmp_path / "m", generated, drop=((5, 2),))
    gone = sorted(set(pd.read_csv(generated / nih.LABEL_CSV_NAME)["Image Index"])
                  - {n for names in mirror.archives.values() for n in names})
    assert len(gone) == 1
    gone = gone[0]
    expected = _expected(mirror)
    with pytest.raises(shards.ShardError) as ei:
        shards.build_dataset("nih", mirror.root, tmp_path / "full", _cfg(), expected=expected)
    msg = str(ei.value)
    assert "1 of the 144 images named in the split lists" in msg and gone in msg
    assert "images_001 ... images_012" in msg and "datasets.nih.archives" in msg
    # within the tolerance: accepted, and recorded
    m = json.loads(shards.build_dataset("nih", mirror.root, tmp_path / "tol", _cfg(max_missing_fraction=0.02),
                                        expected=expected).read_text())
    assert (m["coverage"]["n_listed"], m["coverage"]["n_found"], m["coverage"]["missing_examples"]) == (144, 143, [gone])
    # a declared pilot: the listed images of the other archives are expected to be missing
    m = json.loads(shards.build_dataset("nih", mirror.root, tmp_path / "pilot", _cfg(archives=(2, 1)),
                                        expected=expected).read_text())
    cov = m["coverage"]
    assert cov["pilot"] and cov["archives"] == [1, 2] and cov["parts"] == ["images_001", "images_002"]
    assert (cov["n_listed"], cov["n_found"], cov["n_missing"], cov["n_release_parts"]) == (144, 24, 120, 12)
    splits = pd.read_csv(tmp_path / "pilot" / "splits.csv")
    for split, info in m["splits"].items():
        assert info["n_listed"] == int((splits["split"] == split).sum())
        assert info["n_images"] == cov["per_split"][split]["n_found"]
    assert sum(info["n_images"] for info in m["splits"].values()) == 24
    assert m["split_source"] == nih.SPLIT_SOURCE


# --------------------------------------------------------------------------- stale shards

def _shard_sides(part_dir: Path) -> set[int]:
    sides = set()
    for shard in part_dir.glob("*.tar"):
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith(".img.npy"):
                    sides.update(np.load(io.BytesIO(tar.extractfile(member).read())).shape)
    return sides


def test_resume_discards_shards_of_other_settings_or_input(tmp_path, generated, capsys):
    mirror = make_nih_mirror(tmp_path / "m", generated, corrupt=((1, 10),))   # after most shards are written
    bad = mirror.archives["images_001.tar.gz"][10]
    raw, out = mirror.root, tmp_path / "shards"
    shards.split_dataset("nih", raw, _cfg(), out / "splits.csv", expected=_expected(mirror))
    part = out / "parts" / "images_001"
    with pytest.raises(shards.ShardError, match=bad):
        shards.write_part("nih", "images_001", raw, out / "splits.csv", part, _cfg(image_size=64))
    written = sorted(p.name for p in part.glob("*.tar"))
    assert written and _shard_sides(part) == {64} and (part / "progress.json").exists()

    capsys.readouterr()
    m = shards.write_part("nih", "images_001", raw, out / "splits.csv", part,
                          _cfg(image_size=96, max_reject_fraction=0.1))
    assert f"discarded {len(written)} shard(s) of an earlier attempt written with other settings" \
        in capsys.readouterr().err
    assert m["image_size"] == 96 and _shard_sides(part) == {96}
    assert [r["image"] for r in m["rejects"]] == [bad]
    assert sum(s["count"] for s in m["shards"]) == 11
    assert m["listed_found"] == sorted(mirror.archives["images_001.tar.gz"])
    # the 1,024 px and RGBA members of this archive are resized like the others
    assert set(mirror.big) | set(mirror.rgba) <= set(m["listed_found"])

    # the same settings but a new copy of the archive (another mtime): nothing is resumed either
    (part / "manifest.json").unlink()
    progress = {"key": m["key"], "shards": [], "rejects": []}
    (part / "progress.json").write_text(json.dumps(progress))
    assert shards.part_key("nih", "images_001", raw, out / "splits.csv", _cfg(image_size=96)) == m["key"]
    archive = raw / "images_001.tar.gz"
    st = archive.stat()
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert shards.part_key("nih", "images_001", raw, out / "splits.csv", _cfg(image_size=96)) != m["key"]
    assert shards.part_key("nih", "images_001", raw, out / "splits.csv",
                           _cfg(image_size=96, max_reject_fraction=0.5, archives=(1,))) \
        == shards.part_key("nih", "images_001", raw, out / "splits.csv", _cfg(image_size=96))


# --------------------------------------------------------------------------- the workflow, as a user runs it

def _study_config(mirror_url: str, archives: list[int] | None) -> dict:
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["study"]["finetune_dataset"] = "nih"
    cfg["datasets"]["nih"] = {"mirror": mirror_url, "archives": archives}
    cfg["shards"]["nih"].update(image_size=32, samples_per_shard=40, val_fraction=0.2, max_reject_fraction=0.0,
                                max_missing_fraction=0.0)
    # the shortest pretraining there is: 28 px Fashion-MNIST as stored (no resize), 4 steps, 600 val images
    cfg["study"]["pretrain_dataset"] = "fashion_mnist"
    cfg["shards"]["fashion_mnist"].update(image_size=28, samples_per_shard=10000, val_fraction=0.01)
    cfg["training"]["backend"] = "single"
    cfg["training"]["checkpoint"]["every_steps"] = 1000
    cfg["finetune"]["data"]["crop"] = 32
    cfg["pretrain"].update(epochs=1, batch_size=32)
    cfg["pretrain"]["data"].update(crop=28, samples_per_epoch=128)
    cfg["finetune"].update(epochs=2, batch_size=16)
    cfg["evaluate"]["bootstrap_resamples"] = 50
    cfg["ablation"]["enabled"] = False      # this test is about the data path; the ablation has its own
    return cfg


def _run(workdir: Path, cfg: dict) -> tuple:
    cfgfile = workdir / "config.yaml"
    cfgfile.write_text(yaml.safe_dump(cfg))
    proc = snakemake(workdir, "--configfile", str(cfgfile), "--set-resources", "pretrain_model:tasks=1",
                     "finetune_model:tasks=1", timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    html = (workdir / "results/report/chexflow_report.html").read_text()
    manifest = json.loads((workdir / "data/shards/nih/manifest.json").read_text())
    metrics = json.loads((workdir / "results/evaluate/metrics.json").read_text())
    return job_counts(proc.stdout + proc.stderr), html, manifest, metrics


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_workflow_on_the_release_layout_pilot_then_full(tmp_path, monkeypatch):
    mirror = make_nih_mirror(tmp_path / "mirror", generate(tmp_path / "generated", per_archive=30))
    monkeypatch.setenv(sources.TEST_REGISTRY_ENV, str(mirror.write_registry(tmp_path / "registry.json")))
    work = tmp_path / "work"
    work.mkdir()
    with FileServer(mirror.root) as srv:
        # a declared pilot on archives 1 and 2: only they are downloaded and sharded
        jobs, html, manifest, metrics = _run(work, _study_config(srv.base_url, [1, 2]))
        assert jobs["download_file"] == 4 + 2 + 4 and jobs["write_shards"] == 2 + 2
        fetched = sorted({r.path for r in srv.requests if r.status in (200, 206)})
        assert fetched == sorted(["images_001.tar.gz", "images_002.tar.gz", *nih.NIH_TABLES, nih.BOX_LIST_NAME])
        cov = manifest["coverage"]
        assert cov["pilot"] and (cov["n_listed"], cov["n_found"], cov["n_missing"]) == (360, 60, 300)
        assert sum(s["n_images"] for s in manifest["splits"].values()) == 60
        assert sum(s["n_listed"] for s in manifest["splits"].values()) == 360
        assert 'id="pilot-banner"' in html and "PILOT on 2 of 12 archives of NIH ChestX-ray14" in html
        assert "60 of the 360 images named in the split lists" in html and "NOT comparable with CheXNet" in html
        assert "SYNTHETIC" not in html
        subtitle = re.search(r'<p class="subtitle" id="run-subtitle">(.*?) &middot;', html).group(1)
        assert subtitle == ("resnet18 pretraining on Fashion-MNIST (single, 1 rank) and resnet18 fine-tuning "
                            "on NIH ChestX-ray14 (single, 1 rank)")
        assert "official NIH split lists" in html
        assert metrics["n_images"] == manifest["splits"]["test"]["n_images"]

        pilot_id = torch.load(work / "results/finetune/model.pt", weights_only=True)["run_id"]
        check_disjoint(work, "nih")

        # the full release in the same working directory: the 10 other archives, nothing else redone
        jobs, html, manifest, metrics = _run(work, _study_config(srv.base_url, None))
    # fine-tuning started afresh on the full data (never resumed the pilot's run), and says why
    log = (work / "logs/finetune/train.log").read_text()
    assert "data changed: train: images " in log and not re.search(r"resuming from \S+ at step", log)
    assert torch.load(work / "results/finetune/model.pt", weights_only=True)["run_id"] != pilot_id
    check_disjoint(work, "nih")
    assert jobs["download_file"] == 10 and jobs["write_shards"] == 10 and jobs["gather_shards"] == 1
    assert "pretrain_model" not in jobs and "split_dataset" not in jobs
    cov = manifest["coverage"]
    assert not cov["pilot"] and (cov["n_listed"], cov["n_found"], cov["n_missing"]) == (360, 360, 0)
    assert manifest["n_rejects"] == 0 and manifest["image_size"] == 32      # 1,024 px and RGBA members included
    assert {k: v["n_images"] for k, v in manifest["splits"].items()} == \
        {k: v["n_listed"] for k, v in manifest["splits"].items()}
    assert manifest["splits"]["test"]["n_images"] == mirror.registry["nih"]["content"]["n_test"] == metrics["n_images"]
    assert 'id="pilot-banner"' not in html and "all 12 archives: 360 of 360 listed images" in html
    # the published mean is taken over the labels of this run's mean
    assert metrics["chexnet_mean_same_labels"] == pytest.approx(
        published.CHEXNET.mean_over(metrics["mean_auroc_labels"]))
    auroc = pd.read_csv(work / "results/evaluate/auroc.csv").set_index("label")
    assert auroc.loc["mean", "chexnet"] == pytest.approx(metrics["chexnet_mean_same_labels"], abs=1e-4)
    # the box list went through the release's path: boxes in 1,024 px frames, scored at the 32 px input
    loc = metrics["localisation"]
    assert loc["boxes"]["frame"] == nih.PNG_SIDE and loc["boxes"]["stored"] == 32 and loc["crop"] == 32
    test = pd.read_csv(work / "results/evaluate/predictions.csv").set_index("image")
    boxes = nih.read_box_list(mirror.root / nih.BOX_LIST_NAME)
    boxes = boxes[boxes["image"].isin(test.index)]
    boxed = {(r.image, r.label) for r in boxes.itertuples() if test.loc[r.image, r.label] == 1}
    assert loc["boxes"]["n_test_boxes"] == len(boxes) and sum(e["n"] for e in loc["labels"].values()) == len(boxed) > 0
    assert 'id="localisation-table"' in html and 'id="subgroup-table"' in html
    # the statistics on the release's path: subgroup CIs by patients, the pointing game's verdicts,
    # underdiagnosis from the label table, the official-split references without the synthetic caveat
    for g in metrics["subgroups"]["groups"]:
        for e in g["labels"].values():
            if e["ci"] is not None:
                assert min(e["n_pos_patients"], e["n_neg_patients"]) >= metrics["subgroups"]["min_count"]
    for e in loc["labels"].values():
        assert e["n"] == e["n_no_saliency"] + e["n_pointed"] and e["verdict_text"]
    und = pd.read_csv(work / "results/evaluate/underdiagnosis.csv")
    overall = metrics["underdiagnosis"]["overall"]
    assert und.loc[0, "kind"] == "overall" and und.loc[0, "images_missed"] == overall["image"]["missed"]
    assert {"sex", "age_band", "view"} <= set(und["attribute"])
    assert 'id="underdiagnosis-table"' in html and "EVA-X-B (ViT-B/16)" in html
    assert "for orientation only" not in html.split('id="published"')[1].split("</section>")[0]
    card = (work / "results/finetune/model_card.md").read_text()
    assert "NIH ChestX-ray14" in card and "SYNTHETIC" not in card and "## Underdiagnosis" in card


def test_box_list_is_optional(tmp_path):
    """datasets.nih.boxes: false leaves BBox_List_2017.csv out of the downloads and the evaluation (heatmaps
    are drawn, not scored); by default the evaluation gets it with the release's 1,024 px frame."""
    cfg = _study_config("http://127.0.0.1:1/", None)
    for boxes, want in ((True, True), (False, False)):
        cfg["datasets"]["nih"]["boxes"] = boxes
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
        dry = snakemake(tmp_path, "-n", "-p", "--configfile", str(tmp_path / "config.yaml"), "--",
                        "results/evaluate/metrics.json")
        assert dry.returncode == 0, dry.stderr[-3000:]
        evaluate = dry.stdout.split("rule evaluate_model:", 1)[1].split("\n\n", 1)[0]
        assert ("--boxes data/raw/nih/BBox_List_2017.csv --box-frame 1024" in evaluate) == want
        assert ("data/raw/nih/BBox_List_2017.csv" in dry.stdout) == want
        assert "--label-table data/raw/nih/Data_Entry_2017_v2020.csv" in evaluate
