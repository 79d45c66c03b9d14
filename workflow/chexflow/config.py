"""The study: config.yaml as a whole, checked before any job runs.

Each component owns its settings (``chexflow.data.config``, ``chexflow.train.config``,
``chexflow.evaluate.config``, ``chexflow.studies.config``); this module, above them all, puts the
sections together. :func:`check_study` is what the Snakefile calls first: it builds every section
(types and ranges), resolves the shared ``training:`` section into each stage's TrainConfig, checks
every relation between settings (a crop against the stored image size, the fine-tuning's
architecture against the pretraining's, ...) and fails listing ALL problems, each with its dotted
key, the value and what is allowed. :func:`study_schema` generates the JSON schema of config.yaml
(``python -m chexflow.config > workflow/chexflow/schemas/config.schema.yaml``; a test keeps it in sync).
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import yaml

from chexflow.data import csv_folder, labelmap, registry
from chexflow.data.config import DemoReleaseConfig, ShardConfig, SourceConfig, TableSpec
from chexflow.data.dataset import ShardError
from chexflow.evaluate.config import EvaluateConfig
from chexflow.predict.config import ExportConfig, PredictConfig
from chexflow.settings import ConfigError, build, dataclass_schema, normalize_numbers, to_dict
from chexflow.studies.config import AblationConfig, ScalingConfig, SweepConfig
from chexflow.train import config as train_config
from chexflow.train.config import STAGES, TrainConfig

# how Apptainer names an image it pulls (a local .sif file is the other form)
IMAGE_SCHEMES = ("docker", "oras", "library", "shub", "https", "http")


@dataclass(frozen=True)
class ContainerConfig:
    """Where the rules' jobs run: null = in the environment Snakemake runs in; an image (a .sif file or
    an Apptainer URI such as docker://...) = each job inside it, Snakemake's ``container:`` directive
    (with ``--sdm apptainer``: profiles/slurm-with-apptainer; docs/container.md)."""
    image: str | None = None


STUDY_SECTIONS = {"container": ContainerConfig, "evaluate": EvaluateConfig, "scaling": ScalingConfig,
                  "sweep": SweepConfig, "ablation": AblationConfig, "predict": PredictConfig, "export": ExportConfig}
REQUIRED = ("study", "shards", "pretrain", "finetune")
# ShardConfig fields the workflow sets: the dataset (the section's name), a pilot subset of the
# archives (datasets.<name>.archives), a folder dataset's image folder and a CSV dataset's declaration
# (datasets.<name>); a dataset's own keys (train_parts, ...) only where its adapter has them (shard_options)
_SHARD_SET_BY_WORKFLOW = ("dataset", "archives", "images", "table", "test_only")
# a CSV-described dataset's name: a Snakemake wildcard value and a folder name
CSV_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True)
class StudySection:
    pretrain_dataset: str = "nih_demo_pretrain"
    finetune_dataset: str = "nih_demo"


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

    def dataset(self, stage: str) -> str:
        return self.pretrain_dataset if stage == "pretrain" else self.finetune_dataset

    @property
    def pretrained_used(self) -> bool:
        """Some fine-tuning run starts from the pretraining model (the main run, or the ablation's)."""
        return self.train["finetune"].init == "pretrained" or self.ablation.enabled


def stage_settings(config: Mapping[str, Any], stage: str, dataset: str, **overrides: Any) -> dict[str, Any]:
    """What the rules hand ``chexflow train``: the stage's section over the shared ``training:``."""
    return train_config.resolve(config.get("training"), config.get(stage), stage=stage, dataset=dataset,
                                **overrides)


def resolved_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.yaml with each stage's section resolved (what ran; the report shows it)."""
    study = config.get("study") or {}
    out = {k: v for k, v in config.items() if k != "training"}
    for stage in STAGES:
        settings = stage_settings(config, stage, study.get(f"{stage}_dataset"))
        out[stage] = {k: v for k, v in settings.items() if k not in train_config.WORKFLOW_KEYS}
    return out


# --------------------------------------------------------------------------- sections

class _Problems:
    """The problems found so far and the dotted keys they are about: a relation is checked only
    between keys without a problem of their own, so that each bad value is reported once, by its key."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.bad: set[str] = set()

    def add(self, key: str, message: str) -> None:
        self.items.append(message)
        self.bad.add(key)

    def build(self, cls: type, data: Any, key: str) -> Any:
        n = len(self.items)
        out = build(cls, data, key, self.items)
        for message in self.items[n:]:          # each message starts with its dotted key
            self.bad.add(re.sub(r"\[\d+\]", "", message.split(":", 1)[0]))
        return out

    def ok(self, *keys: str) -> bool:
        """No problem with any of ``keys``, with a section holding one, or with a key inside one."""
        return not any(b == k or b.startswith(k + ".") or k.startswith(b + ".") for b in self.bad for k in keys)


def _section(config: Mapping[str, Any], name: str, p: _Problems) -> dict:
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        p.add(name, f"{name}: expected a mapping, got {type(value).__name__}")
        return {}
    return dict(value)


def _without(section: Mapping[str, Any], excluded: tuple[str, ...], key: str, p: _Problems,
             why: Callable[[str], str]) -> dict:
    """``section`` without the dotted keys ``excluded`` (each one present is a problem, saying ``why``)."""
    for dotted in excluded:
        *parents, leaf = dotted.split(".")
        node: Any = section
        for parent in parents:
            node = node.get(parent) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and leaf in node:
            p.add(key, f"{key}.{dotted}: not allowed here ({why(dotted)})")
    return _drop(section, excluded)


def _drop(section: Mapping[str, Any], excluded: tuple[str, ...]) -> dict:
    out = {}
    for k, v in section.items():
        if k in excluded:
            continue
        inner = tuple(e.split(".", 1)[1] for e in excluded if e.startswith(k + "."))
        out[k] = _drop(v, inner) if inner and isinstance(v, Mapping) else v
    return out


def _why_shard(dotted: str) -> str:
    if dotted in _SHARD_SET_BY_WORKFLOW:
        return "set by the workflow: the section's name, datasets.<name> (archives, mirror, images, the table)"
    return "not a setting of this dataset"


def _why_training(dotted: str) -> str:
    return "training: says how training runs; what a stage trains goes under pretrain: / finetune:"


def _why_stage(dotted: str) -> str:
    if dotted in train_config.WORKFLOW_KEYS:
        return "set by the workflow (study.<stage>_dataset)"
    return "fine-tuning only: pretraining starts from random weights"


def shard_keys_excluded(name: str) -> tuple[str, ...]:
    """ShardConfig keys that ``shards.<name>`` cannot hold (a name not known: a CSV-described folder's)."""
    options = (registry.adapters().get(name) or csv_folder.CSVFolder()).shard_options
    specific = sorted({k for d in (*registry.DATASETS.values(), csv_folder.CSVFolder()) for k in d.shard_options})
    return _SHARD_SET_BY_WORKFLOW + tuple(k for k in specific if k not in options)


def _study(config: Mapping[str, Any], p: _Problems) -> StudySection | None:
    study = p.build(StudySection, _section(config, "study", p), "study")
    for stage in STAGES:
        name = getattr(study, f"{stage}_dataset", None)
        allowed = [n for n, d in registry.adapters().items() if d.stage == stage]
        if study is not None and name not in allowed:
            p.add("study", f"study.{stage}_dataset: {name!r} is not one of {allowed}")
    return study if p.ok("study") else None


def _datasets(config: Mapping[str, Any], p: _Problems) -> tuple[dict[str, SourceConfig], dict[str, TableSpec]]:
    """``datasets.<name>``: the sources of the datasets chexflow knows, and the declarations of
    CSV-described folders (``format: csv``), which are declared to the registry here."""
    sources, tables = {}, {}
    for name, section in _section(config, "datasets", p).items():
        key = f"datasets.{name}"
        adapter = registry.DATASETS.get(name)
        if adapter is None and isinstance(section, Mapping) and section.get("format") == "csv":
            if not CSV_NAME.fullmatch(str(name)):
                p.add(key, f"{key}: a dataset's name is letters, digits and _ (starting with a letter)")
                continue
            spec = p.build(TableSpec, dict(section), key)
            if spec is not None:
                for message in csv_folder.spec_problems(spec, key):
                    p.add(key, message)
                tables[name] = spec
            continue
        if adapter is None or adapter.generated:
            known = [n for n, d in registry.DATASETS.items() if not d.generated]
            p.add(key, f"{key}: not a downloaded dataset (those are: {', '.join(known)}; a generated "
                       "release has its own section; a CSV-described folder has format: csv)")
            continue
        allowed = {"mirror", *adapter.source_options()}
        for extra in sorted(set(section or {}) - allowed):
            p.add(key, f"{key}.{extra}: not allowed here ({name} has {', '.join(sorted(allowed))})")
        sources[name] = p.build(SourceConfig, {k: v for k, v in (section or {}).items() if k in allowed}, key)
    registry.declare(tables)
    return {n: s for n, s in sources.items() if s is not None}, tables


def folder_settings(study: Study, name: str) -> dict:
    """What the rules add to ``shards.<name>`` for a shard job of a folder dataset (as ``check_study`` did)."""
    return _folder(name, study.sources, study.tables, study.evaluate.external)


def _folder(name: str, sources: Mapping[str, SourceConfig], tables: Mapping[str, TableSpec],
            external: Any = ()) -> dict:
    """What the workflow sets in ``shards.<name>`` of a folder dataset: the image folder (chexpert: its
    mirror; a CSV dataset: its images), a CSV dataset's declaration, and ``test_only`` for one that only
    ``evaluate.external`` uses (only its test split is sharded: no job reads the rest)."""
    test_only = {"test_only": True} if isinstance(external, (list, tuple)) and name in external else {}
    if name in tables:
        return {"images": tables[name].images, "table": dataclasses.asdict(tables[name]), **test_only}
    if registry.get(name).folder and sources.get(name) is not None:
        return {"images": sources[name].mirror, **test_only}
    return {}


def _shards(config: Mapping[str, Any], sources: Mapping[str, SourceConfig], tables: Mapping[str, TableSpec],
            p: _Problems) -> dict[str, ShardConfig]:
    out = {}
    for name, section in _section(config, "shards", p).items():
        key = f"shards.{name}"
        adapter = registry.adapters().get(name)
        if adapter is None:
            p.add(key, f"{key}: unknown dataset; known: {', '.join(registry.NAMES)}")
            continue
        section = _without(section or {}, shard_keys_excluded(name), key, p, _why_shard)
        source = sources.get(name)
        pilot = {}
        if "archives" in adapter.source_options() and source and p.ok(f"datasets.{name}.archives"):
            pilot = {"archives": source.archives}
        external = (config.get("evaluate") or {}).get("external") if isinstance(config.get("evaluate"), Mapping) else ()
        cfg = p.build(ShardConfig, {**section, "dataset": name, **pilot, **_folder(name, sources, tables, external)},
                      key)
        if cfg is not None:
            out[name] = cfg
    return out


def _releases(config: Mapping[str, Any], p: _Problems) -> dict[str, DemoReleaseConfig]:
    out = {}
    for name, adapter in registry.DATASETS.items():
        if adapter.generated:
            cfg = p.build(DemoReleaseConfig, _section(config, adapter.release_config, p), adapter.release_config)
            if cfg is not None:
                out[name] = cfg
    return out


def _training(config: Mapping[str, Any], study: StudySection | None, p: _Problems) -> dict[str, TrainConfig]:
    """Each stage's TrainConfig; a problem names the section where the value was written."""
    training = _without(_section(config, "training", p), train_config.training_keys_excluded(), "training", p,
                        _why_training)
    shared = p.build(TrainConfig, training, "training")
    out = {}
    for stage in STAGES:
        section = _without(_section(config, stage, p), train_config.stage_keys_excluded(stage), stage, p, _why_stage)
        if p.build(TrainConfig, section, stage) is None or shared is None or study is None:
            continue
        resolved = train_config.resolve(training, section, stage=stage, dataset=getattr(study, f"{stage}_dataset"))
        # both parts are checked above: a problem here is one of theirs, already reported by its own key
        out[stage] = build(TrainConfig, resolved, stage, [])
    return out


# --------------------------------------------------------------------------- relations

def _crop_fits(key: str, crop: int, dataset: str, shards: Mapping[str, ShardConfig], p: _Problems) -> None:
    stored = shards.get(dataset)
    if stored is None:
        p.add(f"shards.{dataset}", f"shards.{dataset}: missing (the data of {key.split('.')[0]})")
    elif p.ok(key, f"shards.{dataset}.image_size") and crop > stored.image_size:
        p.add(key, f"{key}: {crop} is not <= shards.{dataset}.image_size ({stored.image_size}): a crop larger "
                   "than the stored images would be upsampled")


def _stage_ok(stage: str, p: _Problems) -> bool:
    """The keys train_config.check relates have no problem (written under the stage or training:)."""
    return p.ok(*(f"{where}.{k}" for k in train_config.RELATED_KEYS for where in (stage, "training")))


def _validates(stage: str, s: Study, p: _Problems) -> None:
    """Training keeps the epoch that validates best (fine-tuning: evaluation's thresholds come from the
    validation split too): a split carved out by val_fraction needs a fraction above 0."""
    name = s.dataset(stage)
    key = f"shards.{name}.val_fraction"
    if name in s.shards and registry.get(name).val_carved and s.shards[name].val_fraction == 0 and p.ok(key):
        p.add(key, f"{key}: 0 leaves {stage} without a validation split (training keeps the epoch that validates "
                   f"best{', evaluation sets its thresholds on it' if stage == 'finetune' else ''}); give a "
                   "fraction above 0, e.g. 0.1")


def _train_relations(s: Study, p: _Problems) -> None:
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


def _data_relations(s: Study, p: _Problems) -> None:
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


def _folder_relations(s: Study, p: _Problems) -> None:
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


def _external_relations(s: Study, p: _Problems) -> None:
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


def _container_image(image: str | None, p: _Problems) -> None:
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


def _study_relations(s: Study, p: _Problems) -> None:
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


def _saliency_layer(s: Study, p: _Problems) -> None:
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


# --------------------------------------------------------------------------- the check

def check_study(config: MutableMapping[str, Any]) -> Study:
    """config.yaml (a mapping) checked as a whole; ``ConfigError`` lists every problem found.

    A number written so that YAML 1.1 reads a string (``lr: 1e-3``) is taken as the number (a log
    line says so) and replaced in ``config`` too, so the rules hand the number on."""
    normalize_numbers(config, study_schema())
    p = _Problems()
    known = {"study", "datasets", "shards", "training", *STAGES, *STUDY_SECTIONS,
             *(d.release_config for d in registry.DATASETS.values() if d.generated)}
    for name in sorted(set(config) - known):
        p.add(name, f"{name}: unknown section; known: {', '.join(sorted(known))}")
    for name in REQUIRED:
        if name not in config:
            p.add(name, f"{name}: missing section")
    sources, tables = _datasets(config, p)     # first: declares the CSV-described datasets
    study = _study(config, p)
    releases = _releases(config, p)
    shards = _shards(config, sources, tables, p)
    train = {k: v for k, v in _training(config, study, p).items() if v is not None}
    sections = {name: p.build(cls, _section(config, name, p), name) for name, cls in STUDY_SECTIONS.items()}
    if study is not None and all(v is not None for v in sections.values()):    # (None: not a mapping)
        s = Study(pretrain_dataset=study.pretrain_dataset, finetune_dataset=study.finetune_dataset,
                  sources=sources, tables=tables, releases=releases, shards=shards, train=train, **sections)
        _train_relations(s, p)
        _data_relations(s, p)
        _folder_relations(s, p)
        _external_relations(s, p)
        _study_relations(s, p)
    if p.items:
        raise ConfigError(list(dict.fromkeys(p.items)))
    return s      # (no problem: every section was built)


# --------------------------------------------------------------------------- JSON schema of config.yaml

def study_schema() -> dict:
    """The JSON schema of config.yaml (kept in sync with the dataclasses by a test); the datasets,
    their stages and their own keys come from ``chexflow.data.registry``."""
    DATASETS = registry.DATASETS
    datasets = {name: {"type": "object", "additionalProperties": False,
                       "properties": {"mirror": {"type": ["string", "null"]}, **d.source_options()}}
                for name, d in DATASETS.items() if not d.generated}
    # any other name under datasets: a CSV-described folder (format: csv), its shards: section likewise
    table = {**dataclass_schema(TableSpec), "required": ["format", "table", "images", "findings"]}
    shards = {name: dataclass_schema(ShardConfig, exclude=shard_keys_excluded(name)) for name in DATASETS}
    csv_shards = dataclass_schema(ShardConfig, exclude=shard_keys_excluded(""))
    name = {"type": "string", "pattern": f"^{CSV_NAME.pattern}$"}
    stage_enum = {stage: {"anyOf": [{"enum": [n for n, d in DATASETS.items() if d.stage == stage]}]
                          + ([{**name, "description": "a CSV-described folder declared under datasets:"}]
                             if stage == "finetune" else [])} for stage in STAGES}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": "chexflow config.yaml (generated from chexflow.config: `python -m chexflow.config`)",
        "type": "object", "additionalProperties": False,
        "required": list(REQUIRED),
        "properties": {
            "study": {"type": "object", "additionalProperties": False,
                      "required": ["pretrain_dataset", "finetune_dataset"],
                      "properties": {f"{stage}_dataset": stage_enum[stage] for stage in STAGES}},
            "datasets": {"type": "object", "additionalProperties": table, "properties": datasets},
            **{d.release_config: dataclass_schema(DemoReleaseConfig) for d in DATASETS.values() if d.generated},
            "shards": {"type": "object", "additionalProperties": csv_shards, "properties": shards},
            "training": dataclass_schema(TrainConfig, exclude=train_config.training_keys_excluded()),
            **{stage: dataclass_schema(TrainConfig, exclude=train_config.stage_keys_excluded(stage))
               for stage in STAGES},
            **{name: dataclass_schema(cls) for name, cls in STUDY_SECTIONS.items()},
        },
    }


if __name__ == "__main__":
    print(yaml.safe_dump(study_schema(), sort_keys=False), end="")
