"""The ``predict`` record of a model file, checked where it is written (chexflow.evaluate.predict_record;
training checks the fields every model file has and knows nothing of it): a well-formed record passes
and survives a save and a weights-only load; each malformed one is refused naming its key. (The record
evaluation writes, and predicting from it alone: tests/test_predict.py.)"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from chexflow.data import nih
from chexflow.evaluate import model_file
from chexflow.evaluate.predict_record import predict_problems, predict_record, refuse_if_malformed
from chexflow.train import checkpoint as ckpt

LABELS = list(nih.LABELS)


def _record() -> dict:
    return predict_record(stored_size=40, mean=0.5, std=0.25, synthetic=True, dataset_title="phantoms", decoding="grey",
                          thresholds={label: 0.1 * (k % 10) for k, label in enumerate(LABELS) if k != 3},
                          val_positives={label: {"images": k, "patients": k // 2} for k, label in enumerate(LABELS)},
                          min_val_positives=5, cam_layer=None, labels=LABELS)


def _model(predict: dict | None) -> dict:
    sd = {"w": torch.zeros(2, 2)}
    record = ckpt.model_record(state_dict=sd, run_id="r1", stage="finetune", dataset="nih_demo", task="multilabel",
                               labels=LABELS, arch="resnet18", in_channels=1, crop=32, epoch=1, val_metric=0.5,
                               val_metric_name="mean_auroc", config={})
    return {**record, "predict": predict} if predict is not None else record


def test_a_well_formed_record_passes_and_survives_a_weights_only_load(tmp_path):
    record = _record()
    assert record["thresholds"][LABELS[3]] is None and record["thresholds"][LABELS[2]] == pytest.approx(0.2)
    assert predict_problems(record, LABELS) == [] and ckpt.model_problems(_model(record)) == []
    ckpt.save_atomic(_model(record), tmp_path / "model.pt")
    info = ckpt.load_model_file(tmp_path / "model.pt")
    assert info["predict"] == record
    refuse_if_malformed(info, tmp_path / "model.pt")
    refuse_if_malformed(_model(None), "fine-tuning's model.pt")          # no record: nothing to refuse


CASES = [
    (lambda r: r.pop("val_positives"), "no 'predict.val_positives'"),
    (lambda r: r.update(stored_size=True), "predict.stored_size is a bool"),
    (lambda r: r.update(stored_size=0), "predict.stored_size 0 is not a side in px"),
    (lambda r: r.update(synthetic=1), "predict.synthetic is a int"),
    (lambda r: r.update(cam_layer=3), "predict.cam_layer is a int"),
    (lambda r: r.update(format=1), "predict.format is 1; this chexflow reads predict format 2"),
    (lambda r: r.update(decoding="bmp"), "predict.decoding 'bmp' is not a way of reading image files"),
    (lambda r: r["thresholds"].update(Unicorn=0.3), "predict.thresholds names label(s) the model does not have: "
                                                    "['Unicorn']"),
    (lambda r: r["thresholds"].pop(LABELS[0]), f"predict.thresholds lacks the model's label(s) ['{LABELS[0]}']"),
    (lambda r: r["thresholds"].update({LABELS[1]: float("nan")}), f"predict.thresholds.{LABELS[1]} is nan, "
                                                                  "not a probability or null"),
    (lambda r: r["thresholds"].update({LABELS[1]: "0.5"}), f"predict.thresholds.{LABELS[1]} is '0.5'"),
    (lambda r: r["val_positives"].update({LABELS[2]: {"images": -1, "patients": 0}}),
     f"predict.val_positives.{LABELS[2]} is {{'images': -1, 'patients': 0}}"),
]


@pytest.mark.parametrize("change,message", CASES)
def test_a_malformed_record_is_refused_naming_its_key(change, message, tmp_path):
    record = copy.deepcopy(_record())
    change(record)
    problems = predict_problems(record, LABELS)
    assert any(p.startswith(message) for p in problems), problems
    torch.save(_model(record), tmp_path / "model.pt")
    info = ckpt.load_model_file(tmp_path / "model.pt")        # training's check: the fields every model file has
    with pytest.raises(ckpt.ModelFileError, match=f"{tmp_path / 'model.pt'}: refused: .*predict"):
        refuse_if_malformed(info, tmp_path / "model.pt")


def test_evaluation_refuses_a_manifest_that_cannot_make_the_record(tmp_path):
    manifest = {"dataset": "nih_demo", "title": "phantoms", "synthetic": "no", "image_size": 40, "labels": LABELS,
                "task": "multilabel", "splits": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(model_file.ModelFileInputError, match=r"manifest.json: 'synthetic' must be a bool, got 'no'"):
        model_file.record_of({"labels": {}, "min_val_positives": 5}, tmp_path / "manifest.json", LABELS)
