"""Scaling study: the snakemake rules at world sizes 1 and 2 on a tiny workload (real ranks)."""
from __future__ import annotations

import functools
import json
import os
import shutil

import pandas as pd
import pytest
import yaml

from conftest import REPO, horovod_available, job_counts, snakemake

from chexflow.studies.config import ScalingConfig
from chexflow.train.config import TrainConfig
from chexflow.studies import scaling



_snakemake = functools.partial(snakemake, timeout=600)


def test_summary_speedup_and_efficiency(tmp_path):
    points = [{"world_size": w, "images_per_sec": ips, "images_per_sec_per_rank": ips / w, "per_rank": [],
               "measured_epoch_s": 2.0, "time_per_epoch_s": 6000 / ips, "epoch_images": 6000,
               "steps_per_rank": 10, "batch_per_rank": 8, "global_batch": 8 * w}
              for w, ips in ((4, 300.0), (1, 100.0), (2, 180.0))]
    df = scaling.summarize(points)
    assert list(df["world_size"]) == [1, 2, 4]
    assert list(df["speedup"]) == pytest.approx([1.0, 1.8, 3.0])
    assert list(df["efficiency"]) == pytest.approx([1.0, 0.9, 0.75])
    with pytest.raises(scaling.ScalingError, match="twice"):
        scaling.summarize(points + points[:1])


def test_a_point_file_is_read_as_an_untrusted_file(tmp_path):
    """throughput.json through read_point: a FIFO is refused without blocking; malformed JSON or a
    missing measurement names the file and the key."""
    from chexflow.fsutil import NotRegularFile
    point = {"world_size": 1, "images_per_sec": 100.0, "images_per_sec_per_rank": 100.0, "measured_epoch_s": 2.0,
             "time_per_epoch_s": 60.0, "epoch_images": 6000, "steps_per_rank": 10, "batch_per_rank": 8,
             "global_batch": 8}
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps(point))
    assert scaling.read_point(path) == point
    bad = [("{", "not a scaling point \\(not valid JSON"), ("[]", "not a scaling point \\(a JSON list, not an object"),
           (json.dumps({**point, "images_per_sec": "fast"}), "images_per_sec must be a number, got 'fast'"),
           (json.dumps({k: v for k, v in point.items() if k != "global_batch"}),
            "global_batch must be a number, got None")]
    for text, message in bad:
        path.write_text(text)
        with pytest.raises(scaling.ScalingError, match=f"{path}: {message}"):
            scaling.write_summary([path], out_csv=tmp_path / "s.csv", out_json=tmp_path / "s.json",
                                  out_png=tmp_path / "s.png")
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(NotRegularFile, match="a FIFO"):
        scaling.read_point(path)


def test_train_config_fixes_the_per_rank_workload():
    pre = TrainConfig(stage="pretrain", epochs=30, batch_size=256)
    study = ScalingConfig(steps_per_rank=7, batch_size=16, epochs=2, arch="resnet34", crop=24)
    for world in (1, 2, 8):
        cfg = scaling.train_config(pre, study, world)
        assert cfg.batch_size == 16 and cfg.epochs == 2 and cfg.model.arch == "resnet34"
        assert cfg.data.crop == 24 and cfg.data.samples_per_epoch == 7 * 16 * world
        assert cfg.optim == pre.optim and cfg.backend == pre.backend


@pytest.mark.slow
def test_scaling_rules_world_1_and_2(tmp_path, demo_manifest):
    """Dry-run DAG of `all` has one scale_pretrain job per world size; then snakemake runs the scaling
    rules for real on a copy of the tiny demo shards standing in for the pretraining manifest."""
    backend = "horovod" if horovod_available() else "ddp"
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["pretrain"]["backend"] = backend
    cfg["pretrain"]["data"]["workers"] = 0
    cfg["scaling"] = {"enabled": True, "world_sizes": [1, 2], "steps_per_rank": 4, "epochs": 2,
                      "batch_size": 8, "arch": "resnet18", "crop": 32}
    cfgfile = tmp_path / "config.yaml"
    cfgfile.write_text(yaml.safe_dump(cfg))

    dry = _snakemake(tmp_path, "-n", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["scale_pretrain"] == 2 and counts["summarize_scaling"] == 1
    # (with scaling.enabled false, the default, `all` has no scaling job: test_workflow's dry run)

    shutil.copytree(demo_manifest.parent, tmp_path / "data/shards" / cfg["study"]["pretrain_dataset"])
    # --cores 1: one thread per rank at both world sizes (on a loaded 2-core CI machine a 2-thread
    # rank can be many times slower than two 1-thread ranks); the job's cores are split by its ranks
    proc = _snakemake(tmp_path, "--configfile", str(cfgfile), "--allowed-rules", "scale_pretrain",
                      "summarize_scaling", "--", "results/scaling/scaling.csv", cores=1)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    df = pd.read_csv(tmp_path / "results/scaling/scaling.csv")
    assert list(df["world_size"]) == [1, 2]
    assert df["speedup"].iloc[0] == 1.0
    assert df["efficiency"].to_numpy() == pytest.approx((df["speedup"] / (df["world_size"] / 1)).to_numpy(), rel=1e-5)
    rows = json.loads((tmp_path / "results/scaling/scaling.json").read_text())["rows"]
    assert rows[1]["speedup"] == pytest.approx(rows[1]["images_per_sec"] / rows[0]["images_per_sec"], rel=1e-12)
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 2, rel=1e-12)
    assert (df["images_per_sec"] > 0).all() and (df["time_per_epoch_s"] > 0).all()
    for w in (1, 2):
        point = json.loads((tmp_path / f"results/scaling/world{w}/throughput.json").read_text())
        assert point["world_size"] == w and len(point["per_rank"]) == w
        assert point["threads_per_rank"] == 1             # max(1, job cores // local ranks)
        # where the ranks ran (the report says how many cores they shared on one machine)
        assert point["nodes"] == 1 and point["ranks_per_node"] == w
        assert point["cores_per_node"] == len(os.sched_getaffinity(0))
        hist = [json.loads(x) for x in (tmp_path / f"results/scaling/world{w}/metrics.jsonl").read_text().splitlines()]
        assert len(hist) == 2 and all(h["step"] == 4 * (i + 1) for i, h in enumerate(hist))
        assert (tmp_path / f"benchmarks/scaling/world{w}.tsv").is_file()
    assert (tmp_path / "results/scaling/scaling.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "results/scaling/scaling.json").read_text())
    assert summary["baseline_world_size"] == 1 and len(summary["rows"]) == 2

    # snakemake's own report over the finished scaling run: the table and the plot with their captions
    rep = _snakemake(tmp_path, "--configfile", str(cfgfile), "--allowed-rules", "scale_pretrain",
                     "summarize_scaling", "--report", str(tmp_path / "snakemake_report.zip"), "--",
                     "results/scaling/scaling.csv")
    assert rep.returncode == 0, (rep.stdout + rep.stderr)[-3000:]
    import zipfile
    with zipfile.ZipFile(tmp_path / "snakemake_report.zip") as z:
        names = z.namelist()
        assert any(n.endswith("scaling.csv") for n in names) and any(n.endswith("scaling.png") for n in names)
        assert any("Weak scaling of pretraining" in z.read(n).decode("utf-8", "replace")
                   for n in names if n.endswith((".html", ".js", ".json")))
