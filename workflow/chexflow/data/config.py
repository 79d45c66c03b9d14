"""The data stages' settings: the generated phantom releases, the shards, the training-time augmentation.

Sections of config.yaml: ``demo_release`` / ``demo_pretrain_release`` (:class:`DemoReleaseConfig`),
``shards.<dataset>`` (:class:`ShardConfig`); :class:`AugmentConfig` is ``<stage>.data.augment``
(the loader applies it). Ranges are declared on the fields; what relates a section to others
(a training crop to the stored image size, ...) is checked by ``chexflow.config``.
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class ShardConfig:
    dataset: str = "nih_demo"
    image_size: int = setting(64, ge=MIN_SIDE, le=MAX_SIDE)   # stored side in px (store e.g. 256 for 224 crops)
    samples_per_shard: int = setting(1000, ge=1)
    encoding: Literal["raw", "png"] = "raw"   # raw uint8 needs no decode when training
    val_fraction: float = setting(0.1, ge=0.0, lt=1.0)   # share of train(_val) patients carved out for validation
    split_seed: int = setting(0, ge=0)
    max_reject_fraction: float = setting(0.001, ge=0.0, le=1.0)
    # full release: listed images found in no archive (else an error)
    max_missing_fraction: float = setting(0.001, ge=0.0, le=1.0)
    train_parts: int = setting(16, ge=1, le=1000)   # imagenet only: shard jobs for the train archive (class ranges)
    archives: tuple[int, ...] | None = setting(None, **ARCHIVE_NUMBERS)   # nih: a pilot (datasets.nih.archives)
    # archive datasets (nih*, imagenet: their shard_options): an archive member larger than this is a
    # reject, skipped without being read; an image whose header declares more pixels is a reject, not
    # decoded. The defaults fit chest X-ray releases (NIH: 1,024 px PNGs of 0.3-2 MB)
    max_member_mb: float = setting(16.0, gt=0.0)
    max_image_megapixels: float = setting(4.0, gt=0.0)


@dataclass(frozen=True)
class SourceConfig:
    """``datasets.<name>``: where a downloaded dataset's files come from."""
    mirror: str | None = None         # a directory, file:// or http(s) base URL; None: the official URLs
    # nih only (its adapter's source_options): a pilot on these archives; None: the full release
    archives: tuple[int, ...] | None = setting(None, **ARCHIVE_NUMBERS)
    # nih only: BBox_List_2017.csv from the mirror scores the heatmaps (False: heatmaps without scores)
    boxes: bool = True
