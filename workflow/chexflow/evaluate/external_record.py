"""The external validation's record, ``results/external/<dataset>/metrics.json``: what
``chexflow.evaluate.external`` writes, and the reader the report goes through (no torch here: the
report's environment has none)."""
from __future__ import annotations

from pathlib import Path

from chexflow.fsutil import read_json


class ExternalInputError(ValueError):
    """The internal record and the model or the external data do not belong together, or a record is not
    the external validation's; the message names the file(s)."""


def read_record(path: Path) -> dict:
    """An external validation's ``metrics.json`` checked against what ``run`` writes (the report reads it
    so); anything else fails naming the file and the key."""
    data = read_json(path, ExternalInputError, what="external validation record", kind="an external validation record")
    for key, tp in (("dataset", str), ("findings", list), ("mean", dict), ("label_map", dict), ("bootstrap", dict),
                    ("n_images", int), ("n_patients", int)):
        if not isinstance(data.get(key), tp):
            raise ExternalInputError(f"{path}: {key!r} must be a {tp.__name__}, got {data.get(key)!r}")
    for i, f in enumerate(data["findings"]):
        if not isinstance(f, dict) or not all(isinstance(f.get(k), dict) for k in ("internal", "external", "drop")):
            raise ExternalInputError(f"{path}: findings[{i}] must hold 'internal', 'external' and 'drop' objects")
    for key in ("pairs", "model_only", "data_only"):
        if not isinstance(data["label_map"].get(key), list):
            raise ExternalInputError(f"{path}: label_map.{key} must be a list")
    return data
