"""Config: the schema is generated from the dataclasses, unknown keys/wrong types fail by name."""
from pathlib import Path

import jsonschema
import pytest
import yaml

from chexflow import config as C

REPO = Path(__file__).resolve().parents[1]


def test_schema_file_in_sync_with_dataclasses():
    committed = yaml.safe_load((REPO / "workflow/chexflow/schemas/config.schema.yaml").read_text())
    assert committed == C.study_schema(), "regenerate: python -m chexflow.config > workflow/chexflow/schemas/config.schema.yaml"


def test_config_yaml_validates_and_builds_every_stage():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    jsonschema.validate(cfg, C.study_schema())
    for stage in ("pretrain", "finetune"):
        t = C.from_dict(C.TrainConfig, {**cfg[stage], "stage": stage})
        assert t.stage == stage and t.batch_size > 0
    for ds, sc in cfg["shards"].items():
        assert C.from_dict(C.ShardConfig, {**sc, "dataset": ds}).image_size > 0
    C.from_dict(C.EvaluateConfig, cfg["evaluate"])
    C.from_dict(C.DemoReleaseConfig, cfg["demo_release"])


def test_unknown_key_named_with_its_path():
    with pytest.raises(C.ConfigError, match=r"optim\.lrr"):
        C.from_dict(C.TrainConfig, {"optim": {"lrr": 0.1}})


@pytest.mark.parametrize("data, key", [
    ({"epochs": "three"}, "epochs"),
    ({"optim": {"lr": "fast"}}, "optim.lr"),
    ({"backend": "mpi"}, "backend"),
    ({"channels_last": "yes"}, "channels_last"),
    ({"data": {"samples_per_epoch": 1.5}}, "data.samples_per_epoch"),
])
def test_wrong_type_named(data, key):
    with pytest.raises(C.ConfigError, match=key.replace(".", r"\.")):
        C.from_dict(C.TrainConfig, data)


def test_schema_rejects_unknown_key_in_config_yaml():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["pretrain"]["optim"]["learning_rate"] = 0.1
    with pytest.raises(jsonschema.ValidationError, match="learning_rate"):
        jsonschema.validate(cfg, C.study_schema())


def test_stage_config_roundtrip(tmp_path):
    t = C.TrainConfig(epochs=7, optim=C.OptimConfig(lr=0.3))
    C.write_yaml_atomic(t, tmp_path / "c.yaml")
    assert C.load_stage_config(C.TrainConfig, path=tmp_path / "c.yaml") == t
    with pytest.raises(C.ConfigError, match="c.yaml"):
        (tmp_path / "c.yaml").write_text("epochs: [1\n")
        C.load_stage_config(C.TrainConfig, path=tmp_path / "c.yaml")


def test_json_exponent_numbers_are_numbers():
    t = C.load_stage_config(C.TrainConfig, text='{"optim": {"weight_decay": 5e-05}}')
    assert t.optim.weight_decay == 5e-05
