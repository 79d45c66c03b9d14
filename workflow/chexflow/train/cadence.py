"""When the training loop checks, saves and stops: a pure function of the step and what the ranks agreed.

A *check* is the host-side sync of the stop conditions: every rank waits for its device and one small
allreduce agrees on (signal received, loss non-finite), so that all ranks act at the same step. It
happens every ``check_every_steps`` steps, at every periodic checkpoint (``checkpoint.every_steps``),
at the last step of an epoch or of the run (``max_steps``), and at the first step a run takes (a
signal received before training began is honoured there). At a check, in this order:

- a non-finite loss stops the run, nothing saved (no checkpoint of a diverged model);
- SIGTERM/SIGINT: save this step, then stop so that a rerun resumes from it;
- SIGUSR1: save this step and go on;
- a periodic step: save;
- the last step of an epoch (or of the run) ends the loop: the trainer validates and saves there,
  so the loop itself does not save that step (one checkpoint per step) unless it stops.
"""
from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass
from typing import Literal

from chexflow.train.config import TrainConfig


@dataclass(frozen=True)
class Decision:
    """What the loop does after a check."""
    save: bool = False      # write the checkpoint of this step now
    stop: Literal["diverged", "signal"] | None = None   # every rank leaves the loop (after the save)
    end: bool = False       # the loop ends at this step: the epoch's validation and checkpoint follow


@dataclass(frozen=True)
class Cadence:
    steps_per_epoch: int
    total_steps: int              # epochs x steps_per_epoch, capped by max_steps
    every_steps: int = 0          # checkpoint.every_steps (0: no periodic checkpoint)
    check_every_steps: int = 1
    first_check_step: int = 1     # the first step this run takes (after a resume: the checkpoint's + 1)

    @classmethod
    def of(cls, cfg: TrainConfig, steps_per_epoch: int) -> Cadence:
        total = cfg.epochs * steps_per_epoch
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        return cls(steps_per_epoch=steps_per_epoch, total_steps=total, every_steps=cfg.checkpoint.every_steps,
                   check_every_steps=cfg.check_every_steps)

    def starting_at(self, step: int) -> Cadence:
        """The cadence of a run whose first step is ``step + 1`` (``step`` steps done before)."""
        return dataclasses.replace(self, first_check_step=step + 1)

    def more(self, step: int, in_epoch: int) -> bool:
        """Whether the epoch has a step left to take (``step`` steps done, ``in_epoch`` of them in it)."""
        return in_epoch < self.steps_per_epoch and step < self.total_steps

    def periodic(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def last(self, step: int, in_epoch: int) -> bool:
        """``step`` is the last of its epoch or of the run."""
        return in_epoch == self.steps_per_epoch or step == self.total_steps

    def check_due(self, step: int, in_epoch: int) -> bool:
        """Whether the ranks agree on signals and divergence after step ``step``."""
        return (self.periodic(step) or self.last(step, in_epoch) or step == self.first_check_step
                or step % max(self.check_every_steps, 1) == 0)

    def decide(self, step: int, in_epoch: int, *, signal_received: int = 0, diverged: bool = False) -> Decision:
        """At a check after step ``step``: what the ranks agreed (the strongest signal, any non-finite loss)."""
        last = self.last(step, in_epoch)
        if diverged:
            return Decision(stop="diverged")
        if signal_received and signal_received != signal.SIGUSR1:
            return Decision(save=True, stop="signal")
        # at the epoch's last step the trainer's end of epoch writes the checkpoint
        return Decision(save=(bool(signal_received) or self.periodic(step)) and not last, end=last)
