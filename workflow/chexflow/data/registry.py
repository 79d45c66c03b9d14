"""The datasets chexflow knows: name -> adapter (``chexflow.data.dataset.Dataset``).

The only list of datasets: the config schema's dataset keys, the Snakefile's ``{dataset}``
wildcard, the raw files each job reads, the shard jobs and the shard stage's readers all come
from here. Adding a dataset is one module defining its adapter and one line below (see the
docs/datasets.md, "Adding a dataset"). Imported by the Snakefile for every DAG it builds.

Besides the datasets chexflow knows, a config declares CSV-described folders (``datasets.<name>`` with
``format: csv``, ``chexflow.data.csv_folder``): :func:`declare` makes their adapters, from their
declarations, the process's :data:`DECLARED`, this module's one state, in each process that needs them
(the Snakefile through ``chexflow.config.check_study``; a command through the declaration its rule
hands it, ``ShardConfig.table``). :func:`adapters` and :func:`get` see both.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from chexflow.data import chexpert, csv_folder, fashion_mnist, imagenet, nih, sources
from chexflow.data.config import TableSpec
from chexflow.data.dataset import Dataset
from chexflow.data.sources import Source, UnknownSourceError
from chexflow.fsutil import read_regular

DATASETS: dict[str, Dataset] = {a.name: a for a in (
    fashion_mnist.ADAPTER,
    nih.DEMO_ADAPTER,
    nih.DEMO_PRETRAIN_ADAPTER,
    nih.ADAPTER,
    imagenet.ADAPTER,
    chexpert.ADAPTER,
)}
NAMES = tuple(DATASETS)             # the datasets chexflow knows (adapters(): the declared ones too)
DECLARED: dict[str, Dataset] = {}   # the CSV-described folders this process declared (declare)


def declare(tables: Mapping[str, TableSpec]) -> None:
    """Make ``tables`` (name -> declaration of a CSV-described folder) the declared datasets of this
    process, beside the known ones (an earlier declaration of another name is dropped). A name of a
    known dataset cannot be declared."""
    clash = sorted(set(tables) & set(DATASETS))
    if clash:
        raise UnknownSourceError(f"datasets.{clash[0]}: {clash[0]!r} is a dataset chexflow knows; a CSV-described "
                                 "folder needs a name of its own")
    DECLARED.clear()
    DECLARED.update({name: csv_folder.adapter(name, spec) for name, spec in tables.items()})


def adapters() -> dict[str, Dataset]:
    """Every dataset of this process by name: the known ones and the declared ones."""
    return {**DATASETS, **DECLARED}


def get(name: str) -> Dataset:
    """The adapter of dataset ``name`` (``UnknownSourceError`` naming the known ones)."""
    try:
        return DATASETS.get(name) or DECLARED[name]
    except (KeyError, TypeError):
        raise UnknownSourceError(f"unknown dataset {name!r}; known datasets: {', '.join(adapters())}") from None


def decoding_of(name: str) -> str:
    """How image files are read for a model of dataset ``name`` (``tables.DECODINGS``): its adapter's, and
    for a name this process does not list a CSV-described folder's (the only kind a config declares)."""
    known = DATASETS.get(name) or DECLARED.get(name)
    return known.decoding if known is not None else csv_folder.CSVFolder.decoding


def get_source(name: str, *, n_archives: int | None = None) -> Source:
    """The source of dataset ``name``, as its adapter defines it.

    ``n_archives``: for ``nih_demo`` (required) the number of archives of the generated release;
    an error for ``nih`` (always its 12 archives); ignored by the others.
    """
    return get(name).source(n_archives)


def load_test_registry(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The test-only override of pins and published contents named by ``$CHEXFLOW_TEST_REGISTRY``
    (None when unset); ``chexflow.data.sources.with_test_pins`` and ``registry_content`` apply it.

    A JSON object ``{source: {"files": {name: {"sha256": hex, "size": int}}, "content": {...}}}``:
    ``files`` replaces the pinned checksums of those files (their md5 pins are dropped), and
    ``content`` replaces the published content a source's tables are checked against (for
    ``nih``: the fields of ``chexflow.data.nih.ReleaseCounts``). For tests that serve a generated
    mirror of a real source; a warning naming the file goes to stderr whenever it is used.
    """
    path = (os.environ if environ is None else environ).get(sources.TEST_REGISTRY_ENV)
    if not path:
        return None
    try:
        data = json.loads(read_regular(path))
    except (OSError, ValueError) as exc:
        raise sources.RegistryOverrideError(f"{sources.TEST_REGISTRY_ENV}={path}: cannot read the test registry "
                                            f"({exc})") from exc
    if not isinstance(data, dict):
        raise sources.RegistryOverrideError(f"{path}: expected a JSON object {{source: {{files, content}}}}")
    for name, entry in data.items():
        if name not in adapters():
            raise sources.RegistryOverrideError(f"{path}: unknown source {name!r}; known: {', '.join(adapters())}")
        if not isinstance(entry, dict) or set(entry) - {"files", "content"}:
            raise sources.RegistryOverrideError(f"{path}: {name}: expected an object with keys 'files' and/or "
                                                "'content'")
    print(f"WARNING: {sources.TEST_REGISTRY_ENV}={path}: pinned checksums / published contents of "
          f"{', '.join(sorted(data))} are replaced by this test registry", file=sys.stderr)
    return data
