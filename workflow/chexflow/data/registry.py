"""The datasets chexflow knows: name -> adapter (``chexflow.data.dataset.Dataset``).

The only list of datasets: the config schema's dataset keys, the Snakefile's ``{dataset}``
wildcard, the raw files each job reads, the shard jobs and the shard stage's readers all come
from here. Adding a dataset is one module defining its adapter and one line below (see the
README, "Adding a dataset"). Imported by the Snakefile for every DAG it builds.
"""
from __future__ import annotations

from chexflow.data import fashion_mnist, imagenet, nih
from chexflow.data.dataset import Dataset
from chexflow.data.sources import UnknownSourceError

DATASETS: dict[str, Dataset] = {a.name: a for a in (
    fashion_mnist.ADAPTER,
    nih.DEMO_ADAPTER,
    nih.DEMO_PRETRAIN_ADAPTER,
    nih.ADAPTER,
    imagenet.ADAPTER,
)}
NAMES = tuple(DATASETS)


def get(name: str) -> Dataset:
    """The adapter of dataset ``name`` (``UnknownSourceError`` naming the known ones)."""
    try:
        return DATASETS[name]
    except (KeyError, TypeError):
        raise UnknownSourceError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}") from None

