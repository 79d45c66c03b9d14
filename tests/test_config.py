"""Config: each component's settings with the component, config.yaml checked as a whole before any job
(types, ranges, relations; every problem at once), the schema generated from the dataclasses, the
shared training section resolved into the same per-stage TrainConfig as before the split."""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing

import jsonschema
import pytest
import yaml

from chexflow import config as C
from chexflow.data.config import DemoReleaseConfig, ShardConfig
from chexflow.settings import ConfigError, from_dict, load_stage_config, range_of, write_yaml_atomic
from chexflow.train import config as T
from chexflow.train.config import OptimConfig, TrainConfig
from chexflow.train.identity import settings_digest
from conftest import REPO, snakemake

# The run ids main (c401af0, before the training section was shared) computed for the default
# config.yaml, from settings alone: an unchanged recipe keeps this part of its identity.
MAIN_RUN_IDS = {"pretrain": "10bcb28840f91450", "finetune": "6a535442a4c4c4bf", "ablation": "0bcf04d2e222193d"}


def default() -> dict:
    """config.yaml as a plain mapping (JSON round trip: YAML aliases become separate copies)."""
    return json.loads(json.dumps(yaml.safe_load((REPO / "config.yaml").read_text())))


def test_schema_file_in_sync_with_dataclasses():
    committed = yaml.safe_load((REPO / "workflow/chexflow/schemas/config.schema.yaml").read_text())
    assert committed == C.study_schema(), \
        "regenerate: python -m chexflow.config > workflow/chexflow/schemas/config.schema.yaml"


def test_config_yaml_validates_and_builds_every_stage():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    jsonschema.validate(cfg, C.study_schema())
    study = C.check_study(cfg)
    assert study.train["pretrain"].stage == "pretrain" and study.train["finetune"].init == "pretrained"
    shared = dataclasses.replace(study.shards["nih_demo"], dataset="nih_demo_pretrain")     # (a YAML alias)
    assert study.shards["nih_demo_pretrain"] == shared
    assert study.releases["nih_demo"].n_archives == 3
    assert len((REPO / "config.yaml").read_text().splitlines()) <= 200


def test_run_ids_of_the_unchanged_recipe_are_mains():
    study = C.check_study(default())
    assert settings_digest(study.train["pretrain"])[:16] == MAIN_RUN_IDS["pretrain"]
    assert settings_digest(study.train["finetune"])[:16] == MAIN_RUN_IDS["finetune"]
    ablation = dataclasses.replace(study.train["finetune"], init="random")
    assert settings_digest(ablation)[:16] == MAIN_RUN_IDS["ablation"]


def test_a_stage_overrides_a_shared_key_and_the_rules_get_the_resolved_section():
    cfg = default()
    study = C.check_study(cfg)
    assert cfg["training"]["data"]["shuffle_buffer"] == 1000 and cfg["pretrain"]["data"]["shuffle_buffer"] == 2000
    assert study.train["pretrain"].data.shuffle_buffer == 2000 and study.train["finetune"].data.shuffle_buffer == 1000
    for stage in ("pretrain", "finetune"):          # the shared values, written once, in both
        t = study.train[stage]
        shared = (t.backend, t.checkpoint.every_steps, t.optim.implementation, t.ddp.timeout_s)
        assert shared == ("horovod", 50, "fused", 1800)
    cfg["finetune"]["checkpoint"] = {"every_steps": 7}       # one key of a nested shared section
    study = C.check_study(cfg)
    assert study.train["finetune"].checkpoint == T.CheckpointConfig(every_steps=7, keep=3, on_world_change="refuse")
    assert study.train["pretrain"].checkpoint.every_steps == 50
    # what `chexflow train` receives builds the very same TrainConfig
    sent = C.stage_settings(cfg, "finetune", "nih_demo", init="random")
    assert from_dict(TrainConfig, sent) == dataclasses.replace(study.train["finetune"], init="random")


def test_run_keys_and_recipe_keys_are_a_partition():
    keys = T.leaf_keys(TrainConfig)
    shared = [k for k in keys if T.is_run_key(k)]
    assert "checkpoint.keep" in shared and "data.workers" in shared and "optim.implementation" in shared
    assert "optim.lr" not in shared and "data.crop" not in shared and "epochs" not in shared
    schema = C.study_schema()["properties"]
    assert set(schema["training"]["properties"]) == {k.split(".")[0] for k in shared}
    assert "freeze" in schema["finetune"]["properties"] and "freeze" not in schema["pretrain"]["properties"]
    assert {"init", "init_file"} <= set(schema["pretrain"]["properties"]) & set(schema["finetune"]["properties"])
    assert "backbone_lr_mult" not in schema["pretrain"]["properties"]["optim"]["properties"]


def test_unknown_key_named_with_its_path():
    with pytest.raises(ConfigError, match=r"optim\.lrr"):
        from_dict(TrainConfig, {"optim": {"lrr": 0.1}})


@pytest.mark.parametrize("data, key", [
    ({"epochs": "three"}, "epochs"),
    ({"optim": {"lr": "fast"}}, "optim.lr"),
    ({"backend": "mpi"}, "backend"),
    ({"channels_last": "yes"}, "channels_last"),
    ({"data": {"samples_per_epoch": 1.5}}, "data.samples_per_epoch"),
])
def test_wrong_type_named(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_dict(TrainConfig, data)


def test_schema_rejects_unknown_key_in_config_yaml():
    cfg = default()
    cfg["pretrain"]["optim"]["learning_rate"] = 0.1
    with pytest.raises(jsonschema.ValidationError, match="learning_rate"):
        jsonschema.validate(cfg, C.study_schema())


def test_stage_config_roundtrip(tmp_path):
    t = TrainConfig(epochs=7, optim=OptimConfig(lr=0.3))
    write_yaml_atomic(t, tmp_path / "c.yaml")
    assert load_stage_config(TrainConfig, path=tmp_path / "c.yaml") == t
    with pytest.raises(ConfigError, match="c.yaml"):
        (tmp_path / "c.yaml").write_text("epochs: [1\n")
        load_stage_config(TrainConfig, path=tmp_path / "c.yaml")


def test_json_exponent_numbers_are_numbers():
    t = load_stage_config(TrainConfig, text='{"optim": {"weight_decay": 5e-05}}')
    assert t.optim.weight_decay == 5e-05


# --------------------------------------------------------------------------- ranges and relations

def _set(cfg: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


# (changes to the default config.yaml, the one problem expected: a regex naming key, value and range)
BAD = [
    # the stall watchdog
    ({"watchdog.factor": 0.5}, r"watchdog\.factor: 0\.5 is not >= 1"),
    # study
    ({"study.pretrain_dataset": "nih_demo"},
     r"study\.pretrain_dataset: 'nih_demo' is not one of \['fashion_mnist', 'nih_demo_pretrain', 'imagenet'\]"),
    # datasets
    ({"datasets.nih.archives": [0, 2]}, r"datasets\.nih\.archives\[0\]: 0 is not >= 1"),
    ({"datasets.nih.archives": [1, 1]}, r"datasets\.nih\.archives: \[1, 1\] lists a value twice"),
    ({"study.finetune_dataset": "nih", "datasets.nih.archives": [3, 13]},
     r"datasets\.nih\.archives: \[13\] not archive number\(s\) of the release \(1\.\.12\)"),
    ({"datasets.nih_demo": {"mirror": "/x"}}, r"datasets\.nih_demo: not a downloaded dataset"),
    # the generated releases
    ({"demo_release.n_images": 0}, r"demo_release\.n_images: 0 is not >= 1"),
    ({"demo_release.test_fraction": 1.0}, r"demo_release\.test_fraction: 1\.0 is not in \(0, 1\)"),
    ({"demo_pretrain_release.image_size": 4}, r"demo_pretrain_release\.image_size: 4 is not in \[8, 4096\]"),
    ({"demo_pretrain_release.images_per_archive": -5}, r"demo_pretrain_release\.images_per_archive: -5 is not >= 1"),
    # shards
    ({"shards.nih_demo.image_size": 1}, r"shards\.nih_demo\.image_size: 1 is not in \[8, 4096\]"),
    ({"shards.nih_demo.val_fraction": 1.5}, r"shards\.nih_demo\.val_fraction: 1\.5 is not in \[0, 1\)"),
    ({"shards.nih_demo.val_fraction": 0}, r"shards\.nih_demo\.val_fraction: 0 leaves finetune without a validation "
                                          r"split \(training keeps the epoch that validates best, evaluation sets its "
                                          r"thresholds on it\); give a fraction above 0"),
    ({"study.pretrain_dataset": "fashion_mnist", "shards.fashion_mnist.val_fraction": 0.0},
     r"shards\.fashion_mnist\.val_fraction: 0 leaves pretrain without a validation split"),
    ({"shards.nih.max_reject_fraction": -0.1}, r"shards\.nih\.max_reject_fraction: -0\.1 is not in \[0, 1\]"),
    ({"shards.imagenet.train_parts": 0}, r"shards\.imagenet\.train_parts: 0 is not in \[1, 1000\]"),
    ({"study.pretrain_dataset": "imagenet", "shards.imagenet.val_fraction": 0.1},
     r"shards\.imagenet\.val_fraction: 0\.1 is not 0: the validation split is the official ILSVRC2012 val set"),
    ({"shards.nih.train_parts": 4}, r"shards\.nih\.train_parts: not allowed here \(not a setting of this dataset\)"),
    ({"shards.fashion_mnist.samples_per_shard": 0}, r"shards\.fashion_mnist\.samples_per_shard: 0 is not >= 1"),
    ({"shards.nih_demo_pretrain.image_size": 96},
     r"shards\.nih_demo_pretrain\.image_size: 96 is not <= demo_pretrain_release\.image_size \(64\)"),
    # training (how it runs)
    ({"training.checkpoint.keep": -1}, r"training\.checkpoint\.keep: -1 is not >= 1"),
    ({"training.check_every_steps": 0}, r"training\.check_every_steps: 0 is not >= 1"),
    ({"training.horovod.backward_passes_per_step": 0}, r"training\.horovod\.backward_passes_per_step: 0 is not >= 1"),
    ({"training.ddp.timeout_s": 0}, r"training\.ddp\.timeout_s: 0 is not >= 1"),
    ({"training.data.workers": -1}, r"training\.data\.workers: -1 is not >= 0"),
    ({"training.epochs": 3}, r"training\.epochs: not allowed here \(training: says how training runs"),
    # pretrain (what is trained)
    ({"pretrain.optim.lr": -0.001}, r"pretrain\.optim\.lr: -0\.001 is not > 0"),
    ({"pretrain.optim.lr": float("nan")}, r"pretrain\.optim\.lr: expected a finite number, got nan"),
    ({"pretrain.data.crop": 128}, r"pretrain\.data\.crop: 128 is not <= shards\.nih_demo_pretrain\.image_size \(64\)"),
    ({"pretrain.epochs": 0}, r"pretrain\.epochs: 0 is not >= 1"),
    ({"pretrain.batch_size": 0}, r"pretrain\.batch_size: 0 is not >= 1"),
    ({"pretrain.init": "pretrained"}, r"pretrain\.init: pretrained is for fine-tuning"),
    ({"pretrain.freeze": 1}, r"pretrain\.freeze: not allowed here \(fine-tuning only"),
    ({"finetune.init": "file"}, r"finetune\.init_file: missing: init: file loads the starting weights"),
    ({"finetune.init": "file", "finetune.init_file": "/nonexistent/densenet121.pth"},
     r"finetune\.init_file: /nonexistent/densenet121\.pth does not exist"),
    ({"pretrain.schedule.warmup_epochs": 5}, r"pretrain\.schedule\.warmup_epochs: 5 is not <= pretrain\.epochs \(3\)"),
    ({"pretrain.model.dropout": 1.0}, r"pretrain\.model\.dropout: 1\.0 is not in \[0, 1\)"),
    ({"pretrain.data.augment.scale_min": 0}, r"pretrain\.data\.augment\.scale_min: 0\.0 is not in \(0, 1\]"),
    ({"pretrain.optim.name": "sgd", "pretrain.optim.momentum": 0.0, "pretrain.optim.nesterov": True},
     r"pretrain\.optim\.nesterov: true needs optim\.momentum > 0"),
    ({"pretrain.schedule.step_epochs": [2]}, r"pretrain\.schedule\.step_epochs: \[2\] is set but decay is 'cosine'"),
    # finetune: what fails only after pretraining fails now
    ({"finetune.freeze": 7},
     r"finetune\.freeze: 7 is not in 0\.\.6, the backbone stages of resnet18 \(conv1, bn1, layer1"),
    ({"finetune.transfer_stages": 9}, r"finetune\.transfer_stages: 9 is not in 0\.\.6"),
    ({"finetune.model.arch": "resnet34"},
     r"finetune\.model\.arch: 'resnet34' is not pretrain\.model\.arch \('resnet18'\)"),
    ({"finetune.data.samples_per_epoch": 8}, r"finetune\.data\.samples_per_epoch: 8 is not >= 32 \(batch_size x"),
    ({"finetune.data.crop": 96}, r"finetune\.data\.crop: 96 is not <= shards\.nih_demo\.image_size \(64\)"),
    ({"finetune.optim.backbone_lr_mult": 0}, r"finetune\.optim\.backbone_lr_mult: 0\.0 is not > 0"),
    ({"finetune.optim.momentum": 1.5}, r"finetune\.optim\.momentum: 1\.5 is not in \[0, 1\)"),
    ({"finetune.transfer_stages": 2, "finetune.freeze": 4},
     r"finetune\.freeze: 4 is not <= finetune\.transfer_stages \(2\)"),
    # the ablation fine-tunes the same section from the pretraining model: its relations hold too
    ({"finetune.init": "random", "finetune.transfer_stages": 2, "finetune.freeze": 3},
     r"finetune\.freeze: 3 is not <= finetune\.transfer_stages \(2\)"),
    # evaluate
    ({"evaluate.bootstrap_resamples": 0}, r"evaluate\.bootstrap_resamples: 0 is not >= 1"),
    ({"evaluate.calibration_bins": 0}, r"evaluate\.calibration_bins: 0 is not in \[1, 100\]"),
    ({"evaluate.age_bands": [60, 18]}, r"evaluate\.age_bands: \[60, 18\] is not a non-empty ascending list of ages"),
    ({"evaluate.saliency.top_k": -1}, r"evaluate\.saliency\.top_k: -1 is not >= 0"),
    # a Grad-CAM layer the fine-tuned network does not have: found now, not after evaluation's inference
    ({"evaluate.saliency.layer": "fc"}, r"evaluate\.saliency\.layer: 'fc' is not a backbone stage of "
                                        r"finetune\.model\.arch resnet18 \(stages: conv1, bn1, layer1, layer2, layer3, "
                                        r"layer4\); auto picks"),
    ({"ablation.seeds": []}, r"ablation\.seeds: \[\] lists no seed"),
    ({"evaluate.crop": 32}, r"evaluate\.crop: unknown key; known: age_bands, batch_size, bootstrap_resamples, "
     r"calibration_bins, external, min_patients, min_val_positives, saliency, seed"),
    # scaling
    ({"scaling.world_sizes": [1, 1]}, r"scaling\.world_sizes: \[1, 1\] lists a value twice"),
    ({"scaling.world_sizes": [0, 2]}, r"scaling\.world_sizes\[0\]: 0 is not >= 1"),
    ({"scaling.enabled": True, "scaling.crop": 128},
     r"scaling\.crop: 128 is not <= shards\.nih_demo_pretrain\.image_size \(64\)"),
    ({"scaling.epochs": 1}, r"scaling\.epochs: 1 is not >= 2"),
    # sweep
    ({"sweep.space.optim.lr": [0.001, -1.0]}, r"sweep\.space\.optim\.lr\[1\]: -1\.0 is not > 0"),
    ({"sweep.space.model.dropout": [1.2]}, r"sweep\.space\.model\.dropout\[0\]: 1\.2 is not in \[0, 1\)"),
    ({"sweep.n_trials": 0}, r"sweep\.n_trials: 0 is not >= 1"),
    ({"sweep.enabled": True, "sweep.space.freeze": [0, 9]}, r"sweep\.space\.freeze\[1\]: 9 is not in 0\.\.6"),
    ({"sweep.enabled": True, "finetune.batch_size": 16, "finetune.data.samples_per_epoch": 24,
      "sweep.space.batch_size": [16, 32],
      "sweep.space.freeze": [], "sweep.space.optim.lr": []},
     r"sweep trial t001 \{\"batch_size\": 32\}: finetune\.data\.samples_per_epoch: 24 is not >= 32"),
    # ablation
    ({"ablation.enabled": "yes"}, r"ablation\.enabled: expected true/false, got 'yes'"),
    # predict, export (sections absent from config.yaml: their defaults)
    ({"predict.batch_size": 0}, r"predict\.batch_size: 0 is not >= 1"),
    ({"predict.enabled": True, "predict.modalities": []}, r"predict\.modalities: \[\] would refuse every DICOM"),
    ({"export.tolerance": 0.0}, r"export\.tolerance: 0\.0 is not in \(0, 1\)"),
    ({"container.image": "chexflow:latest"}, r"container\.image: 'chexflow:latest' is neither a \.sif file nor"),
    # a section no one reads
    ({"trainig": {"backend": "ddp"}}, r"trainig: unknown section"),
]


@pytest.mark.parametrize("changes, expected", BAD, ids=[" ".join(c) for c, _ in BAD])
def test_a_bad_value_fails_naming_key_value_and_range(changes, expected):
    cfg = default()
    for dotted, value in changes.items():
        _set(cfg, dotted, value)
    with pytest.raises(ConfigError) as err:
        C.check_study(cfg)
    assert len(err.value.problems) == 1, err.value.problems       # that value, and nothing it drags along
    assert re.search(expected, err.value.problems[0]), err.value.problems[0]


def test_the_table_covers_every_section():
    sections = {dotted.split(".")[0] for changes, _ in BAD for dotted in changes}
    assert set(C.study_schema()["properties"]) <= sections
    assert len(BAD) >= 30


def test_every_problem_is_listed_at_once():
    cfg = default()
    for dotted, value in {"training.checkpoint.keep": 0, "pretrain.optim.lr": -1.0, "pretrain.data.crop": 128,
                          "shards.nih_demo.val_fraction": 2.0, "evaluate.batch_size": 0,
                          "scaling.world_sizes": [2, 2], "sweep.space.freeze": [-1]}.items():
        _set(cfg, dotted, value)
    with pytest.raises(ConfigError) as err:
        C.check_study(cfg)
    keys = [p.split(":")[0] for p in err.value.problems]
    assert keys == ["shards.nih_demo.val_fraction", "training.checkpoint.keep", "pretrain.optim.lr",
                    "evaluate.batch_size", "scaling.world_sizes", "sweep.space.freeze[0]", "pretrain.data.crop"]
    assert str(err.value).startswith("7 problems:")


def test_yaml11_exponent_without_dot_is_the_number_meant(capsys):
    """PyYAML (YAML 1.1, what Snakemake reads config.yaml with) reads `lr: 1e-3` as a string: it is
    taken as the number, with a log line, and the config mapping the rules read holds the number."""
    text = (REPO / "config.yaml").read_text().replace("lr: 0.001", "lr: 1e-3", 1)
    cfg = yaml.safe_load(text)
    assert cfg["pretrain"]["optim"]["lr"] == "1e-3"
    study = C.check_study(cfg)
    assert study.train["pretrain"].optim.lr == 0.001 and cfg["pretrain"]["optim"]["lr"] == 0.001
    assert "pretrain.optim.lr: '1e-3' is a string in YAML 1.1" in capsys.readouterr().err
    assert settings_digest(study.train["pretrain"])[:16] == MAIN_RUN_IDS["pretrain"]
    # by hand, a stage's own YAML file: the same
    assert load_stage_config(OptimConfig, text="lr: 5e-4\nname: adam\n").lr == 0.0005
    # a string that is no number stays an error; an integer setting takes no string
    with pytest.raises(ConfigError, match=r"optim\.lr: expected a finite number, got 'fast'"):
        from_dict(TrainConfig, {"optim": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=r"epochs: expected an integer, got '3'"):
        from_dict(TrainConfig, {"epochs": "3"})


def _numeric_fields():
    """(class, field) of every int/float setting of every config section (lists and optionals too)."""
    seen, out = set(), []
    roots = [C.StudySection, DemoReleaseConfig, ShardConfig, TrainConfig, *C.STUDY_SECTIONS.values()]

    def visit(cls):
        if cls in seen:
            return
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                visit(tp)
                continue
            inner = {a for a in typing.get_args(tp) if a is not type(None)} | {tp}
            inner |= {x for a in inner for x in typing.get_args(a)}
            if inner & {int, float}:
                out.append((cls, f))

    for cls in roots:
        visit(cls)
    return out


def test_every_numeric_setting_has_a_range_and_the_schema_carries_it():
    fields = _numeric_fields()
    assert len(fields) > 40
    missing = [f"{cls.__name__}.{f.name}" for cls, f in fields if range_of(f) is None]
    assert not missing, f"give these settings a range (chexflow.settings.setting): {missing}"
    props = C.study_schema()["properties"]
    assert props["pretrain"]["properties"]["optim"]["properties"]["lr"] == {"type": "number", "exclusiveMinimum": 0.0}
    assert props["scaling"]["properties"]["world_sizes"] == {
        "type": "array", "items": {"type": "integer", "minimum": 1}, "uniqueItems": True}
    assert props["shards"]["properties"]["nih"]["properties"]["val_fraction"] == {
        "type": "number", "minimum": 0.0, "exclusiveMaximum": 1.0}


def test_the_schema_refuses_what_the_ranges_refuse():
    cfg = default()
    cfg["training"]["checkpoint"]["keep"] = 0
    with pytest.raises(jsonschema.ValidationError, match="less than the minimum of 1"):
        jsonschema.validate(cfg, C.study_schema())


def test_a_snakemake_dry_run_lists_every_bad_value_before_any_job(tmp_path):
    cfg = default()
    for dotted, value in {"training.checkpoint.keep": 0, "pretrain.optim.lr": -0.1, "finetune.freeze": 9,
                          "shards.nih_demo.image_size": 2, "evaluate.crop": 32,
                          "shards.nih_demo_pretrain.val_fraction": 0, "shards.nih_demo.val_fraction": 0}.items():
        _set(cfg, dotted, value)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(tmp_path, "-n", "--configfile", str(tmp_path / "config.yaml"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "7 problems:" in out and "Job stats" not in out
    for expected in ("training.checkpoint.keep: 0 is not >= 1", "pretrain.optim.lr: -0.1 is not > 0",
                     "finetune.freeze: 9 is not in 0..6", "shards.nih_demo.image_size: 2 is not in [8, 4096]",
                     "evaluate.crop: unknown key",
                     "shards.nih_demo_pretrain.val_fraction: 0 leaves pretrain without a validation split",
                     "shards.nih_demo.val_fraction: 0 leaves finetune without a validation split"):
        assert expected in out, out[-3000:]


def test_a_snakemake_dry_run_takes_a_yaml11_exponent_as_its_number(tmp_path):
    text = (REPO / "config.yaml").read_text().replace("lr: 0.001", "lr: 1e-3", 1)
    (tmp_path / "config.yaml").write_text(text)
    proc = snakemake(tmp_path, "-n", "-p", "--configfile", str(tmp_path / "config.yaml"), "--",
                     "results/pretrain/model.pt")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert ("pretrain.optim.lr: '1e-3' is a string in YAML 1.1 (an exponent without a dot); "
            "read as the number 0.001") in out
    shell = re.search(r"chexflow train --config-json '([^']*)'", out).group(1)
    assert json.loads(shell)["optim"]["lr"] == 0.001


def test_generated_sections_follow_the_registry_and_removed_keys_stay_removed():
    props = C.study_schema()["properties"]
    assert "crop" not in props["evaluate"]["properties"]          # evaluation takes the model file's crop
    assert "name" not in props["study"]["properties"]            # nothing read it
    assert "nih_demo" not in props["datasets"]["properties"]     # a generated release has no mirror
    assert props["training"]["properties"]["data"]["properties"].keys() == {"workers", "shuffle_buffer", "stage_to"}


# --------------------------------------------------------------------------- every key is read

PACKAGE = REPO / "workflow" / "chexflow"
# where settings are declared and checked: a read there is no use of the setting
DECLARING = {PACKAGE / "settings.py", *(PACKAGE / "config").glob("*.py"), *PACKAGE.glob("*/config.py")}
WORKFLOW_FILES = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]


def _sections() -> dict[str, type]:
    """config.yaml's sections -> the dataclass of one entry (datasets.<name>, shards.<name>: per dataset)."""
    from chexflow.data.config import SourceConfig
    from chexflow.data.registry import DATASETS
    releases = {d.release_config: DemoReleaseConfig for d in DATASETS.values() if d.generated}
    return {"study": C.StudySection, "datasets.*": SourceConfig, "shards.*": ShardConfig, **releases,
            "training": TrainConfig, "pretrain": TrainConfig, "finetune": TrainConfig, **C.STUDY_SECTIONS}


def schema_keys() -> list[tuple[str, type, str]]:
    """(dotted key, owning dataclass, field) of every leaf of the generated schema."""
    out = []

    def walk(schema: dict, cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for name, sub in schema["properties"].items():
            tp = hints[name]
            if dataclasses.is_dataclass(tp):
                walk(sub, tp, f"{prefix}.{name}")
            else:
                out.append((f"{prefix}.{name}", cls, name))

    sections = _sections()
    for top, schema in C.study_schema()["properties"].items():
        if f"{top}.*" in sections:
            for entry, sub in schema["properties"].items():
                walk(sub, sections[f"{top}.*"], f"{top}.{entry}")
        else:
            walk(schema, sections[top], top)
    return out


def _parents() -> dict[type, set[type]]:
    """Each config dataclass -> the dataclasses that hold it, transitively (OptimConfig -> TrainConfig)."""
    up: dict[type, set[type]] = {}

    def visit(cls: type) -> None:
        for tp in typing.get_type_hints(cls).values():
            if dataclasses.is_dataclass(tp):
                up.setdefault(tp, set()).add(cls)
                visit(tp)

    for cls in set(_sections().values()):
        visit(cls)
    for cls in list(up):
        stack = list(up[cls])
        while stack:
            for p in up.get(stack.pop(), ()):
                if p not in up[cls]:
                    up[cls].add(p)
                    stack.append(p)
    return up


def _python_reads() -> list[tuple[set[str], set[str]]]:
    """Per top-level function or class of each package module (the unit a setting is used in):
    (names it mentions, attributes it reads). A read of ``args.x`` (argparse) or ``self.x`` (an
    object's own state) is no read of a setting."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in DECLARING:
            continue
        tree = ast.parse(path.read_text())
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for unit in tree.body:
            names, reads = set(), set()
            for node in ast.walk(unit):
                if isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.alias):
                    names.add(node.asname or node.name.split(".")[-1])
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                    if isinstance(node.ctx, ast.Load) and not (isinstance(node.value, ast.Name)
                                                               and node.value.id in ("args", "self")):
                        reads.add(node.attr)
            if unit not in imports:
                out.append((names, reads))
    return out


def _workflow_reads() -> set[str]:
    """What the Snakefile and the rules read: STUDY's attributes and the config mapping's keys."""
    text = "\n".join(p.read_text() for p in WORKFLOW_FILES)
    return set(re.findall(r"\.([a-z_][a-z0-9_]*)\b", text)) | set(re.findall(r"[\[(]\"([a-z_][a-z0-9_]*)\"[\])]", text))


def unread(keys: list[tuple[str, type, str]]) -> list[str]:
    """The keys no code reads: neither the workflow (the rules read the checked study and config
    mapping) nor a package function or class that names the setting's dataclass, or one holding
    it, and reads an attribute of that name (a name read in unrelated code does not count)."""
    parents, modules, workflow = _parents(), _python_reads(), _workflow_reads()
    dead = []
    for dotted, cls, name in keys:
        owners = {cls.__name__} | {p.__name__ for p in parents.get(cls, ())}
        used = name in workflow or any(name in reads and owners & mentions for mentions, reads in modules)
        if not used:
            dead.append(dotted)
    return dead


def test_every_key_of_the_schema_is_read_by_some_code():
    keys = schema_keys()
    assert len(keys) > 100 and ("training.checkpoint.keep", T.CheckpointConfig, "keep") in keys
    assert not unread(keys), f"keys nothing reads (remove them, or use them): {unread(keys)}"


def test_the_dead_key_check_catches_a_new_unread_setting():
    """A setting named like no attribute anywhere, and one whose name other code reads for something
    else (workers of the loader, the model file's crop), are both reported; the removed
    evaluate.crop would be again."""
    from chexflow.evaluate.config import EvaluateConfig
    planted = [("training.optim.betas", OptimConfig, "betas"), ("evaluate.workers", EvaluateConfig, "workers"),
               ("evaluate.crop", EvaluateConfig, "crop"),
               ("scaling.shuffle_buffer", C.STUDY_SECTIONS["scaling"], "shuffle_buffer")]
    assert unread(planted) == ["training.optim.betas", "evaluate.workers", "evaluate.crop", "scaling.shuffle_buffer"]
    assert unread([("evaluate.seed", EvaluateConfig, "seed")]) == []
