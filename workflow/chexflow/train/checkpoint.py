"""Checkpoints and model files: atomic save, weights-only load, newest-valid resume, and the one
validator of model files that every reader uses (evaluation, init-from-pretrained, the sweep's
selection, prediction and export).

Every ``.pt`` file chexflow reads goes through :func:`load_pt`: a torch zip archive loaded with
``weights_only=True`` (tensors and plain containers only), so unpickling never runs code from the
file. Checkpoints sit on shared cluster file systems: a file that is not what chexflow writes is
refused with the file and the reason, and a refused checkpoint is renamed aside
(``<name>.refused``) so that it is never tried again and never takes a real checkpoint's place in
pruning.

Checkpoints live in ``results/<stage>/checkpoints/`` which is deliberately not a declared
Snakemake output: Snakemake deletes declared outputs before re-running a rule (snakemake#509),
so a retry finds them and resumes.
"""
from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from chexflow import __version__, host as hosts
from chexflow.fsutil import NotRegularFile, atomic_path, check_regular, open_regular
from chexflow.train.progress import progress_problem
from chexflow.train.weights import weights_problem

_NAME = re.compile(r"^step-(\d{9})(?:-([0-9A-Za-z]+))?\.pt$")

# The layout of a resume checkpoint. 1: chexflow before format versions (a pickled numpy RNG state,
# which a weights-only load refuses). 2: tensors and plain types only, 'format' and 'stopped'.
CHECKPOINT_FORMAT = 2
# The layout of a model file (model.pt, best-<run id>.pt): the fields of MODEL_FIELDS.
MODEL_FORMAT = 1
REFUSED_SUFFIX = ".refused"

REQUIRED = ("model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch", "run_id")

# field -> type of a model file; written by model_record, checked by load_model_file
MODEL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": int, "chexflow_version": str, "run_id": str, "stage": str, "dataset": str, "task": str,
    "labels": list, "arch": str, "in_channels": int, "num_outputs": int, "crop": int, "epoch": int,
    "val_metric": (float, int), "val_metric_name": str, "config": dict, "state_dict": dict,
}
TASKS = ("multiclass", "multilabel")


class RefusedFile(ValueError):
    """A ``.pt`` file chexflow does not use: the message names the file and why."""


class ModelFileError(RefusedFile):
    """A model file that is not a chexflow model of this format, or not the model a step expects."""


class WriteError(RuntimeError):
    """A checkpoint or model file could not be written (disk full, quota, I/O); nothing half-written remains."""


# ------------------------------------------------------------------ reading any .pt safely
def load_pt(path: Path) -> Any:
    """The content of ``path``, loaded weights-only; :class:`RefusedFile` names the file and why.

    Only a regular file is opened (a FIFO, a device, a directory under a ``.pt`` name is refused
    without blocking or reading); what torch reads is that open file, the zip archive's entries
    stored uncompressed and within the file's size (as torch writes them), so nothing is read past
    the file. A missing or unreadable file raises the ``OSError`` (the caller says what it was
    looking for).
    """
    path = Path(path)
    try:
        fh = open_regular(path)
    except NotRegularFile as exc:
        raise RefusedFile(f"{path}: refused: {exc.strerror}") from None
    with fh:
        _check_zip(fh, path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # torch warns about the pickle protocol before refusing
                return torch.load(fh, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise RefusedFile(f"{path}: refused: not a weights-only file ({_unpickling_refusal(exc)})") from exc
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/ValueError/... for broken archives
            raise RefusedFile(f"{path}: refused: unreadable ({type(exc).__name__}: {_first_line(exc)})") from exc


def _check_zip(fh, path: Path) -> None:
    """A torch zip archive whose entries are stored (not compressed) within the file, else :class:`RefusedFile`
    (a bare pickle is never handed to an unpickler; a compressed entry could expand without bound)."""
    size = os.fstat(fh.fileno()).st_size
    try:
        with zipfile.ZipFile(fh) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        raise RefusedFile(f"{path}: refused: not a torch zip archive (truncated, corrupt, or a bare pickle; "
                          "chexflow writes torch zip files only)") from None
    for e in entries:
        if e.compress_type != zipfile.ZIP_STORED or e.file_size > size:
            raise RefusedFile(f"{path}: refused: zip entry {e.filename!r} is compressed or larger than the file "
                              "(torch stores its entries uncompressed)")
    fh.seek(0)


def _unpickling_refusal(exc: Exception) -> str:
    """What the weights-only unpickler refused, in a few words (torch's message is a paragraph)."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"unpickling would run code: GLOBAL {found.group(1)}"
    found = re.search(r"Unsupported operand (\d+)", text)
    if found:
        return f"pickle opcode {found.group(1)} is not allowed"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "weights_only" not in ln]
    return lines[-1] if lines else "refused by the weights-only unpickler"


def _first_line(exc: BaseException) -> str:
    """The exception's message on one line, at most 400 characters."""
    return " ".join(str(exc).split())[:400]


# ------------------------------------------------------------------ writing
def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _write_error(path: Path, obj: Any, exc: BaseException) -> WriteError:
    """The failed write of ``path``, with the free space of its file system and the likely cause
    (torch reports a full disk as "[enforce fail at inline_container.cc] unexpected pos ...")."""
    need = _tensor_bytes(obj)
    try:
        usage = shutil.disk_usage(path.parent)
    except OSError:
        usage = None
    code = getattr(exc, "errno", None)
    if code == errno.EDQUOT:
        cause = "the disk quota is exhausted"
    elif code == errno.ENOSPC or (usage is not None and usage.free < need):
        cause = "the file system is full"
    else:
        cause = "the write failed"
    space = (f"{_mib(usage.free)} free of {_mib(usage.total)} on its file system" if usage is not None
             else "free space unknown")
    return WriteError(f"{path}: not written: {cause} ({space}; the file needs about {_mib(need)}); nothing "
                      f"half-written was left ({type(exc).__name__}: {_first_line(exc)})")


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temp name, fsync, rename: a crash or a full disk never leaves a half file
    under ``path``; a failed write raises :class:`WriteError` naming the path and the free space."""
    path = Path(path)
    try:
        with atomic_path(path, fsync=True) as tmp:
            torch.save(obj, tmp)
    except Exception as exc:  # noqa: BLE001 - RuntimeError from torch's zip writer, OSError from fsync/rename
        # torch's writer, still open in the traceback's frames, holds the deleted temp file's space
        # (and its file system busy): drop it before measuring what is free
        _drop_frames(exc)
        raise _write_error(path, obj, exc) from exc


def _drop_frames(exc: BaseException | None) -> None:
    """Forget the tracebacks of ``exc`` and the exceptions it chains (their frames hold locals)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


# ------------------------------------------------------------------ resume checkpoints
def checkpoint_path(ckpt_dir: Path, step: int, run_id: str) -> Path:
    """``step-<step>-<run id>.pt``: the run id in the name keeps runs of other settings apart."""
    return Path(ckpt_dir) / f"step-{step:09d}-{run_id}.pt"


def _step_of(path: Path) -> int:
    return int(_NAME.match(Path(path).name).group(1))


def run_id_of(path: Path) -> str | None:
    """The run id in a checkpoint's name (None for a name without one)."""
    return _NAME.match(Path(path).name).group(2)


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, *, keep: int) -> Path:
    """Write ``state`` (which names its ``run_id``) and prune that run's older checkpoints only.

    Pruning counts this run's checkpoints up to ``step``: a file of this run's name with a higher
    step was never resumed (planted, or refused and renamed aside meanwhile) and never takes the
    place of a real checkpoint.
    """
    run_id = state["run_id"]
    path = checkpoint_path(ckpt_dir, step, run_id)
    save_atomic({**state, "format": CHECKPOINT_FORMAT}, path)
    if keep > 0:
        mine = [p for p in list_checkpoints(ckpt_dir, run_id=run_id) if _step_of(p) <= step]
        for old in mine[:-keep]:
            old.unlink(missing_ok=True)
    return path


def list_checkpoints(ckpt_dir: Path, *, run_id: str | None = None) -> list[Path]:
    """Checkpoints in ``ckpt_dir``, oldest step first; with ``run_id`` only that run's.

    Only regular files count: anything else under a checkpoint's name (a FIFO, a device, a
    directory, a symbolic link, which is never followed out of the folder) is renamed aside to
    ``<name>.refused`` unopened, with a message, and never resumed or pruned.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _NAME.match(p.name)
        if not m or (run_id is not None and m.group(2) != run_id):
            continue
        try:
            check_regular(p, follow_symlinks=False)
        except NotRegularFile as exc:
            _set_aside_unopened(p, exc.strerror)
            continue
        except OSError:             # gone meanwhile
            continue
        found.append((int(m.group(1)), p.name, p))
    return [p for _, _, p in sorted(found)]


def _set_aside_unopened(path: Path, reason: str) -> None:
    try:
        set_aside(path, reason, lambda msg: print(msg, file=sys.stderr, flush=True))
    except OSError as exc:
        print(f"checkpoint {path} refused: {reason}; not renamed aside ({exc.strerror}); skipped",
              file=sys.stderr, flush=True)


def checkpoint_problem(state: Any, path: Path, run_id: str,
                       expect_model: Mapping[str, torch.Tensor] | None = None) -> str | None:
    """Why ``state`` (loaded from ``path``) is not a checkpoint this run can resume, or None;
    ``expect_model``: the state dict of the run's network, whose keys and shapes its weights must have."""
    if not isinstance(state, dict):
        return f"not a chexflow checkpoint (holds a {type(state).__name__})"
    if state.get("format") != CHECKPOINT_FORMAT:
        return (f"checkpoint format {state.get('format', 1)!r}; this chexflow {__version__} resumes format "
                f"{CHECKPOINT_FORMAT} only")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        return f"incomplete (missing {missing})"
    if state["run_id"] != run_id:
        return f"its content names run {state['run_id']!r}, not this run {run_id!r}"
    for key in ("step", "epoch", "step_in_epoch"):
        if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
            return f"{key} is {state[key]!r}, not a count"
    if _NAME.match(Path(path).name) and state["step"] != _step_of(path):
        return f"its name says step {_step_of(path)}, its content step {state['step']}"
    if not isinstance(state["model"], dict) or not all(isinstance(v, torch.Tensor) for v in state["model"].values()):
        return "its 'model' entry is not a state dict of tensors"
    if expect_model is not None and (problem := weights_problem(expect_model, state["model"])):
        return f"its weights do not fit this run's network: {problem}"
    if not isinstance(state["optimizer"], dict) or not isinstance(state["scheduler"], dict):
        return "its 'optimizer' or 'scheduler' entry is not a state dict"
    return progress_problem(state)


def set_aside(path: Path, reason: str, log: Callable[[str], None]) -> Path:
    """Rename a refused checkpoint to ``<name>.refused``: kept for inspection, out of resume and pruning."""
    aside = path.with_name(path.name + REFUSED_SUFFIX)
    os.replace(path, aside)
    log(f"checkpoint {path} refused: {reason}; renamed to {aside.name} (never resumed, not counted by pruning)")
    return aside


def load_newest_valid(ckpt_dir: Path, *, run_id: str, log=print, expect_model: Mapping[str, torch.Tensor] | None = None,
                      at_step: int | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint of run ``run_id`` that loads weights-only and is complete (and, with
    ``expect_model``, whose weights fit that state dict's keys and shapes; with ``at_step``, of that step).

    A refused file (not weights-only, corrupt, incomplete, another format or run, weights of another
    network) is logged with its reason and renamed aside, and the next older one is tried; a file
    that cannot be read at all (I/O error) is skipped and left in place. Checkpoints of other runs
    (other settings, data or starting weights) are ignored, so a changed config or dataset starts afresh.
    """
    others = [p for p in list_checkpoints(ckpt_dir) if run_id_of(p) != run_id]
    if others and at_step is None:
        log(f"{len(others)} checkpoint(s) in {ckpt_dir} belong to other runs (other settings, data or starting "
            f"weights; not this run {run_id}); not resuming from them")
    for path in reversed(list_checkpoints(ckpt_dir, run_id=run_id)):
        if at_step is not None and _step_of(path) != at_step:
            continue
        try:
            state = load_pt(path)
        except RefusedFile as exc:
            set_aside(path, str(exc).split(": refused: ", 1)[-1], log)
            continue
        except OSError as exc:
            log(f"checkpoint {path}: cannot be read ({exc}); trying an older one")
            continue
        problem = checkpoint_problem(state, path, run_id, expect_model)
        if problem:
            set_aside(path, problem, log)
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


# ------------------------------------------------------------------ weights
def best_model(best_path: Path, ckpt_dir: Path, *, run_id: str, epoch: int, step: int,
               expect_model: Mapping[str, torch.Tensor], rebuild: Callable[[dict], dict], log=print) -> dict:
    """The model file of a run's best epoch: ``best_path`` when it is that model and fits
    ``expect_model``; else (renamed aside when refused) ``rebuild`` of the weights of the run's
    newest valid checkpoint at the end of that epoch (``step``); with none left, a
    :class:`ModelFileError` saying what to delete to train the run again."""
    best_path = Path(best_path)
    try:
        final = load_model_file(best_path, expect={"run_id": run_id, "epoch": epoch})
        problem = weights_problem(expect_model, final["state_dict"])
        if not problem:
            return final
        problem = f"its weights do not fit this run's network: {problem}"
    except ModelFileError as exc:
        problem = str(exc).split(": refused: ", 1)[-1]
    except FileNotFoundError:
        problem = "missing"
    if best_path.exists():
        set_aside(best_path, problem, log)
    found = load_newest_valid(ckpt_dir, run_id=run_id, log=log, expect_model=expect_model, at_step=step)
    if found is None:
        raise ModelFileError(f"{best_path}: refused ({problem}), and no valid checkpoint of its epoch {epoch} "
                             f"(step {step}) is left to rebuild it: delete {Path(ckpt_dir)}/step-*-{run_id}.pt "
                             "and rerun to train this run again")
    log(f"best model of epoch {epoch} rebuilt from {found[0]}")
    return rebuild(found[1]["model"])


# ------------------------------------------------------------------ model files
def model_record(*, state_dict: dict, run_id: str, stage: str, dataset: str, task: str, labels: list[str],
                 arch: str, in_channels: int, crop: int, epoch: int, val_metric: float, val_metric_name: str,
                 config: dict, data: dict | None = None, host: dict | None = None) -> dict:
    """A model file's content (``model.pt``, ``best-<run id>.pt``): the weights and what identifies
    them (the run id of the settings, data and starting weights that trained them, the task and labels
    they predict, the network, the format version); ``data``: the summary of the dataset it was
    trained on (``chexflow.train.identity.data_summary``: its shards' sha256 per split); ``host``: where
    it was trained (``chexflow.host.describe``). Checked here as a reader checks it."""
    record = {"format": MODEL_FORMAT, "chexflow_version": __version__, "run_id": run_id, "stage": stage,
              "dataset": dataset, "task": task, "labels": list(labels), "arch": arch, "in_channels": in_channels,
              "num_outputs": len(labels), "crop": crop, "epoch": epoch, "val_metric": float(val_metric),
              "val_metric_name": val_metric_name, "config": config, "state_dict": state_dict}
    if data is not None:
        record["data"] = data
    if host is not None:
        record["host"] = host
    problems = model_problems(record)
    if problems:
        raise ValueError(f"model record: {'; '.join(problems)}")
    return record


def model_problems(obj: Any) -> list[str]:
    """Why ``obj`` is not a chexflow model file of this format ([] when it is). Evaluation's ``predict``
    record, when the file has one, is its writer's to check (``chexflow.evaluate.predict_record``)."""
    if not isinstance(obj, dict):
        return [f"not a chexflow model file (holds a {type(obj).__name__})"]
    if "format" not in obj:
        return ["no model format version: written by a chexflow before model format versions, or not by "
                "chexflow (retrain it with this version)"]
    if obj["format"] != MODEL_FORMAT:
        return [f"model format {obj['format']!r} (chexflow {obj.get('chexflow_version', '?')}); this chexflow "
                f"{__version__} reads model format {MODEL_FORMAT}"]
    problems = []
    for key, tp in MODEL_FIELDS.items():
        if key not in obj:
            problems.append(f"no {key!r}")
        elif isinstance(obj[key], bool) or not isinstance(obj[key], tp):
            problems.append(f"{key} is a {type(obj[key]).__name__}")
    if problems:
        return problems
    if obj["task"] not in TASKS:
        problems.append(f"task {obj['task']!r} is none of {list(TASKS)}")
    if not all(isinstance(label, str) for label in obj["labels"]) or len(obj["labels"]) != obj["num_outputs"]:
        problems.append(f"labels ({len(obj['labels'])}) do not name its {obj['num_outputs']} outputs")
    if not obj["state_dict"] or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                        for k, v in obj["state_dict"].items()):
        problems.append("state_dict is not a mapping of names to tensors")
    if "host" in obj:           # optional: model files of earlier chexflow versions have none
        problems += [f"host: {p}" for p in hosts.problems(obj["host"])]
    return problems


def _difference(key: str, have: Any, want: Any) -> str | None:
    if isinstance(want, (set, frozenset)):
        return None if have in want else f"{key}: the file's {have!r}, expected one of {sorted(want)}"
    if have == want:
        return None
    if isinstance(have, list) and isinstance(want, list):
        at = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
        first = f"{have[at]!r}" if at < len(have) else "nothing"
        expected = f"{want[at]!r}" if at < len(want) else "nothing"
        return (f"{key}: the file has {len(have)}, expected {len(want)}; first difference at position {at}: "
                f"the file's {first}, expected {expected}")
    return f"{key}: the file's {have!r}, expected {want!r}"


def load_model_file(path: Path, *, expect: Mapping[str, Any] | None = None) -> dict:
    """A chexflow model file, checked: loaded weights-only, of this format, complete, and matching
    ``expect`` (field -> value, or a set of accepted values; e.g. ``{"task": "multilabel",
    "labels": [...], "run_id": "..."}``). :class:`ModelFileError` names the file and every difference."""
    path = Path(path)
    try:
        obj = load_pt(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: model file not found") from exc
    except RefusedFile as exc:
        raise ModelFileError(str(exc)) from exc
    problems = model_problems(obj)
    if problems:
        raise ModelFileError(f"{path}: refused: {'; '.join(problems)}")
    diffs = [d for key, want in (expect or {}).items() if (d := _difference(key, obj.get(key), want))]
    if diffs:
        raise ModelFileError(f"{path}: refused: not the model expected here: {'; '.join(diffs)}")
    return obj


def load_model(path: Path, *, expect: Mapping[str, Any] | None = None) -> tuple[torch.nn.Module, dict]:
    """The network of a checked model file (on the CPU, eval mode) and the file's fields."""
    from chexflow.train.models import ModelError, build_model
    info = load_model_file(path, expect=expect)
    what = f"{info['arch']} with {info['in_channels']} input channel(s) and {info['num_outputs']} outputs"
    try:
        model = build_model(info["arch"], in_channels=info["in_channels"], num_outputs=info["num_outputs"])
    except ModelError as exc:
        raise ModelFileError(f"{path}: refused: {what} cannot be built ({_first_line(exc)})") from exc
    problem = weights_problem(model.state_dict(), info["state_dict"])
    if problem:
        raise ModelFileError(f"{path}: refused: its weights do not fit {what}: {problem}")
    model.load_state_dict(info["state_dict"])
    return model.eval(), info
