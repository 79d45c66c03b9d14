"""What chexflow needs to know about a dataset: the ``Dataset`` adapter interface.

Each dataset module (``fashion_mnist``, ``nih``, ``imagenet``) defines one adapter, a frozen
dataclass subclassing ``Dataset``; ``chexflow.data.registry`` lists them. Two halves:

* planning (the Snakefile calls these for every DAG it builds; they only name things):
  ``source`` (the files under ``data/raw/<name>/``, each with its role), ``parts`` (the shard
  jobs), ``part_files`` and ``split_files`` (the raw files a shard job / the split reads, chosen
  from the source's files by their role);
* reading (the shard stage): ``info``, ``split``, ``samples`` and ``decode``.

A dataset module is imported at DAG time, so it must not import torch or webdataset at module
level (numpy and pandas are fine: Snakemake loads them anyway).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from chexflow.data.config import ShardConfig
from chexflow.data.sources import RemoteFile, Source

SPLITS = ("train", "val", "test")       # what a split table assigns, in the order manifests list them

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

# (image key, patient, split, target, encoded image, origin) of one sample; ``decode`` turns the encoded
# image into pixels; the origin names the file (and archive member) it came from, for messages
RawSample = tuple[str, str, str, "np.ndarray", object, str]
Report = Callable[[str, str], None]   # report(member or image name, reason): the part's rejects


class ShardError(RuntimeError):
    """A shard stage failed; the message names the dataset/part/file and the cause."""


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    title: str
    task: str                 # "multilabel" | "multiclass"
    labels: tuple[str, ...]
    synthetic: bool
    split_source: str = ""    # where the train/val/test assignment comes from (shown in the report)


@dataclass(frozen=True)
class Dataset:
    """The adapter of one dataset. Subclasses set ``name`` and ``split_roles`` and implement the
    methods below (the docstrings say what each must return)."""
    name: str                      # the key under datasets:/shards: in config.yaml, data/raw/<name>/
    stage: str                     # the study stage it serves: "pretrain" or "finetune"
    split_roles: tuple[str, ...]   # roles (``sources.ROLES``) of the files the split reads
    shard_options: tuple[str, ...] = ()   # dataset-specific ShardConfig fields allowed in shards.<name>
    # a release chexflow generates (rule make_demo_release) instead of downloading: the config.yaml
    # section of its DemoReleaseConfig; None for a release that is downloaded
    release_config: str | None = None
    # the validation split is carved out of the training data by shards.<name>.val_fraction (else
    # the release has its own, as ImageNet's official val set)
    val_carved: bool = True
    # the images lie in a folder the shard jobs read (ShardConfig.images: the mirror, or a csv dataset's
    # image folder), only the label tables are downloaded; else they are in the release's archives
    folder: bool = False
    # how ``chexflow predict`` reads an image file for a model fine-tuned on this dataset: a key of
    # ``chexflow.data.tables.DECODINGS``, written into the model file (its ``predict.decoding``) so that
    # the file alone says it, whether or not this process knows the dataset (a CSV-declared one)
    decoding: str = "grey"

    @property
    def generated(self) -> bool:
        return self.release_config is not None

    def source_options(self) -> dict:
        """JSON-schema properties of dataset-specific keys under ``datasets.<name>`` besides ``mirror``."""
        return {}

    # ------------------------------------------------------------------ planning (DAG time)
    def source(self, n_archives: int | None = None) -> Source:
        """The files of the release under ``data/raw/<name>/`` (``n_archives``: a generated
        release's archive count, where it has one)."""
        raise NotImplementedError

    def parts(self, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
        """The shard jobs, one per source archive (or range of one); errors are ``ShardError``."""
        raise NotImplementedError

    def part_files(self, source: Source, part: str) -> list[RemoteFile]:
        """The files of ``source`` that shard job ``part`` reads."""
        raise NotImplementedError

    def split_files(self, source: Source) -> list[RemoteFile]:
        """The files of ``source`` the split reads: those with a role in ``split_roles``."""
        return [f for f in source.files if f.role in self.split_roles]

    def check_settings(self, cfg: ShardConfig) -> list[str]:
        """Problems of ``shards.<name>`` that only this dataset has (each naming its dotted key):
        ``chexflow.config.check_study`` reports them before any job runs."""
        return []
    def labelling(self, cfg: ShardConfig) -> dict | None:
        """How the targets were made from the label table, recorded in the manifest (``labelling``) and
        shown in the report: a label-table dataset's policy (``chexflow.data.tables.labelling``); None
        for a release whose labels need no such choice."""
        return None

    def evaluation_files(self, source: Source, boxes: bool = True) -> dict[str, RemoteFile]:
        """The files of ``source`` evaluation reads besides the shards, by use: ``label_table`` (the
        subgroups' fields), ``boxes`` (reference boxes of findings, unless ``boxes`` is False:
        ``datasets.<name>.boxes``)."""
        return {}

    def box_frame(self) -> int | None:
        """The side (px) of the square images the box list's coordinates refer to (None: no box list, or a
        generated release, whose frame is its own image size)."""
        return None

    # ------------------------------------------------------------------ reading (shard stage)
    def info(self, raw_dir: Path | None = None) -> DatasetInfo:
        """Title, task and labels (labels read from ``raw_dir`` may be empty without it)."""
        raise NotImplementedError

    def split(self, raw_dir: Path, cfg: ShardConfig, *, expected: object = None) -> pd.DataFrame:
        """The split table: columns image, patient, split (train/val/test), by patient, seeded.
        ``expected``: the published content to check the tables against (dataset-specific)."""
        raise NotImplementedError

    def samples(self, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
                report: Report) -> Iterator[RawSample]:
        """The samples of ``part`` in a deterministic order, not yet decoded; members that are
        unsafe, larger than ``cfg.max_member_mb`` (never read) or not in the split table go to
        ``report``. A key may come once per dataset (the shard stage checks it)."""
        raise NotImplementedError

    def decode(self, data: object, key: str, cfg: ShardConfig) -> np.ndarray:
        """uint8 ``cfg.image_size`` square grey pixels of one sample (``images.DecodeError`` if it
        does not decode completely or declares more than ``cfg.max_image_megapixels``)."""
        raise NotImplementedError

