"""The data stages' settings: the generated phantom releases, the shards, the training-time augmentation.

Sections of config.yaml: ``demo_release`` / ``demo_pretrain_release`` (:class:`DemoReleaseConfig`),
``shards.<dataset>`` (:class:`ShardConfig`); :class:`AugmentConfig` is ``<stage>.data.augment``
(the loader applies it). Ranges are declared on the fields; what relates a section to others
(a training crop to the stored image size, ...) is checked by ``chexflow.config``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from chexflow.settings import setting

# Image sides and crops in px: from 8 (a backbone's stride-2 stages leave nothing of less) to 4096
# (four times ChestX-ray14's 1024 px originals: a larger value is a typo).
MIN_SIDE, MAX_SIDE = 8, 4096
ARCHIVE_NUMBERS = {"ge": 1, "unique": True}   # a release's archives, numbered from 1 (the adapter knows the last)


@dataclass(frozen=True)
class AugmentConfig:
    flip: bool = True                 # random horizontal flip (GPU side)
    scale_min: float = setting(0.7, gt=0.0, le=1.0)   # RandomResizedCrop area range [scale_min, 1]
    rotate_deg: float = setting(0.0, ge=0.0, le=180.0)   # random rotation, degrees


@dataclass(frozen=True)
class DemoReleaseConfig:
    n_images: int = setting(3000, ge=1)
    image_size: int = setting(128, ge=MIN_SIDE, le=MAX_SIDE)
    images_per_archive: int = setting(1000, ge=1)
    test_fraction: float = setting(0.2, gt=0.0, lt=1.0)
    seed: int = setting(2017, ge=0)

    @property
    def n_archives(self) -> int:
        """images_001.tar.gz ... images_<n>.tar.gz: the last archive may hold fewer images."""
        return -(-self.n_images // self.images_per_archive)


# How a label table's observations become targets (CheXpert's 1.0 / 0.0 / -1.0 uncertain / blank not
# mentioned; Irvin et al., AAAI 2019): an uncertain one is read as positive (U-Ones), negative (U-Zeros)
# or unknown (U-Ignore: NaN, left out of the loss and of every metric of that finding and image)
UncertainPolicy = Literal["ones", "zeros", "ignore"]
BlankPolicy = Literal["negative", "ignore"]
DEFAULT_POLICY = "default"      # the key of ``uncertain`` that covers the findings not named


@dataclass(frozen=True)
class TableColumns:
    """Which column of a CSV-described dataset's table holds what (``datasets.<name>.columns``)."""
    image: str = "path"               # the image file, relative to the image folder
    patient: str = "patient"
    sex: str | None = None            # M / F / male / female (others: unknown)
    age: str | None = None            # years; "90+" reads as 90
    view: str | None = None           # PA / AP / lateral (LL, RL, LAT)
    split: str | None = None          # train / val / test; none: carved by patient (val_fraction, test_fraction)


@dataclass(frozen=True)
class TableSpec:
    """``datasets.<name>`` of a CSV-described folder of images (``format: csv``): where its table
    and images are and which columns say what. Its findings' names are the model's outputs; name them
    as NIH or CheXpert do (or as ``chexflow.data.labelmap`` lists) for an external validation to match them."""
    format: Literal["csv"] = "csv"
    table: str = ""                   # the CSV file (copied to data/raw/<name>/, its sha256 recorded)
    images: str = ""                  # the folder the image column's paths are relative to
    title: str = ""                   # shown in the report (default: the dataset's name)
    columns: TableColumns = field(default_factory=TableColumns)
    findings: dict[str, str] = field(default_factory=dict)   # finding -> its column (1 / 0 / -1 / blank)


@dataclass(frozen=True)
class ShardConfig:
    dataset: str = "nih_demo"
    image_size: int = setting(64, ge=MIN_SIDE, le=MAX_SIDE)   # stored side in px (store e.g. 256 for 224 crops)
    samples_per_shard: int = setting(1000, ge=1)
    encoding: Literal["raw", "png"] = "raw"   # raw uint8 needs no decode when training
    val_fraction: float = setting(0.1, ge=0.0, lt=1.0)   # share of train(_val) patients carved out for validation
    split_seed: int = setting(0, ge=0)
    # images that fail (missing, unreadable, over a bound below) as a share of the dataset's, beyond which
    # the gather fails. 5%: one missing file of a 41-image export (2.4%) passes, each reject named in its
    # shard log and counted in the manifest; the public releases set 0.001 in config.yaml
    max_reject_fraction: float = setting(0.05, ge=0.0, le=1.0)
    # full release: listed images found in no archive (else an error)
    max_missing_fraction: float = setting(0.001, ge=0.0, le=1.0)
    train_parts: int = setting(16, ge=1, le=1000)   # imagenet only: shard jobs for the train archive (class ranges)
    archives: tuple[int, ...] | None = setting(None, **ARCHIVE_NUMBERS)   # nih: a pilot (datasets.nih.archives)
    # an image file (archive member) larger than this is a reject, skipped without being read; an image
    # whose header declares more pixels is a reject, not decoded (a 50,000 x 50,000 PNG never is). 64 MB
    # and 64 MP take full-resolution CheXpert-v1.0 and DICOM as PACS exports it: a 43 x 43 cm detector at
    # 0.1 mm is 4,300 x 4,300 px = 18.5 MP, 37 MB uncompressed at 16 bits (arithmetic, not measured);
    # predict.max_image_megapixels is the same 64
    max_member_mb: float = setting(64.0, gt=0.0)
    max_image_megapixels: float = setting(64.0, gt=0.0)
    # label-table datasets (chexpert, csv): the uncertainty policy per finding ("default": the others),
    # what a blank (not mentioned) is, and which views are kept (frontal: lateral images left out)
    uncertain: dict[str, UncertainPolicy] = field(default_factory=lambda: {DEFAULT_POLICY: "ignore"})
    blank: BlankPolicy = "negative"
    views: Literal["frontal", "all"] = "frontal"
    # csv without a split column: the share of patients carved out for test (1.0: all test, an
    # external test set only)
    test_fraction: float = setting(0.2, ge=0.0, le=1.0)
    # folder datasets (chexpert, csv): set by the workflow from datasets.<name> (mirror / images, the table)
    images: str | None = None
    table: TableSpec | None = None
    # set by the workflow for a folder dataset only evaluate.external uses: its split keeps the test rows,
    # and only they are sharded (CheXpert: valid.csv's job alone; a CSV folder: one job)
    test_only: bool = False


@dataclass(frozen=True)
class SourceConfig:
    """``datasets.<name>``: where a downloaded dataset's files come from."""
    mirror: str | None = None         # a directory, file:// or http(s) base URL; None: the official URLs
    # nih only (its adapter's source_options): a pilot on these archives; None: the full release
    archives: tuple[int, ...] | None = setting(None, **ARCHIVE_NUMBERS)
    # nih only: BBox_List_2017.csv from the mirror scores the heatmaps (False: heatmaps without scores)
    boxes: bool = True
