"""The identity of a training run: everything that shapes its result, as bytes.

A run's id (:func:`run_id`) hashes three parts, each recorded in its checkpoints (:func:`Identity.record`):

- ``settings``: the training section without what only says how the run is checkpointed, checked,
  communicated and where it stops (``checkpoint.*``, ``check_every_steps``, ``ddp.*``, ``max_steps``,
  the staging directory, Horovod's fusion threshold and CPU staging): those may change between
  attempts without starting afresh;
- ``data``: the dataset manifest's content that shapes training (:func:`data_summary`: dataset, task,
  labels, stored image size and encoding, and per split that training reads, train and val, its
  image, patient and label counts and its shards' sha256 in order), canonical JSON; never the
  manifest's path or modification time. The test split is not part of it: training never reads it,
  so test shards rebuilt alone neither restart training nor make evaluation refuse the model as
  stale; evaluation proves instead that no test patient is a train or val patient (from the shards)
  and records the test split's own digest (:func:`split_summary`);
- ``weights``: the sha256 of the starting weights' file (``init: pretrained``: the pretraining model;
  ``init: file``: ``init_file``, whose path is therefore not part of ``settings``), none from random init.

A checkpoint is resumed only by the run that wrote it; a run of the same settings and starting
weights on other data starts afresh and says what changed (:func:`explain_fresh_start`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from chexflow.data.manifest import ManifestError, read_manifest
from chexflow.fsutil import sha256_file
from chexflow.settings import ConfigError, to_dict
from chexflow.train import checkpoint as ckpt
from chexflow.train.config import TrainConfig

# the splits training reads: it fits on train and selects the epoch on val (the test split is evaluation's)
TRAINING_SPLITS = ("train", "val")
# settings that do not change what a run computes (see the module docstring)
_NOT_IDENTITY = {"": ("checkpoint", "check_every_steps", "ddp", "max_steps", "init_file"), "data": ("stage_to",),
                 "horovod": ("fusion_threshold_mb", "stage_through_cpu")}
_OTHER_RUNS_READ = 4    # at most this many other runs' newest checkpoints are read to explain a fresh start


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def settings_of(cfg: TrainConfig) -> dict:
    """The training settings that shape the result (their digest's first 16 hex digits are the run id
    chexflow gave a run before data and weights were part of it)."""
    ident = to_dict(cfg)
    for section, keys in _NOT_IDENTITY.items():
        node = ident[section] if section else ident
        for key in keys:
            node.pop(key)
    return ident


def data_summary(manifest: Path) -> dict:
    """The part of a dataset manifest that shapes training, in canonical form (see the module docstring):
    the splits of TRAINING_SPLITS it has. A manifest without these fields is a :class:`ManifestError`
    naming the file and the field."""
    manifest = Path(manifest)
    m = read_manifest(manifest)
    try:
        splits = {name: _split(s) for name, s in m["splits"].items() if name in TRAINING_SPLITS}
        return {"dataset": str(m["dataset"]), "task": str(m["task"]), "labels": [str(x) for x in m["labels"]],
                "image_size": int(m["image_size"]), "encoding": str(m.get("encoding", "")), "splits": splits}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _not_a_manifest(manifest, exc) from exc


def split_summary(manifest: Path, split: str) -> dict:
    """One split of a dataset manifest in the canonical form of :func:`data_summary` (its counts and its
    shards' sha256 in order), with its ``sha256``: the digest evaluation records of the test split."""
    manifest = Path(manifest)
    m = read_manifest(manifest)
    try:
        summary = {"dataset": str(m["dataset"]), "split": split, **_split(m["splits"][split])}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _not_a_manifest(manifest, exc) from exc
    return {**summary, "sha256": _digest(summary)}


def _split(s: dict) -> dict:
    return {"n_images": int(s["n_images"]), "n_patients": int(s["n_patients"]),
            "label_counts": {str(k): int(v) for k, v in s["label_counts"].items()},
            "shards": [[str(sh["sha256"]), int(sh["count"])] for sh in s["shards"]]}


def _not_a_manifest(manifest: Path, exc: Exception) -> ManifestError:
    return ManifestError(f"{manifest}: not a dataset manifest of the shard stage (its {exc} is missing or "
                         "malformed); rebuild it with the shard stage")


@dataclass(frozen=True)
class Identity:
    settings: str           # sha256 of settings_of(cfg)
    data: str               # sha256 of data_summary(manifest)
    weights: str | None     # sha256 of the starting weights' file (init: pretrained or file)
    summary: dict           # data_summary(manifest): what a later run compares to say what changed

    @property
    def run_id(self) -> str:
        return _digest({"settings": self.settings, "data": self.data, "weights": self.weights})[:16]

    def record(self) -> dict:
        """What a checkpoint keeps of its run's identity (plain types: a weights-only load reads it)."""
        return {"settings": self.settings, "data": self.data, "weights": self.weights, "summary": self.summary}


def identity(cfg: TrainConfig, manifest: Path, pretrained: Path | None) -> Identity:
    """The identity of a run of ``cfg`` on ``manifest`` from ``pretrained`` (init: pretrained) or
    ``cfg.init_file`` (init: file); neither is read from random init."""
    weights = starting_weights(cfg, pretrained)
    weights = sha256_file(weights) if weights is not None else None
    summary = data_summary(manifest)
    return Identity(settings_digest(cfg), _digest(summary), weights, summary)


def starting_weights(cfg: TrainConfig, pretrained: Path | None) -> Path | None:
    """The file a run of ``cfg`` starts from: the pretraining model, ``init_file``, or none (random init)."""
    if cfg.init == "pretrained":
        if pretrained is None:
            raise ConfigError(f"{cfg.stage}.init is pretrained: the run's identity needs the pretraining model file "
                              "(--pretrained)")
        return Path(pretrained)
    if cfg.init == "file":
        if cfg.init_file is None:
            raise ConfigError(f"{cfg.stage}.init_file: missing: {cfg.stage}.init is file")
        return Path(cfg.init_file)
    return None


def settings_digest(cfg: TrainConfig) -> str:
    return _digest(settings_of(cfg))


def run_id(cfg: TrainConfig, manifest: Path, pretrained: Path | None) -> str:
    """The id of a run (checkpoint names, model files, evaluation's model check)."""
    return identity(cfg, manifest, pretrained).run_id


def data_changes(old: dict, new: dict) -> str:
    """What differs between two data summaries, in a few words (the splits training reads only: a
    summary recorded by a chexflow whose run id also covered the test split says so)."""
    out = []
    for key in ("dataset", "task", "image_size", "encoding"):
        if old.get(key) != new.get(key):
            out.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
    if old.get("labels") != new.get("labels"):
        added = [x for x in new.get("labels", []) if x not in old.get("labels", [])]
        removed = [x for x in old.get("labels", []) if x not in new.get("labels", [])]
        out.append(f"labels changed (added {added}, removed {removed})" if added or removed
                   else "labels reordered")
    old_splits, new_splits = old.get("splits", {}), new.get("splits", {})
    for name in sorted((set(old_splits) | set(new_splits)) & set(TRAINING_SPLITS), key=TRAINING_SPLITS.index):
        a, b = old_splits.get(name, {}), new_splits.get(name, {})
        if a == b:
            continue
        parts = [f"{what} {a.get(key, 0)} -> {b.get(key, 0)}" for key, what in (("n_images", "images"),
                                                                                 ("n_patients", "patients"))
                 if a.get(key) != b.get(key)]
        shas_a = {sha for sha, _ in a.get("shards", [])}
        shas_b = {sha for sha, _ in b.get("shards", [])}
        if shas_a != shas_b:
            parts.append(f"shards: {len(shas_b - shas_a)} new, {len(shas_a - shas_b)} gone of {len(shas_a)}")
        elif a.get("shards") != b.get("shards"):
            parts.append("shards in another order")
        if a.get("label_counts") != b.get("label_counts"):
            parts.append("label counts")
        out.append(f"{name}: {', '.join(parts) or 'changed'}")
    if not out and set(old_splits) - set(TRAINING_SPLITS):
        return "none in the splits training reads (recorded when the run id covered the test split too)"
    return "; ".join(out) or "the manifest's content differs"


def explain_fresh_start(ckpt_dir: Path, ident: Identity, log: Callable[[str], None]) -> None:
    """Say why a run with checkpoints of other runs in ``ckpt_dir`` starts afresh: the newest of them
    with the same settings but other data gives "data changed: ...", other starting weights
    "starting weights changed: ..." (checkpoints written before identities were recorded say nothing)."""
    others: dict[str, Path] = {}
    for path in ckpt.list_checkpoints(ckpt_dir):
        rid = ckpt.run_id_of(path)
        if rid != ident.run_id:
            others[rid] = path                  # oldest step first: the last one kept is the run's newest
    newest = sorted(others.values(), key=_mtime, reverse=True)[:_OTHER_RUNS_READ]
    for path in newest:
        try:
            state = ckpt.load_pt(path)
        except (OSError, ckpt.RefusedFile):
            continue
        rec = state.get("identity") if isinstance(state, dict) else None
        if not isinstance(rec, dict) or not isinstance(rec.get("summary"), dict):
            continue
        if rec.get("settings") != ident.settings:
            continue
        since = f"since {path.name}, run {ckpt.run_id_of(path)}; starting afresh as run {ident.run_id}"
        if rec.get("data") != ident.data:
            try:
                what = data_changes(rec["summary"], ident.summary)
            except (AttributeError, TypeError, ValueError):     # a malformed summary (the file is untrusted)
                what = "the manifest's content differs"
            log(f"data changed: {what} ({since})")
        if rec.get("weights") != ident.weights:
            log(f"starting weights changed: sha256 {str(rec.get('weights'))[:12]} -> {str(ident.weights)[:12]} "
                f"({since})")
        return


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
