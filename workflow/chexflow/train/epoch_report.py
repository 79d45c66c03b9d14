"""What a training epoch tells as it runs: its progress bar, its TensorBoard scalars, its running loss
sums, and what a check acted on (a divergence, a signal) with the exit status of a stop."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from chexflow.fsutil import write_text_atomic
from chexflow.train.cadence import Decision
from chexflow.train.progress import Progress

EXIT_PREEMPTED = 143   # after SIGTERM: checkpoint written, non-zero so the retry resumes
EXIT_DIVERGED = 3      # the training loss became NaN/inf: no model is written (sweep trials record it)
DIVERGED_MARKER = "diverged.json"   # in the output directory, when the loss became NaN/inf (step, epoch)


class Scalars:
    """TensorBoard scalars of one stage, written by rank 0 when it has a folder for them."""

    def __init__(self, folder: Path | None, *, stage: str, root: bool):
        self.stage, self.writer = stage, None
        if root and folder is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return
            self.writer = SummaryWriter(log_dir=str(folder))

    def add(self, step: int, **values: float) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(f"{self.stage}/{name}", value, step)


def epoch_sums(prog: Progress, device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(loss sum, steps, any non-finite loss) of the epoch so far on the device (a resume's from its checkpoint)."""
    loss_sum, n_loss = torch.zeros((), device=device), 0
    if prog.in_epoch and prog.partial:
        loss_sum += prog.partial["loss_sum"]
        n_loss = prog.partial["n"]
    return loss_sum, n_loss, torch.zeros((), dtype=torch.bool, device=device)


def progress_bar(prog: Progress, steps_per_epoch: int, cfg, root: bool) -> tqdm:
    return tqdm(total=steps_per_epoch, initial=prog.in_epoch, disable=not root,
                desc=f"{cfg.stage} epoch {prog.epoch + 1}/{cfg.epochs}", mininterval=5, file=sys.stderr)


def acknowledge(act: Decision, sig: int, prog: Progress, *, log: Callable[[str], None], stage: str,
                out_dir: Path | None) -> int:
    """Say what a check found (the divergence marker in ``out_dir``, rank 0's; the signal acted on); the
    exit status of a stop, else 0."""
    if act.stop == "diverged":
        log(f"non-finite training loss by step {prog.step} (epoch {prog.epoch + 1}): diverged, no model written")
        if out_dir is not None:     # what a sweep trial records as its outcome
            write_text_atomic(out_dir / DIVERGED_MARKER,
                              json.dumps({"step": prog.step, "epoch": prog.epoch + 1, "stage": stage}))
        return EXIT_DIVERGED
    if not sig:
        return 0
    name = signal.Signals(sig).name
    if act.stop:
        log(f"{name} received: checkpoint written at step {prog.step}; exiting so a rerun resumes from it")
        return EXIT_PREEMPTED
    log(f"{name} received: checkpoint written at step {prog.step}; continuing")
    return 0
