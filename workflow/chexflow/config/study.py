"""The checked study: its dataclass and the relations between its settings.

:data:`RELATIONS` are the second half of ``chexflow.config.check_study``: once each section is
built, a crop against the stored image size, the fine-tuning's architecture against the pretraining's,
an external dataset against the fine-tuning's findings, every sweep trial, ... Each relation is checked
only between keys without a problem of their own (``Problems.ok``), so a bad value is reported once.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from chexflow.data import labelmap, registry
from chexflow.data.config import DemoReleaseConfig, ShardConfig, SourceConfig, TableSpec
from chexflow.data.dataset import ShardError
from chexflow.evaluate.config import EvaluateConfig
from chexflow.predict.config import ExportConfig, PredictConfig
from chexflow.settings import Problems, build, to_dict
from chexflow.studies.config import AblationConfig, ScalingConfig, SweepConfig
from chexflow.train import config as train_config
from chexflow.train.config import TrainConfig
from chexflow.watchdog import WatchdogConfig

# how Apptainer names an image it pulls (a local .sif file is the other form)
IMAGE_SCHEMES = ("docker", "oras", "library", "shub", "https", "http")


@dataclass(frozen=True)
class ContainerConfig:
    """Where the rules' jobs run: null = in the environment Snakemake runs in; an image (a .sif file or
    an Apptainer URI such as docker://...) = each job inside it, Snakemake's ``container:`` directive
    (with ``--sdm apptainer``: profiles/slurm-with-apptainer; docs/container.md)."""
    image: str | None = None


# config.yaml's sections beside the datasets, shards and training: each one setting object of the Study
STUDY_SECTIONS = {"container": ContainerConfig, "evaluate": EvaluateConfig, "scaling": ScalingConfig,
                  "sweep": SweepConfig, "ablation": AblationConfig, "predict": PredictConfig, "export": ExportConfig,
                  "watchdog": WatchdogConfig}


@dataclass(frozen=True)
class Study:
    """config.yaml, checked: every value typed, in range and consistent with the others."""
    pretrain_dataset: str
    finetune_dataset: str
    container: ContainerConfig
    sources: dict[str, SourceConfig]          # datasets.<name> (downloaded datasets)
    tables: dict[str, TableSpec]              # datasets.<name> of CSV-described folders (format: csv)
    releases: dict[str, DemoReleaseConfig]    # generated datasets: their release section
    shards: dict[str, ShardConfig]            # shards.<name>, with the dataset and a pilot subset set
    train: dict[str, TrainConfig]             # pretrain, finetune: resolved from training + the stage
    evaluate: EvaluateConfig
    scaling: ScalingConfig
    sweep: SweepConfig
    ablation: AblationConfig
    predict: PredictConfig
    export: ExportConfig
    watchdog: WatchdogConfig

    def dataset(self, stage: str) -> str:
        return self.pretrain_dataset if stage == "pretrain" else self.finetune_dataset

    @property
    def pretrained_used(self) -> bool:
        """Some fine-tuning run starts from the pretraining model (the main run, or the ablation's)."""
        return self.train["finetune"].init == "pretrained" or self.ablation.enabled


def _crop_fits(key: str, crop: int, dataset: str, shards: Mapping[str, ShardConfig], p: Problems) -> None:
    stored = shards.get(dataset)
    if stored is None:
        p.add(f"shards.{dataset}", f"shards.{dataset}: missing (the data of {key.split('.')[0]})")
    elif p.ok(key, f"shards.{dataset}.image_size") and crop > stored.image_size:
        p.add(key, f"{key}: {crop} is not <= shards.{dataset}.image_size ({stored.image_size}): a crop larger "
                   "than the stored images would be upsampled")


def _stage_ok(stage: str, p: Problems) -> bool:
    """The keys train_config.check relates have no problem (written under the stage or training:)."""
    return p.ok(*(f"{where}.{k}" for k in train_config.RELATED_KEYS for where in (stage, "training")))


def _validates(stage: str, s: Study, p: Problems) -> None:
    """Training keeps the epoch that validates best (fine-tuning: evaluation's thresholds come from the
    validation split too): a split carved out by val_fraction needs a fraction above 0."""
    name = s.dataset(stage)
    key = f"shards.{name}.val_fraction"
    if name in s.shards and registry.get(name).val_carved and s.shards[name].val_fraction == 0 and p.ok(key):
        p.add(key, f"{key}: 0 leaves {stage} without a validation split (training keeps the epoch that validates "
                   f"best{', evaluation sets its thresholds on it' if stage == 'finetune' else ''}); give a "
                   "fraction above 0, e.g. 0.1")


def _train_relations(s: Study, p: Problems) -> None:
    for stage, cfg in s.train.items():
        _crop_fits(f"{stage}.data.crop", cfg.data.crop, s.dataset(stage), s.shards, p)
        _validates(stage, s, p)
        if _stage_ok(stage, p):
            for message in train_config.check(cfg, stage):
                p.add(stage, message)
    fine, pre = s.train.get("finetune"), s.train.get("pretrain")
    if fine is None:
        return
    if (pre is not None and s.pretrained_used and fine.model.arch != pre.model.arch
            and p.ok("finetune.model.arch", "pretrain.model.arch", "finetune.init", "ablation.enabled")):
        p.add("finetune.model.arch", f"finetune.model.arch: {fine.model.arch!r} is not pretrain.model.arch "
                                     f"({pre.model.arch!r}): fine-tuning from the pretraining model loads its "
                                     "backbone tensor by tensor")
    if s.ablation.enabled and fine.init != "pretrained" and _stage_ok("finetune", p):
        # the ablation fine-tunes the same section from the pretraining model
        for message in train_config.check(dataclasses.replace(fine, init="pretrained"), "finetune"):
            p.add("finetune", message)
    counts = {k: v for k, v in (("finetune.freeze", fine.freeze), ("finetune.transfer_stages", fine.transfer_stages))
              if v is not None and p.ok(k)}
    if s.sweep.enabled and p.ok("sweep.space.freeze"):
        counts.update({f"sweep.space.freeze[{i}]": v for i, v in enumerate(s.sweep.space.freeze)})
    if any(counts.values()) and p.ok("finetune.model.arch"):   # only then is torchvision imported
        for message in train_config.check_stages_fit(fine.model.arch, counts):
            p.add("finetune.model.arch", message)


def _data_relations(s: Study, p: Problems) -> None:
    for name, release in s.releases.items():
        stored = s.shards.get(name)
        section = registry.get(name).release_config
        if (stored is not None and p.ok(f"shards.{name}.image_size", f"{section}.image_size")
                and stored.image_size > release.image_size):
            p.add(f"shards.{name}.image_size", f"shards.{name}.image_size: {stored.image_size} is not <= "
                  f"{section}.image_size ({release.image_size}): the shards would upsample the generated images")
    for name in s.shards:
        release = s.releases.get(name)
        if p.ok(f"shards.{name}", f"datasets.{name}", registry.get(name).release_config or name):
            try:       # the shard jobs can be planned (e.g. a pilot's archive numbers exist)
                registry.get(name).parts(s.shards[name], release.n_archives if release else None)
            except ShardError as exc:
                p.add(f"datasets.{name}", str(exc))
            for message in registry.get(name).check_settings(s.shards[name]):
                p.add(f"shards.{name}", message)


def _used(s: Study) -> list[str]:
    """The datasets the study trains or tests on."""
    return list(dict.fromkeys([s.pretrain_dataset, s.finetune_dataset, *s.evaluate.external]))


def _folder_relations(s: Study, p: Problems) -> None:
    """A folder dataset the study uses reads its images from a local folder (CheXpert: its mirror)."""
    for name in _used(s):
        adapter = registry.adapters().get(name)
        if adapter is None or not adapter.folder or name in s.tables:
            continue
        mirror = (s.sources.get(name) or SourceConfig()).mirror
        if not mirror:
            p.add(f"datasets.{name}.mirror", f"datasets.{name}.mirror: {name}'s images are read from its folder: set "
                                             f"it to that folder ({adapter.source().how_to_obtain})")
        elif "://" in mirror:
            p.add(f"datasets.{name}.mirror", f"datasets.{name}.mirror: {mirror!r}: {name}'s images are read from a "
                                             "local folder, not a URL")


def _external_relations(s: Study, p: Problems) -> None:
    """Each external dataset: another multi-label dataset with shards, sharing a finding with the fine-tuning
    data, and no lateral images for a model that saw none."""
    if not p.ok("evaluate.external", "study"):
        return
    fine = registry.get(s.finetune_dataset)
    fine_frontal = not fine.folder or s.shards.get(s.finetune_dataset, ShardConfig()).views == "frontal"
    for i, name in enumerate(s.evaluate.external):
        key = f"evaluate.external[{i}]"
        adapter = registry.adapters().get(name)
        allowed = [n for n, d in registry.adapters().items() if d.stage == "finetune" and n != s.finetune_dataset]
        if adapter is None or name not in allowed:
            p.add("evaluate.external", f"{key}: {name!r} is not a dataset to test the fine-tuned model on (one of "
                                       f"{allowed}: another fine-tuning dataset than study.finetune_dataset)")
            continue
        if name not in s.shards:
            p.add(f"shards.{name}", f"shards.{name}: missing (the data of {key})")
            continue
        found = labelmap.match(fine.info().labels, adapter.info().labels)
        if not found.pairs:
            p.add("evaluate.external", f"{key}: {name} shares no finding with {s.finetune_dataset} "
                                       f"({list(adapter.info().labels)} vs {list(fine.info().labels)}; "
                                       "chexflow.data.labelmap lists the names that match)")
        if adapter.folder and s.shards[name].views == "all" and fine_frontal:
            p.add(f"shards.{name}.views", f"shards.{name}.views: all would score lateral images with a model trained "
                                          f"on frontal ones only ({s.finetune_dataset}): set frontal for {key}")


def _container_image(image: str | None, p: Problems) -> None:
    if image is None:
        return
    scheme = image.split("://", 1)[0] if "://" in image else None
    if not image.strip() or any(c.isspace() for c in image):
        p.add("container.image", f"container.image: {image!r} is empty or holds whitespace; null runs no container")
    elif scheme is None and not image.endswith(".sif"):
        p.add("container.image", f"container.image: {image!r} is neither a .sif file nor an image URI "
                                 f"({', '.join(s + '://' for s in IMAGE_SCHEMES)})")
    elif scheme is not None and scheme not in IMAGE_SCHEMES:
        p.add("container.image", f"container.image: {image!r}: Apptainer pulls no {scheme}:// image; one of "
                                 f"{', '.join(s + '://' for s in IMAGE_SCHEMES)} or a .sif file")


def _study_relations(s: Study, p: Problems) -> None:
    _container_image(s.container.image, p)
    bands = list(s.evaluate.age_bands)
    if not bands or bands != sorted(bands):
        p.add("evaluate.age_bands", f"evaluate.age_bands: {bands} is not a non-empty ascending list of ages")
    if s.ablation.seeds is not None and not s.ablation.seeds:
        p.add("ablation.seeds", "ablation.seeds: [] lists no seed (null: the finetune section's one seed)")
    if s.scaling.enabled:
        _crop_fits("scaling.crop", s.scaling.crop, s.pretrain_dataset, s.shards, p)
    if s.sweep.enabled and p.ok("sweep") and "finetune" in s.train and _stage_ok("finetune", p):
        for message in _sweep_trials(s):
            p.add("sweep", message)
    _saliency_layer(s, p)
    if s.predict.enabled and not s.predict.modalities:
        p.add("predict.modalities", "predict.modalities: [] would refuse every DICOM file; name the accepted "
                                    "modalities (e.g. [CR, DX, DR])")


def _saliency_layer(s: Study, p: Problems) -> None:
    """A Grad-CAM layer named (not auto) is a backbone stage of the fine-tuned architecture: found now,
    not after all of evaluation's inference."""
    layer, fine = s.evaluate.saliency.layer, s.train.get("finetune")
    if layer == "auto" or fine is None or not p.ok("evaluate.saliency.layer", "finetune.model.arch"):
        return
    from chexflow.train.models import ModelError
    try:
        stages = train_config.stage_names(fine.model.arch)
    except ModelError:          # reported by finetune.model.arch's own check
        return
    if layer not in stages:
        p.add("evaluate.saliency.layer", f"evaluate.saliency.layer: {layer!r} is not a backbone stage of "
                                         f"finetune.model.arch {fine.model.arch} (stages: {', '.join(stages)}); "
                                         "auto picks the deepest of at least evaluate.saliency.min_side px")


def _sweep_trials(s: Study) -> list[str]:
    """Every trial of the sweep is a valid fine-tuning config (the relations included)."""
    from chexflow.studies.sweep import apply_params, expand_trials
    base = to_dict(s.train["finetune"])
    problems: list[str] = []
    for trial in expand_trials(s.sweep):
        where = f"sweep trial {trial['id']} {json.dumps(trial['params'])}"
        found: list[str] = []
        cfg = build(TrainConfig, apply_params(base, trial["params"]), "finetune", found)
        if cfg is not None and not found:
            found = train_config.check(cfg, "finetune")
        problems += [f"{where}: {m}" for m in found]
    return list(dict.fromkeys(problems))



# every relation between the study's settings, in the order their problems are listed (check_study runs them)
RELATIONS = (_train_relations, _data_relations, _folder_relations, _external_relations, _study_relations)
