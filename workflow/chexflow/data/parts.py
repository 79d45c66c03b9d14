"""The shard jobs ("parts") of every dataset: names only.

Imported by the Snakefile (``rules/common.smk``) for every DAG it builds, so it must stay cheap to
import: standard library and ``chexflow.config`` only (no numpy/pandas/torch; importing
``chexflow.data.shards`` pulls in webdataset and with it torch, seconds per ``snakemake -n``).
"""
from __future__ import annotations

import re

from chexflow.config import ShardConfig

# Fashion-MNIST: part name -> (images file, labels file)
FASHION_MNIST_PARTS = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "t10k": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
NIH_ARCHIVES = 12
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


def parts_of(name: str, n_archives: int | None = None, *, train_parts: int | None = None) -> list[str]:
    """The shard jobs of a dataset: one per source archive (ImageNet: ``train_parts`` class ranges
    of the train archive + ``val``)."""
    if name == "fashion_mnist":
        return list(FASHION_MNIST_PARTS)
    if name == "nih":
        return [f"images_{i:03d}" for i in range(1, NIH_ARCHIVES + 1)]
    if name == "nih_demo":
        return [f"images_{i:03d}" for i in range(1, (n_archives or 1) + 1)]
    if name == "imagenet":
        return imagenet_parts(train_parts if train_parts is not None else ShardConfig.train_parts)
    raise PartError(f"dataset {name!r}: no shard reader (known: fashion_mnist, imagenet, nih, nih_demo)")
