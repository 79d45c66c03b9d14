"""The study: config.yaml as a whole, checked before any job runs.

Each component owns its settings (``chexflow.data.config``, ``chexflow.train.config``,
``chexflow.evaluate.config``, ``chexflow.studies.config``); this module, above them all, puts the
sections together. :func:`check_study` is what the Snakefile calls first: it builds every section
(types and ranges), resolves the shared ``training:`` section into each stage's TrainConfig, checks
every relation between settings (``chexflow.config.study``) and fails listing ALL problems, each with its dotted
key, the value and what is allowed. :func:`study_schema` generates the JSON schema of config.yaml
(``python -m chexflow.config > workflow/chexflow/schemas/config.schema.yaml``; a test keeps it in sync).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from chexflow.config.study import RELATIONS, STUDY_SECTIONS, Study
from chexflow.data import csv_folder, registry
from chexflow.data.config import DemoReleaseConfig, ShardConfig, SourceConfig, TableSpec
from chexflow.settings import ConfigError, Problems, build, dataclass_schema, normalize_numbers
from chexflow.train import config as train_config
from chexflow.train.config import STAGES, TrainConfig

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

def _section(config: Mapping[str, Any], name: str, p: Problems) -> dict:
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        p.add(name, f"{name}: expected a mapping, got {type(value).__name__}")
        return {}
    return dict(value)


def _without(section: Mapping[str, Any], excluded: tuple[str, ...], key: str, p: Problems,
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


def _study(config: Mapping[str, Any], p: Problems) -> StudySection | None:
    study = p.build(StudySection, _section(config, "study", p), "study")
    for stage in STAGES:
        name = getattr(study, f"{stage}_dataset", None)
        allowed = [n for n, d in registry.adapters().items() if d.stage == stage]
        if study is not None and name not in allowed:
            p.add("study", f"study.{stage}_dataset: {name!r} is not one of {allowed}")
    return study if p.ok("study") else None


def _datasets(config: Mapping[str, Any], p: Problems) -> tuple[dict[str, SourceConfig], dict[str, TableSpec]]:
    """``datasets.<name>``: the sources of the datasets chexflow knows, and the declarations of
    CSV-described folders (``format: csv``), which ``check_study`` then declares to the registry."""
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
            p: Problems) -> dict[str, ShardConfig]:
    out = {}
    for name, section in _section(config, "shards", p).items():
        key = f"shards.{name}"
        adapter = registry.adapters().get(name)
        if adapter is None:
            p.add(key, f"{key}: unknown dataset; known: {', '.join(registry.adapters())}")
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


def _releases(config: Mapping[str, Any], p: Problems) -> dict[str, DemoReleaseConfig]:
    out = {}
    for name, adapter in registry.DATASETS.items():
        if adapter.generated:
            cfg = p.build(DemoReleaseConfig, _section(config, adapter.release_config, p), adapter.release_config)
            if cfg is not None:
                out[name] = cfg
    return out


def _training(config: Mapping[str, Any], study: StudySection | None, p: Problems) -> dict[str, TrainConfig]:
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


# --------------------------------------------------------------------------- the check

def check_study(config: MutableMapping[str, Any]) -> Study:
    """config.yaml (a mapping) checked as a whole; ``ConfigError`` lists every problem found.

    A number written so that YAML 1.1 reads a string (``lr: 1e-3``) is taken as the number (a log
    line says so) and replaced in ``config`` too, so the rules hand the number on."""
    normalize_numbers(config, study_schema())
    p = Problems()
    known = {"study", "datasets", "shards", "training", *STAGES, *STUDY_SECTIONS,
             *(d.release_config for d in registry.DATASETS.values() if d.generated)}
    for name in sorted(set(config) - known):
        p.add(name, f"{name}: unknown section; known: {', '.join(sorted(known))}")
    for name in REQUIRED:
        if name not in config:
            p.add(name, f"{name}: missing section")
    sources, tables = _datasets(config, p)
    registry.declare(tables)        # this process's CSV-described datasets, before anything looks one up
    study = _study(config, p)
    releases = _releases(config, p)
    shards = _shards(config, sources, tables, p)
    train = {k: v for k, v in _training(config, study, p).items() if v is not None}
    sections = {name: p.build(cls, _section(config, name, p), name) for name, cls in STUDY_SECTIONS.items()}
    if study is not None and all(v is not None for v in sections.values()):    # (None: not a mapping)
        s = Study(pretrain_dataset=study.pretrain_dataset, finetune_dataset=study.finetune_dataset,
                  sources=sources, tables=tables, releases=releases, shards=shards, train=train, **sections)
        for relation in RELATIONS:
            relation(s, p)
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
