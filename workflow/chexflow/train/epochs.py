"""The training's per-epoch record, ``metrics.jsonl`` (``chexflow.train.trainer`` writes it next to
the model): one JSON object per epoch, and the one reader its consumers (the report, the ablation
comparison) go through."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chexflow import host
from chexflow.fsutil import read_text_regular

REQUIRED = ("epoch", "train_loss", "val_metric")   # in every epoch's object


class EpochsRecordError(ValueError):
    """A metrics.jsonl that is not the training's record (names the file, the line and the key)."""


def read_epochs(path: Path, what: str) -> list[dict[str, Any]]:
    """The epochs of ``path`` in order; ``what``: the run, for the messages ("fine-tuning", ...)."""
    path = Path(path)
    try:
        text = read_text_regular(path, what=f"{what} training metrics")
    except FileNotFoundError as exc:
        raise EpochsRecordError(f"{what} training metrics not found: {path}") from exc
    except UnicodeDecodeError as exc:
        raise EpochsRecordError(f"{path}: not UTF-8 text: {exc}") from exc
    epochs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EpochsRecordError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise EpochsRecordError(f"{path}:{lineno}: expected a JSON object per line")
        missing = [k for k in REQUIRED if k not in obj]
        if missing:
            raise EpochsRecordError(f"{path}:{lineno}: missing key(s) {missing}")
        problems = host.problems(obj["host"]) if "host" in obj else []   # absent in earlier records
        if problems:
            raise EpochsRecordError(f"{path}:{lineno}: host: {'; '.join(problems)}")
        epochs.append(obj)
    if not epochs:
        raise EpochsRecordError(f"{path}: no epochs recorded ({what} training metrics are empty)")
    return epochs
