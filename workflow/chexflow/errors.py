"""How a chexflow command refuses: one line on stderr and a documented exit code (docs/errors.md: the
line, ``--debug``, the codes).

Every exception class chexflow raises for a problem with what it was given (a setting, a file, a
download, the machine) is in :data:`REFUSALS`, by its name (the package's class names are unique:
a test checks), with its exit code and what to do; a subclass that is not listed takes its nearest
listed base's entry. ``chexflow.cli.main`` hands one to :func:`refuse`; any other exception is a bug
and keeps its traceback. Under ``chexflow launch`` each rank also leaves its status for the launch to
exit with (:func:`record_exit`).

The table holds names, not classes: nothing is imported to build it (the command line stays fast)
and it sits at the bottom of the layers. Tests keep it and docs/errors.md in step with the package's
exception classes.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from chexflow.fsutil import read_text_regular, write_text_atomic

DEBUG_ENV = "CHEXFLOW_DEBUG"
# set by `chexflow launch` for its ranks: a folder where each rank's chexflow leaves its exit status
# and refusal, since horovodrun and torchrun exit 1 whatever their ranks exited with
RANK_STATUS_ENV = "CHEXFLOW_RANK_STATUS_DIR"


@dataclass(frozen=True)
class Refusal:
    code: int       # the exit status
    todo: str       # what to do, shown in parentheses after the message


# exit status -> what it means (docs/errors.md has the same table). 3, 4, 5 and 143 are training's
# own ends, owned by chexflow.train.trainer and chexflow.train.lease (docs/training.md)
CODES: dict[int, str] = {
    1: "an unexpected error (a bug): the traceback is printed",
    2: "a setting or a command-line argument is wrong",
    6: "a model or checkpoint file is refused",
    7: "input data is refused: a manifest, shard, archive, label table, image or study record",
    8: "a download failed, or the mirror lacks the file",
    9: "a file is not the pinned one (checksum or size)",
    10: "not enough free disk space",
    11: "a file could not be read or written (the operating system's reason)",
    12: "an exported model disagrees with torch",
    13: "the ranks' launch environment does not fit the training backend",
    14: "a process stalled: the watchdog ended the job (the retry resumes from the last checkpoint)",
    15: "a loader worker ended unasked: killed by a signal (the OOM killer's too) or exited",
}
# the trainer's verdicts: chexflow.train turns them into its own exit statuses (no valid epoch, the
# checkpoint directory held) before they could reach a command's end; one that did would be a bug
TRAINER_VERDICTS = ("NoValidEpoch", "LeaseHeld")

_CONFIG = "fix the setting named: config.yaml's comments say what is allowed"
_REWRITE = "snakemake writes it again: delete it, if present, and run snakemake"
_DATA = "fix or replace the file named, then run snakemake again"

REFUSALS: dict[str, Refusal] = {
    # settings and the command line
    "ConfigError": Refusal(2, _CONFIG),
    "ProfileError": Refusal(2, "fix the profile named, profiles/*/profile.yaml"),
    "UnknownSourceError": Refusal(2, "use one of the datasets listed"),
    "UnknownFileError": Refusal(2, "use one of the files listed"),
    "NoURLError": Refusal(2, "set datasets.<name>.mirror to where the file is"),
    "RegistryOverrideError": Refusal(2, "fix the test registry file, or unset CHEXFLOW_TEST_REGISTRY"),
    "ReleaseError": Refusal(2, "fix the demo release's settings"),
    # model and checkpoint files
    "RefusedFile": Refusal(6, _REWRITE),
    "ResumeError": Refusal(6, "resume with the settings the checkpoint was written with, or delete the run's "
                              "checkpoints to start afresh"),
    "ModelError": Refusal(6, "use weights of the model.arch configured"),
    "SaliencyError": Refusal(6, "the model's scores or gradients are not finite: check the model file"),
    "InitFileError": Refusal(6, "give init_file a torchvision-format state dict of the model.arch configured"),
    # input data
    "ManifestError": Refusal(7, _REWRITE),
    "ShardReadError": Refusal(7, _REWRITE),
    "ShardError": Refusal(7, _DATA),
    "ArchiveError": Refusal(7, _REWRITE),
    "NIHError": Refusal(7, _DATA),
    "TableError": Refusal(7, "fix the row named in the table, or the dataset's columns in config.yaml"),
    "ExternalInputError": Refusal(7, _REWRITE),
    "IdxError": Refusal(7, _REWRITE),
    "ImageNetError": Refusal(7, _DATA),
    "DecodeError": Refusal(7, "replace the image named"),
    "UnsupportedVOILUT": Refusal(7, "export the image without its VOI LUT, or with a window"),
    "SubgroupError": Refusal(7, _DATA),
    "PredictInputError": Refusal(7, "pass the manifest and metrics.json the model was evaluated with"),
    "NoInputsError": Refusal(7, "name existing image files, folders or .txt lists"),
    "ReportInputError": Refusal(7, _REWRITE),
    "MetricsRecordError": Refusal(7, _REWRITE),
    "PredictionsRecordError": Refusal(7, _REWRITE),
    "EpochsRecordError": Refusal(7, _REWRITE),
    "ComparisonRecordError": Refusal(7, _REWRITE),
    "ComparisonInputError": Refusal(7, _REWRITE),
    "ModelFileInputError": Refusal(7, _REWRITE),
    "ScalingError": Refusal(7, _REWRITE),
    "SweepRecordError": Refusal(7, _REWRITE),
    # downloads
    "DownloadError": Refusal(8, "check the mirror or the network, then run snakemake again: a partial download "
                                "resumes"),
    "NotFoundError": Refusal(8, "put the file in the mirror, datasets.<name>.mirror, or fix the mirror's address"),
    "TruncatedDownload": Refusal(8, "run snakemake again: the download resumes"),
    "ChecksumMismatch": Refusal(9, "the mirror's copy is not the published file: replace it there"),
    "InsufficientSpace": Refusal(10, "free space there, or point data/ elsewhere"),
    # the machine
    "OSError": Refusal(11, "check the path and its permissions"),
    "WriteError": Refusal(11, "free space or fix the directory, then run snakemake again: training resumes"),
    "ExportMismatchError": Refusal(12, "report it with the model file and the versions of torch and onnxruntime"),
    "DistributedError": Refusal(13, "start the ranks with chexflow launch or srun, or set training.backend"),
    # the job's processes
    "Stalled": Refusal(14, "a stall: the job exits 14 so that the cluster's retry resumes it from its last "
                           "checkpoint; the bound is config.yaml's watchdog section, docs/cluster.md"),
    "LoaderWorkerDied": Refusal(15, "run snakemake again: training resumes from its last checkpoint; if memory "
                                    "ran out, lower data.workers or raise the rule's mem_mb"),
}


def refusal_of(exc: BaseException | type) -> Refusal | None:
    """The entry of ``exc``'s class (or of that class) or of its nearest listed base, a class of the
    package or Python's own; None: not a refusal (a bug)."""
    for cls in (exc if isinstance(exc, type) else type(exc)).__mro__:
        ours = cls.__module__ == "builtins" or cls.__module__.startswith("chexflow.")
        if ours and cls.__name__ in REFUSALS:
            return REFUSALS[cls.__name__]
    return None


def debug_requested(flag: bool = False) -> bool:
    """``--debug``, or ``CHEXFLOW_DEBUG`` set to anything but empty or 0."""
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def refusal_lines(command: str, exc: BaseException, refusal: Refusal) -> list[str]:
    """``chexflow <command>: <message> (<what to do>)``: one line, or one per problem of a
    configuration error."""
    todo = f" ({refusal.todo})" if refusal.todo else ""
    problems = getattr(exc, "problems", None)
    messages = [str(p) for p in problems] if isinstance(problems, list) and problems else [message(exc)]
    return [f"chexflow {command}: {_one_line(m)}{todo}" for m in messages]


def message(exc: BaseException) -> str:
    """What ``exc`` says, without Python's decorations: ``<file>: <reason>`` for an OS error, the
    text of a KeyError without quotes, the original message of an exception that torch's
    DataLoader re-raised from a worker (not the worker's traceback)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        return str(exc.args[0])
    text = str(exc)
    if "Original Traceback (most recent call last):" in text:
        cls = type(exc)
        text = text.rsplit(f"{cls.__module__}.{cls.__qualname__}: ", 1)[-1]
    return text


def _one_line(text: str) -> str:
    return " ".join(text.split())


def record_exit(code: object, lines: list[str] | None = None) -> None:
    """Under ``chexflow launch`` (RANK_STATUS_ENV set): leave this process's non-zero exit status and
    refusal lines for the launcher, one file per process; elsewhere nothing."""
    where = os.environ.get(RANK_STATUS_ENV)
    if not where or not isinstance(code, int) or code == 0:
        return
    try:
        write_text_atomic(Path(where) / f"{os.getpid()}.json", json.dumps({"code": code, "lines": lines or []}))
    except OSError:
        pass        # the launcher's own status then stands


def first_recorded_exit(where: Path | str) -> tuple[int, list[str]] | None:
    """The exit status and refusal lines of the first rank that recorded one in ``where``."""
    found = []
    for entry in os.scandir(where):
        if entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
            try:
                record = json.loads(read_text_regular(entry.path, follow_symlinks=False, what="rank status"))
                found.append((entry.stat().st_mtime_ns, int(record["code"]), [str(x) for x in record["lines"]]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return min(found)[1:] if found else None


def refuse(command: str, exc: Exception, *, debug: bool) -> NoReturn:
    """Exit as :data:`REFUSALS` says for ``exc`` (with ``debug``: its traceback first); re-raise a bug."""
    refusal = refusal_of(exc)
    if refusal is None:
        raise exc
    if debug:
        traceback.print_exception(exc)
    lines = refusal_lines(command, exc, refusal)
    print("\n".join(lines), file=sys.stderr)
    record_exit(refusal.code, lines)
    sys.exit(refusal.code)
