"""The shard jobs ("parts") of every dataset: names only.

Imported by the Snakefile (``rules/common.smk``) for every DAG it builds, so it must stay cheap to
import: standard library and ``chexflow.config`` only (no numpy/pandas/torch; importing
``chexflow.data.shards`` pulls in webdataset and with it torch, seconds per ``snakemake -n``).
"""
from __future__ import annotations

import re
from typing import Sequence

from chexflow.config import ShardConfig
from chexflow.data.sources import NIH_N_ARCHIVES, NIH_TABLES

# Fashion-MNIST: part name -> (images file, labels file)
FASHION_MNIST_PARTS = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "t10k": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
NIH_ARCHIVES = NIH_N_ARCHIVES   # images_001.tar.gz ... images_012.tar.gz of the real release
IMAGENET_VAL_PART = "val"
IMAGENET_MAX_TRAIN_PARTS = 1000   # train_000 .. train_999: at most one part per class
TRAIN_PART_RE = re.compile(r"train_(\d{3})")


class PartError(ValueError):
    """A dataset has no such part / part count; the message says what exists."""


def check_train_parts(train_parts: int) -> int:
    if isinstance(train_parts, bool) or not isinstance(train_parts, int) \
            or not 1 <= train_parts <= IMAGENET_MAX_TRAIN_PARTS:
        raise PartError(f"imagenet: train_parts must be an integer in 1..{IMAGENET_MAX_TRAIN_PARTS}, "
                        f"got {train_parts!r}")
    return train_parts


def imagenet_parts(train_parts: int) -> list[str]:
    """``train_000`` ... ``train_{N-1}`` (class ranges of the train archive) and ``val``."""
    return [f"train_{i:03d}" for i in range(check_train_parts(train_parts))] + [IMAGENET_VAL_PART]


def check_nih_archives(archives: Sequence[int] | None) -> tuple[int, ...] | None:
    """A declared pilot subset of the NIH archives (1-based numbers, e.g. ``[1, 2]``), sorted;
    ``None`` (the full release) stays ``None``."""
    if archives is None:
        return None
    if isinstance(archives, (str, bytes)) or not isinstance(archives, Sequence) or not archives:
        raise PartError(f"datasets.nih.archives: expected a non-empty list of archive numbers 1..{NIH_ARCHIVES} "
                        f"or null (all), got {archives!r}")
    bad = [a for a in archives if isinstance(a, bool) or not isinstance(a, int) or not 1 <= a <= NIH_ARCHIVES]
    if bad:
        raise PartError(f"datasets.nih.archives: {bad} not archive number(s) of the release (1..{NIH_ARCHIVES})")
    if len(set(archives)) != len(archives):
        raise PartError(f"datasets.nih.archives: {list(archives)} lists an archive twice")
    return tuple(sorted(archives))


def nih_parts(archives: Sequence[int] | None = None) -> list[str]:
    """``images_001`` ... ``images_012``, or the parts of a declared pilot subset."""
    chosen = check_nih_archives(archives) or range(1, NIH_ARCHIVES + 1)
    return [f"images_{i:03d}" for i in chosen]


def part_files(name: str, part: str) -> list[str]:
    """The files under ``data/raw/<name>/`` that shard job ``part`` reads."""
    if name == "fashion_mnist":
        if part not in FASHION_MNIST_PARTS:
            raise PartError(f"fashion_mnist has no part {part!r} (parts: {list(FASHION_MNIST_PARTS)})")
        return list(FASHION_MNIST_PARTS[part])
    if name == "imagenet":   # parts train_NNN (class ranges of the train tar) and val
        archive = "ILSVRC2012_img_val.tar" if part == IMAGENET_VAL_PART else "ILSVRC2012_img_train.tar"
        return [archive, "ILSVRC2012_devkit_t12.tar.gz"]
    if name in ("nih", "nih_demo"):
        return [f"{part}.tar.gz", NIH_TABLES[0]]
    raise PartError(f"dataset {name!r}: no shard reader (known: fashion_mnist, imagenet, nih, nih_demo)")


def parts_of(name: str, n_archives: int | None = None, *, train_parts: int | None = None,
             archives: Sequence[int] | None = None) -> list[str]:
    """The shard jobs of a dataset: one per source archive (ImageNet: ``train_parts`` class ranges
    of the train archive + ``val``). ``n_archives``: the generated demo release's archive count;
    ``archives``: a declared pilot subset of the 12 NIH archives (None: all of them)."""
    if name == "fashion_mnist":
        return list(FASHION_MNIST_PARTS)
    if name == "nih":
        return nih_parts(archives)
    if name == "nih_demo":
        return [f"images_{i:03d}" for i in range(1, (n_archives or 1) + 1)]
    if name == "imagenet":
        return imagenet_parts(train_parts if train_parts is not None else ShardConfig.train_parts)
    raise PartError(f"dataset {name!r}: no shard reader (known: fashion_mnist, imagenet, nih, nih_demo)")
