"""The one way into training: :func:`start` runs a training run and returns its :class:`Outcome`.

``chexflow train`` (a rank of the workflow's training jobs), the scaling study's ``scale-point``
(a rank at one world size) and the sweep's ``sweep-trial`` (one process starting its trial's ranks
through the launcher) all call it. The exit codes and the divergence marker are the trainer's
(``chexflow.train.trainer``, ``chexflow.train.epoch_report``); this module is the only one that reads them back.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from chexflow.fsutil import read_text_regular
from chexflow.settings import to_dict
from chexflow.train.backends import Backend, backend_for
from chexflow.train.config import TrainConfig
from chexflow.train.trainer import (DIVERGED_MARKER, EXIT_DIVERGED, EXIT_LEASE_HELD, EXIT_NO_VALID_EPOCH,
                                    EXIT_PREEMPTED, NoValidEpoch, Trainer, TrainPaths, _log)
from chexflow.train.identity import run_id
from chexflow.train.signals import STOP_SIGNALS

# exits of a launcher whose ranks were stopped from outside (preempted, killed, interrupted) or did
# not start because another trainer holds the checkpoint directory: no outcome of the run itself;
# a rerun resumes from the checkpoints
INTERRUPTED_EXITS = frozenset({EXIT_PREEMPTED, EXIT_LEASE_HELD, 128 + signal.SIGKILL, 128 + signal.SIGINT,
                               -signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT})


@dataclass(frozen=True)
class Outcome:
    """How a training run ended."""
    status: Literal["finished", "diverged", "no_valid_epoch", "interrupted", "crashed"]
    exit_code: int              # what the process that ran it exits with (0 only when finished)
    run_id: str                 # chexflow.train.identity.run_id (which checkpoints belong to this run); "" when
    #                             its manifest or starting weights could not be read
    model: Path | None          # model.pt, when finished
    detail: str = ""            # diverged: where; no_valid_epoch: why; interrupted / crashed: the signal or exit code
    log_tail: tuple[str, ...] = ()   # crashed under a launcher: the ranks' last output lines

    @property
    def finished(self) -> bool:
        return self.status == "finished"


def start(cfg: TrainConfig, paths: TrainPaths, *, backend: Backend | None = None,
          launcher: list[str] | None = None, ranks: int = 1) -> Outcome:
    """Run training as ``cfg`` says, on ``paths``; return how it ended.

    Without ``launcher`` this process is one rank of the run (started by ``chexflow launch`` or
    srun); ``backend``: an initialised backend to train on (the caller shuts it down), else the
    config's is initialised here and shut down at the end. With ``launcher`` (e.g.
    ``["chexflow", "launch"]`` or an srun line) this process starts ``ranks`` ranks of
    ``chexflow train`` through it and waits: SIGTERM/SIGUSR1/SIGINT are passed on to them, and a
    stop from outside ends as ``interrupted``, ranks that fail without a verdict as ``crashed``.
    """
    if launcher is not None:
        return _launch(cfg, paths, launcher, ranks)
    own = backend is None
    backend = backend_for(cfg) if own else backend
    try:
        trainer = Trainer(cfg, paths, backend)
        code = trainer.fit()
    except NoValidEpoch as exc:     # every rank holds the same history and stops here, without a traceback
        _log(backend, str(exc))
        return Outcome("no_valid_epoch", EXIT_NO_VALID_EPOCH, trainer.run_id, None, str(exc))
    finally:
        if own:
            backend.shutdown()
    if code == EXIT_DIVERGED:
        return Outcome("diverged", code, trainer.run_id, None, _divergence(paths.out_dir))
    if code == EXIT_PREEMPTED:
        return Outcome("interrupted", code, trainer.run_id, None, "stopped by a signal; checkpoint written")
    if code == EXIT_LEASE_HELD:
        return Outcome("interrupted", code, trainer.run_id, None, "another trainer holds the checkpoint directory")
    return Outcome("finished", 0, trainer.run_id, Path(paths.out_dir) / "model.pt")


def _divergence(out_dir: Path) -> str:
    marker = Path(out_dir) / DIVERGED_MARKER
    try:
        info = json.loads(read_text_regular(marker, what="divergence marker"))      # written by rank 0 only
    except (OSError, ValueError):
        return "non-finite training loss"
    return f"non-finite training loss at step {info.get('step')}"


def _launch(cfg: TrainConfig, paths: TrainPaths, launcher: list[str], ranks: int) -> Outcome:
    out_dir = Path(paths.out_dir)
    (out_dir / DIVERGED_MARKER).unlink(missing_ok=True)     # an earlier attempt's verdict is not this one's
    cmd = [*launcher, "-n", str(ranks), "chexflow", "train", "--config-json", json.dumps(to_dict(cfg)),
           "--manifest", str(paths.manifest), "--out-dir", str(out_dir), "--ckpt-dir", str(paths.ckpt_dir)]
    for flag, path in (("--pretrained", paths.pretrained), ("--tensorboard", paths.tensorboard)):
        if path is not None:
            cmd += [flag, str(path)]
    tail: collections.deque[str] = collections.deque(maxlen=15)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CHEXFLOW_BACKEND": cfg.backend})
    stopped: list[int] = []

    def forward(signum, _frame):        # the ranks checkpoint on these; SIGUSR1 does not stop them
        if signum != signal.SIGUSR1:
            stopped.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    try:        # after the ranks: what they could not read (a broken manifest) is their verdict, as "crashed"
        ident = run_id(cfg, paths.manifest, paths.pretrained)
    except (ValueError, OSError):
        ident = ""
    if stopped:
        return Outcome("interrupted", 128 + stopped[0], ident, None, f"{signal.Signals(stopped[0]).name} received")
    if (out_dir / DIVERGED_MARKER).is_file():     # (the launcher may pass on another code than the ranks')
        return Outcome("diverged", code, ident, None, _divergence(out_dir))
    if code == EXIT_NO_VALID_EPOCH:      # (when the launcher passes the ranks' code on)
        return Outcome("no_valid_epoch", code, ident, None, "no epoch validated with a finite metric", tuple(tail))
    if code in INTERRUPTED_EXITS:
        return Outcome("interrupted", code, ident, None, f"the ranks were stopped (exit code {code})")
    if code != 0:
        return Outcome("crashed", code, ident, None, f"exit code {code}", tuple(tail))
    return Outcome("finished", 0, ident, out_dir / "model.pt")
