"""Checkpoints: atomic save, newest-valid resume, and init-from-pretrained (model weights only).

Checkpoints live in ``results/<stage>/checkpoints/`` which is deliberately not a declared
Snakemake output: Snakemake deletes declared outputs before re-running a rule (snakemake#509),
so a retry finds them and resumes.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step-(\d{9})\.pt$")


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step-{step:09d}.pt"


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temp name, fsync, rename: a crash never leaves a half file under ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, *, keep: int) -> Path:
    path = checkpoint_path(ckpt_dir, step)
    save_atomic(state, path)
    for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)


REQUIRED = ("model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch")


def load_newest_valid(ckpt_dir: Path, *, run_id: str | None = None, log=print) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads, has every required entry and belongs to ``run_id``.

    Corrupt or incomplete files are skipped with the reason; checkpoints of another run (other
    settings or starting weights) are ignored, so a changed config starts afresh.
    """
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped, with its reason
            log(f"checkpoint {path}: unreadable ({type(exc).__name__}: {exc}); trying an older one")
            continue
        missing = [k for k in REQUIRED if k not in state] if isinstance(state, dict) else list(REQUIRED)
        if missing:
            log(f"checkpoint {path}: incomplete (missing {missing}); trying an older one")
            continue
        if run_id is not None and state.get("run_id") != run_id:
            log(f"checkpoint {path}: written by another configuration (run {state.get('run_id')}, "
                f"this run {run_id}); not resuming from it")
            continue
        return path, state
    return None


def load_model_file(path: Path) -> dict:
    """A final model file (``model.pt``): a dict with 'state_dict' and its description."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: model file not found") from exc
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{path}: not a readable chexflow model file ({exc})") from exc
    if not isinstance(obj, dict) or "state_dict" not in obj:
        raise ValueError(f"{path}: not a chexflow model file (no 'state_dict')")
    return obj
