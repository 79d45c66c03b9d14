"""Checkpoints: atomic save, newest-valid resume, and init-from-pretrained (model weights only).

Checkpoints live in ``results/<stage>/checkpoints/`` which is deliberately not a declared
Snakemake output: Snakemake deletes declared outputs before re-running a rule (snakemake#509),
so a retry finds them and resumes.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from chexflow.fsutil import atomic_path

_NAME = re.compile(r"^step-(\d{9})(?:-([0-9A-Za-z]+))?\.pt$")


def checkpoint_path(ckpt_dir: Path, step: int, run_id: str) -> Path:
    """``step-<step>-<run id>.pt``: the run id in the name keeps runs of other settings apart."""
    return Path(ckpt_dir) / f"step-{step:09d}-{run_id}.pt"


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temp name, fsync, rename: a crash never leaves a half file under ``path``."""
    with atomic_path(path, fsync=True) as tmp:
        torch.save(obj, tmp)


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, *, keep: int) -> Path:
    """Write ``state`` (which names its ``run_id``) and prune that run's older checkpoints only."""
    run_id = state["run_id"]
    path = checkpoint_path(ckpt_dir, step, run_id)
    save_atomic(state, path)
    for old in list_checkpoints(ckpt_dir, run_id=run_id)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(ckpt_dir: Path, *, run_id: str | None = None) -> list[Path]:
    """Checkpoints in ``ckpt_dir``, oldest step first; with ``run_id`` only that run's."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _NAME.match(p.name)
        if m and (run_id is None or m.group(2) == run_id):
            found.append((int(m.group(1)), p.name, p))
    return [p for _, _, p in sorted(found)]


REQUIRED = ("model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch")


def load_newest_valid(ckpt_dir: Path, *, run_id: str, log=print) -> tuple[Path, dict] | None:
    """The newest checkpoint of run ``run_id`` that loads and has every required entry.

    Corrupt or incomplete files are skipped with the reason; checkpoints of other runs (other
    settings or starting weights) are ignored, so a changed config starts afresh.
    """
    others = [p for p in list_checkpoints(ckpt_dir) if _NAME.match(p.name).group(2) != run_id]
    if others:
        log(f"{len(others)} checkpoint(s) in {ckpt_dir} belong to other configurations (not this run "
            f"{run_id}); not resuming from them")
    for path in reversed(list_checkpoints(ckpt_dir, run_id=run_id)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped, with its reason
            log(f"checkpoint {path}: unreadable ({type(exc).__name__}: {exc}); trying an older one")
            continue
        missing = [k for k in REQUIRED if k not in state] if isinstance(state, dict) else list(REQUIRED)
        if missing:
            log(f"checkpoint {path}: incomplete (missing {missing}); trying an older one")
            continue
        if state.get("run_id") != run_id:
            log(f"checkpoint {path}: its content names run {state.get('run_id')}, not {run_id}; skipped")
            continue
        return path, state
    return None


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (a state dict to broadcast or save, whatever the
    device of the rank that holds it)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


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
