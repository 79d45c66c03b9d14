"""Every weights file is checked the same way (checkpoint.weights_problem: the same keys, the same
shapes): resume checkpoints (a refused one is renamed aside and the next older one resumed),
``best-<run id>.pt`` (a refused one is rebuilt from the checkpoint of its epoch, or the error says
what to delete), ``model.pt`` for evaluate, predict and export, and the pretrained backbone
(resnet34 weights under resnet18 fields are refused, not half-loaded). Files are built from
torchvision models here; nothing is downloaded."""
from __future__ import annotations

import re

import pytest
import torch

from chexflow.data import nih
from chexflow.evaluate import run as evaluate
from chexflow.evaluate.config import EvaluateConfig
from chexflow.predict import export
from chexflow.predict.config import ExportConfig
from chexflow.predict.model import load_predictor
from chexflow.train import checkpoint as ckpt
from chexflow.train import trainer as T
from chexflow.train.backends import Backend
from chexflow.train.models import ModelError, build_model, head_prefix
from test_trainer_paths import cfg_of

LABELS = list(nih.LABELS)      # the demo's findings


def _record(sd: dict, arch: str = "resnet18", run_id: str = "r1") -> dict:
    return ckpt.model_record(state_dict=sd, run_id=run_id, stage="finetune", dataset="nih_demo", task="multilabel",
                             labels=LABELS, arch=arch, in_channels=1, crop=32, epoch=1, val_metric=0.5,
                             val_metric_name="mean_auroc", config={})


def _variants() -> dict[str, tuple[dict, str]]:
    """A resnet18 state dict with one tensor missing, one extra, one of another shape, and the
    message part each must give (computed from the model, not typed in)."""
    sd = build_model("resnet18", in_channels=1, num_outputs=14).state_dict()
    last = list(sd)[-1]
    missing = {k: v for k, v in sd.items() if k != last}
    extra = {**sd, "layer5.0.conv1.weight": torch.zeros(3)}
    wrong = {**sd, last: torch.zeros(3)}
    return {"missing": (missing, f"1 expected tensor(s) missing ({last})"),
            "extra": (extra, "1 tensor(s) the network does not have (layer5.0.conv1.weight)"),
            "shape": (wrong, f"1 tensor(s) of another shape ({last}: (3,) where {tuple(sd[last].shape)} is expected)")}


def test_weights_problem_names_the_first_mismatching_keys():
    sd = build_model("resnet18", in_channels=1, num_outputs=14).state_dict()
    assert ckpt.weights_problem(sd, dict(sd)) is None
    for got, part in _variants().values():
        assert ckpt.weights_problem(sd, got) == part
    r34 = build_model("resnet34", in_channels=1, num_outputs=14).state_dict()
    extra = [k for k in r34 if k not in sd]
    problem = ckpt.weights_problem(sd, r34)
    assert problem == f"{len(extra)} tensor(s) the network does not have ({', '.join(extra[:3])}, ...)"


@pytest.mark.parametrize("case", ["missing", "extra", "shape"])
def test_model_file_readers_refuse_weights_that_do_not_fit(case, demo_manifest, tmp_path):
    got, part = _variants()[case]
    path = tmp_path / "model.pt"
    ckpt.save_atomic(_record(got), path)
    expected = f"{path}: refused: its weights do not fit resnet18 with 1 input channel(s) and 14 outputs: {part}"
    metrics = tmp_path / "metrics.json"     # never reached: the model is refused first
    readers = {"load_model": lambda: ckpt.load_model(path),
               "evaluate": lambda: evaluate.run(EvaluateConfig(bootstrap_resamples=10), model_path=path,
                                                manifest=demo_manifest, out_dir=tmp_path / "ev"),
               "predict": lambda: load_predictor(path, demo_manifest, metrics),
               "export": lambda: export.run(ExportConfig(), model_path=path, manifest=demo_manifest,
                                            metrics=metrics, out_dir=tmp_path / "ex")}
    for name, read in readers.items():
        with pytest.raises(ckpt.ModelFileError) as err:
            read()
        assert str(err.value) == expected, name
    assert not (tmp_path / "ev").exists() and not (tmp_path / "ex").exists()


def _trainer(cfg, manifest, tmp_path, pretrained=None) -> T.Trainer:
    paths = T.TrainPaths(manifest=manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt", pretrained=pretrained)
    return T.Trainer(cfg, paths, Backend())


def test_backbone_of_another_architecture_is_refused_not_half_loaded(demo_manifest, tmp_path, capsys):
    """resnet34 weights in a model file that says resnet18: its 120 shared tensors used to be taken
    and the rest ignored (exit 0); the file is refused naming it and the tensors resnet18 does not have."""
    r18 = build_model("resnet18", in_channels=1, num_outputs=14)
    r34 = build_model("resnet34", in_channels=1, num_outputs=14).state_dict()
    pre = tmp_path / "pretrain.pt"
    ckpt.save_atomic(_record(r34), pre)
    cfg = cfg_of(init="pretrained", max_steps=1, epochs=1)
    t = _trainer(cfg, demo_manifest, tmp_path, pre)
    head = head_prefix(r18)
    extra = [k for k in r34 if k not in r18.state_dict()]
    model, opt, sched = t._build()
    with pytest.raises(ModelError, match=re.escape(f"{pre}: refused: its backbone does not fit this model's: "
                                                   f"{len(extra)} tensor(s) the network does not have")):
        t._restore(model, opt, sched)
    # a file that fits: every backbone tensor is taken, and the log says how many of the file's
    ckpt.save_atomic(_record(r18.state_dict()), pre)
    t = _trainer(cfg, demo_manifest, tmp_path, pre)
    model, opt, sched = t._build()
    capsys.readouterr()
    t._restore(model, opt, sched)
    n_backbone = sum(not k.startswith(head) for k in r18.state_dict())
    assert f"initialised {n_backbone} backbone tensors from {pre} (of its {len(r18.state_dict())};" \
        in capsys.readouterr().err
    assert all(torch.equal(model.state_dict()[k], v) for k, v in r18.state_dict().items() if not k.startswith(head))


def test_wrong_shape_resume_checkpoint_is_set_aside_and_the_next_older_resumed(demo_manifest, tmp_path, capsys):
    cfg = cfg_of(max_steps=2, epochs=1, checkpoint={"every_steps": 1, "keep": 5})
    assert _trainer(cfg, demo_manifest, tmp_path).fit() == 0
    newest, older = reversed(ckpt.list_checkpoints(tmp_path / "ckpt"))
    state = torch.load(newest, weights_only=True)
    last = list(state["model"])[-1]
    state["model"][last] = torch.zeros(3)
    ckpt.save_atomic(state, newest)
    t = _trainer(cfg_of(max_steps=3, epochs=1, checkpoint={"every_steps": 1, "keep": 5}), demo_manifest, tmp_path)
    model, opt, sched = t._build()
    capsys.readouterr()
    prog = t._restore(model, opt, sched)
    log = capsys.readouterr().err
    assert prog.step == 1 and not newest.exists() and newest.with_name(newest.name + ".refused").is_file()
    assert (f"checkpoint {newest} refused: its weights do not fit this run's network: 1 tensor(s) of another "
            f"shape ({last}: (3,) where {tuple(model.state_dict()[last].shape)} is expected)") in log
    assert f"resuming from {older} at step 1: epoch 1/1, 1 of its {t.steps_per_epoch} steps done" in log


def test_refused_best_model_is_rebuilt_from_its_epochs_checkpoint(demo_manifest, tmp_path, capsys):
    cfg = cfg_of(epochs=1, data={"samples_per_epoch": 32}, checkpoint={"every_steps": 0, "keep": 2})
    t = _trainer(cfg, demo_manifest, tmp_path)
    assert t.fit() == 0
    good = torch.load(tmp_path / "out/model.pt", weights_only=True)
    best = t.best_path
    wrong = {**good["state_dict"], list(good["state_dict"])[-1]: torch.zeros(3)}
    ckpt.save_atomic({**good, "state_dict": wrong}, best)
    (tmp_path / "out/model.pt").unlink()
    capsys.readouterr()
    assert _trainer(cfg, demo_manifest, tmp_path).fit() == 0       # resumes at the end, writes model.pt again
    log = capsys.readouterr().err
    assert f"checkpoint {best} refused: its weights do not fit this run's network" in log
    assert best.with_name(best.name + ".refused").is_file() and "best model of epoch 1 rebuilt from" in log
    again = torch.load(tmp_path / "out/model.pt", weights_only=True)
    assert all(torch.equal(again["state_dict"][k], v) for k, v in good["state_dict"].items())
    assert {k: v for k, v in again.items() if k != "state_dict"} == {k: v for k, v in good.items() if k != "state_dict"}


def test_refused_best_model_without_its_checkpoint_says_what_to_delete(tmp_path):
    best = tmp_path / "best-r1.pt"
    ckpt.save_atomic(_record(_variants()["shape"][0]), best)
    expect = build_model("resnet18", in_channels=1, num_outputs=14).state_dict()
    with pytest.raises(ckpt.ModelFileError) as err:
        ckpt.best_model(best, tmp_path, run_id="r1", epoch=1, step=4, expect_model=expect, rebuild=dict,
                        log=lambda m: None)
    assert str(err.value).startswith(f"{best}: refused (its weights do not fit this run's network: 1 tensor(s) "
                                     "of another shape")
    assert str(err.value).endswith(f"no valid checkpoint of its epoch 1 (step 4) is left to rebuild it: delete "
                                   f"{tmp_path}/step-*-r1.pt and rerun to train this run again")
    assert not best.exists() and best.with_name(best.name + ".refused").is_file()
