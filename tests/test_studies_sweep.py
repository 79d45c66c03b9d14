"""Fine-tuning sweep: trial expansion, selection, and the rules on a tiny run (one trial diverges)."""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import shutil

import pandas as pd
import pytest
import yaml

from conftest import REPO, job_counts, snakemake

from chexflow.settings import ConfigError, from_dict
from chexflow.studies.config import SweepConfig
from chexflow.train.config import TrainConfig
from chexflow.studies import sweep

SPACE = {"batch_size": [16, 32], "freeze": [0, 2, 4], "optim": {"lr": [1e-4, 1e-3, 1e-2], "weight_decay": [0.0, 1e-4]},
         "model": {"dropout": [0.0, 0.5]}}


_snakemake = functools.partial(snakemake, timeout=900)


def test_grid_is_every_combination():
    trials = sweep.expand_trials(from_dict(SweepConfig, {"method": "grid", "space": SPACE}))
    assert len(trials) == 2 * 3 * 3 * 2 * 2
    assert [t["id"] for t in trials[:3]] == ["t000", "t001", "t002"]
    combos = {tuple(sorted(t["params"].items())) for t in trials}
    assert len(combos) == len(trials)
    expected = set(itertools.product([1e-4, 1e-3, 1e-2], [0.0, 1e-4], [16, 32], [0.0, 0.5], [0, 2, 4]))
    got = {(p["optim.lr"], p["optim.weight_decay"], p["batch_size"], p["model.dropout"], p["freeze"])
           for p in (t["params"] for t in trials)}
    assert got == expected
    # nothing swept: one trial, the finetune section unchanged
    assert sweep.expand_trials(SweepConfig()) == [{"id": "t000", "params": {}}]


def test_random_is_seeded_and_inside_the_space():
    cfg = from_dict(SweepConfig, {"method": "random", "n_trials": 25, "seed": 3, "space": SPACE})
    a, b = sweep.expand_trials(cfg), sweep.expand_trials(cfg)
    assert a == b and len(a) == 25
    other = sweep.expand_trials(from_dict(SweepConfig, {"method": "random", "n_trials": 25, "seed": 4, "space": SPACE}))
    assert other != a
    for t in a:
        p = t["params"]
        assert 1e-4 <= p["optim.lr"] <= 1e-2 and 0.0 <= p["optim.weight_decay"] <= 1e-4
        assert 0.0 <= p["model.dropout"] <= 0.5
        assert p["batch_size"] in (16, 32) and p["freeze"] in (0, 2, 4)
    lrs = [t["params"]["optim.lr"] for t in a]
    assert len(set(lrs)) > 20                               # drawn, not picked from the list
    assert sum(lr < 1e-3 for lr in lrs) >= 5                 # log-uniform: the low decade is drawn too
    # every trial is a valid fine-tuning config
    for t in a[:5]:
        cfg_t = sweep.trial_config({"stage": "finetune"}, t["params"])
        assert isinstance(cfg_t, TrainConfig) and cfg_t.optim.lr == t["params"]["optim.lr"]
        assert cfg_t.freeze == t["params"]["freeze"]


def test_bad_space_and_bad_freeze_fail_early():
    with pytest.raises(ConfigError, match=r"space\.optim\.lr\[0\]: 0\.0 is not > 0"):
        sweep.expand_trials(from_dict(SweepConfig, {"space": {"optim": {"lr": [0.0]}}}))
    with pytest.raises(sweep.SweepError, match="freeze"):
        sweep.trial_config({"stage": "finetune", "model": {"arch": "resnet18"}}, {"freeze": 7})


def test_selection_ignores_failed_trials():
    results = [
        {"trial": "t000", "status": "ok", "val_metric": 0.71, "params": {"optim.lr": 1e-3}, "model": "a"},
        {"trial": "t001", "status": "failed", "val_metric": None, "reason": "diverged", "params": {"optim.lr": 1.0}},
        {"trial": "t002", "status": "ok", "val_metric": 0.74, "params": {"optim.lr": 3e-3}, "model": "c"},
        {"trial": "t003", "status": "failed", "val_metric": 0.99, "reason": "crashed (exit code 1)",
         "params": {"optim.lr": 1e-2}},
        {"trial": "t004", "status": "ok", "val_metric": 0.74, "params": {"optim.lr": 5e-3}, "model": "e"},
    ]
    assert sweep.select(results)["trial"] == "t002"           # best ok; tie -> first id; failed ignored
    df = sweep.table(results, "t002")
    assert list(df["winner"]) == [False, False, True, False, False]
    with pytest.raises(sweep.SweepError, match="no sweep trial succeeded.*t001: diverged"):
        sweep.select([r for r in results if r["status"] == "failed"])


def test_the_records_a_trial_leaves_are_read_as_untrusted_files(tmp_path):
    """metrics.jsonl through the training's one reader (train.epochs.read_epochs), result.json through
    the sweep's: a FIFO is refused without blocking, malformed JSON names the file, the line or the key."""
    from chexflow.fsutil import NotRegularFile
    from chexflow.train.epochs import EpochsRecordError
    epochs = tmp_path / "metrics.jsonl"
    epochs.write_text("".join(json.dumps({"epoch": e, "train_loss": 1.0, "val_metric": v, "val_metric_name": "auc"})
                              + "\n" for e, v in ((1, 0.6), (2, float("nan")), (3, 0.7), (4, 0.65))))
    assert sweep._best(epochs) == (0.7, "auc", 3)
    epochs.write_text('{"epoch": 1, "train_loss": 1.0, "val_metric": 0.5}\n{"epoch": 2,\n')
    with pytest.raises(EpochsRecordError, match=f"{epochs}:2: not valid JSON"):
        sweep._best(epochs)
    result = tmp_path / "result.json"
    good = {"trial": "t000", "params": {}, "status": "ok", "val_metric": 0.7, "model": "m.pt"}
    result.write_text(json.dumps(good))
    assert sweep.read_result(result) == good
    for text, message in (("{", "not valid JSON"), ("[1]", "a JSON list, not an object"),
                          (json.dumps({**good, "params": 3}), "params is not an object"),
                          (json.dumps({k: v for k, v in good.items() if k != "status"}), r"no \['status'\]")):
        result.write_text(text)
        with pytest.raises(sweep.SweepRecordError, match=f"{result}: not a sweep trial's result.*{message}"):
            sweep.read_result(result)
    for path in (epochs, result):
        path.unlink()
        os.mkfifo(path)
    with pytest.raises(NotRegularFile, match="a FIFO"):
        sweep._best(epochs)
    with pytest.raises(NotRegularFile, match="a FIFO"):
        sweep.write_selection([result], out_csv=tmp_path / "s.csv", out_json=tmp_path / "s.json",
                              out_model=tmp_path / "m.pt")


@pytest.mark.slow
def test_sweep_rules_tiny(tmp_path, demo_manifest):
    """Two grid trials (one with an absurd LR that diverges), selection, the winner evaluated once."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["finetune"].update(backend="single", init="random", epochs=1, batch_size=16)
    cfg["finetune"]["data"].update(crop=32, workers=0, samples_per_epoch=64)
    cfg["evaluate"]["bootstrap_resamples"] = 50
    cfg["sweep"] = {"enabled": True, "method": "grid", "space": {"optim": {"lr": [1e-3, 1e30]}}}
    cfgfile = tmp_path / "config.yaml"
    cfgfile.write_text(yaml.safe_dump(cfg))

    dry = _snakemake(tmp_path, "-n", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["sweep_trial"] == 2 and counts["select_sweep"] == 1
    assert counts["evaluate_sweep_winner"] == 1 and counts["evaluate_model"] == 1

    shutil.copytree(demo_manifest.parent, tmp_path / "data/shards/nih_demo")
    proc = _snakemake(tmp_path, "--configfile", str(cfgfile), "--set-resources", "sweep_trial:tasks=1",
                      "--allowed-rules", "sweep_trial", "select_sweep", "evaluate_sweep_winner",
                      "--", "results/sweep/evaluate/metrics.json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    ok = json.loads((tmp_path / "results/sweep/trials/t000/result.json").read_text())
    bad = json.loads((tmp_path / "results/sweep/trials/t001/result.json").read_text())
    assert ok["status"] == "ok" and 0.0 <= ok["val_metric"] <= 1.0 and ok["params"] == {"optim.lr": 1e-3}
    assert bad["status"] == "failed" and bad["reason"].startswith("diverged") and bad["val_metric"] is None
    assert not (tmp_path / "results/sweep/trials/t001/model.pt").exists()
    table = pd.read_csv(tmp_path / "results/sweep/trials.csv")
    assert list(table["trial"]) == ["t000", "t001"] and list(table["status"]) == ["ok", "failed"]
    assert list(table["winner"]) == [True, False]
    selection = json.loads((tmp_path / "results/sweep/selection.json").read_text())
    assert selection["winner"]["trial"] == "t000" and selection["n_failed"] == 1
    # the test split was used once: only the winner has test predictions
    preds = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("predictions.csv"))
    assert preds == ["results/sweep/evaluate/predictions.csv"]
    metrics = json.loads((tmp_path / "results/sweep/evaluate/metrics.json").read_text())
    assert metrics["model"].endswith("results/sweep/winner/model.pt")
    assert math.isclose(metrics["model_val_metric"], ok["val_metric"], rel_tol=1e-9)


def test_freeze_backbone_stages():
    from chexflow.train.models import ModelError, backbone_stages, build_model, freeze_backbone
    model = build_model("resnet18", in_channels=1, num_outputs=14)
    assert [n for n, _ in backbone_stages(model)] == ["conv1", "bn1", "layer1", "layer2", "layer3", "layer4"]
    assert freeze_backbone(model, 3) == ["conv1", "bn1", "layer1"]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.split(".")[0] in ("conv1", "bn1", "layer1") for n in frozen)
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith(("layer2", "fc")))
    with pytest.raises(ModelError, match="outside 0..6"):
        freeze_backbone(build_model("resnet18", in_channels=1, num_outputs=2), 7)


def test_frozen_stages_do_not_train(tmp_path, demo_manifest, monkeypatch):
    """The real trainer (single process) with freeze: 2 leaves conv1/bn1 weights as initialised."""
    import torch
    from chexflow.train.checkpoint import load_model_file
    from chexflow.train.backends import init_backend
    from chexflow.train.models import build_model
    from chexflow.train.trainer import Trainer, TrainPaths
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = from_dict(TrainConfig, {"stage": "finetune", "dataset": "nih_demo", "backend": "single", "init": "random",
                                  "epochs": 1, "batch_size": 16, "freeze": 2, "max_steps": 3,
                                  "optim": {"name": "adam", "lr": 0.01, "weight_decay": 0.0},
                                  "data": {"crop": 32, "workers": 0}})
    backend = init_backend("single", fusion_threshold_mb=64)
    try:
        trainer = Trainer(cfg, TrainPaths(manifest=demo_manifest, out_dir=tmp_path / "out",
                                          ckpt_dir=tmp_path / "ckpt"), backend)
        assert trainer.fit() == 0
    finally:
        backend.shutdown()
    torch.manual_seed(cfg.seed)
    init = build_model("resnet18", in_channels=1, num_outputs=14).state_dict()
    trained = load_model_file(tmp_path / "out/model.pt")["state_dict"]
    assert torch.equal(trained["conv1.weight"], init["conv1.weight"])
    assert torch.equal(trained["bn1.weight"], init["bn1.weight"])
    assert not torch.equal(trained["layer1.0.conv1.weight"], init["layer1.0.conv1.weight"])


def test_setup_errors_fail_the_job_not_the_trial(tmp_path):
    """What no trial can fix raises before any rank starts (the sweep_trial job fails, nothing recorded)."""
    base = {"stage": "finetune", "init": "pretrained"}
    kw = dict(trial_id="t000", launcher=["chexflow", "launch"], ranks=1, out_dir=tmp_path / "t000")
    with pytest.raises(sweep.SweepError, match="input not found"):
        sweep.run_trial(base, {}, manifest=tmp_path / "missing.json", pretrained=None, **kw)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(sweep.SweepError, match="input not found: None"):
        sweep.run_trial(base, {}, manifest=tmp_path / "manifest.json", pretrained=None, **kw)
    with pytest.raises(sweep.SweepError, match="unknown torchvision model"):
        sweep.run_trial({**base, "model": {"arch": "resnet-nope"}}, {}, manifest=tmp_path / "manifest.json",
                        pretrained=None, **kw)
    with pytest.raises(sweep.ConfigError, match="batch_size"):
        sweep.run_trial(base, {"batch_size": "big"}, manifest=tmp_path / "manifest.json", pretrained=None, **kw)
    assert not (tmp_path / "t000" / "result.json").exists()
