"""Where a training run stands: what a checkpoint records and a resume restores."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# the fields of a checkpoint that hold a run's progress (beside its weights, optimizer and LR schedule)
STATE_KEYS = ("step", "epoch", "step_in_epoch", "history", "best", "partial", "stopped")


@dataclass
class Progress:
    step: int = 0               # optimizer steps taken
    epoch: int = 0              # completed epochs
    in_epoch: int = 0           # optimizer steps taken in the current epoch
    history: list = field(default_factory=list)
    best: dict = field(default_factory=lambda: {"metric": -math.inf, "epoch": -1})
    partial: dict | None = None  # resumed mid-epoch: that epoch's training loss so far
    # stopped by max_steps inside an epoch: the validation row of the model at that step (kept out of
    # `history` and `best`, so that a resume continues the epoch exactly as an uninterrupted run)
    stopped: dict | None = None

    @classmethod
    def from_state(cls, state: dict) -> Progress:
        """The progress a checkpoint recorded (``state``: its STATE_KEYS)."""
        return cls(step=state["step"], epoch=state["epoch"], in_epoch=state["step_in_epoch"],
                   history=list(state["history"] or []), best=state["best"] or cls().best,
                   partial=state["partial"], stopped=state["stopped"])

    def state(self, partial: dict | None) -> dict:
        """What a checkpoint of this step records (``partial``: the epoch's training loss so far, if mid-epoch)."""
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.in_epoch, "history": self.history,
                "best": self.best, "partial": partial, "stopped": self.stopped_here()}

    def stopped_here(self) -> dict | None:
        """The validation row of a max_steps stop at the current step (None once training went on)."""
        return self.stopped if (self.stopped or {}).get("step") == self.step else None

    def unvalidated(self) -> bool:
        """Steps taken in the current epoch that no validation has seen: a checkpoint written at the
        run's last step on a signal, resumed (the loop has no step left; it still has to validate)."""
        return self.in_epoch > 0 and self.stopped_here() is None

    def remap(self, *, samples_done: int, global_batch: int, steps_per_epoch: int) -> None:
        """Continue the current epoch after ``samples_done`` of its samples, in steps of ``global_batch``
        (a checkpoint resumed by another number of ranks: the epoch's loss so far is dropped)."""
        self.in_epoch = min(samples_done // global_batch, steps_per_epoch)
        self.step = self.epoch * steps_per_epoch + self.in_epoch
        self.partial = None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def progress_problem(state: dict) -> str | None:
    """Why a checkpoint's progress (``state``: history, best, partial epoch, max_steps stop, world size)
    is not what :meth:`Progress.from_state` can restore, by shape; or None."""
    history = state.get("history", [])
    if not isinstance(history, list) or not all(isinstance(r, dict) and _is_number(r.get("val_metric"))
                                                for r in history):
        return "its 'history' is not a list of validated epochs"
    best = state.get("best", {"metric": 0.0, "epoch": -1})
    if not isinstance(best, dict) or not _is_number(best.get("metric")) or not isinstance(best.get("epoch"), int):
        return "its 'best' entry is not {metric, epoch}"
    partial = state.get("partial")
    if partial is not None and not (isinstance(partial, dict) and _is_number(partial.get("loss_sum"))
                                    and isinstance(partial.get("n"), int)):
        return "its 'partial' entry is not {loss_sum, n}"
    stopped = state.get("stopped")
    if stopped is not None and not (isinstance(stopped, dict) and isinstance(stopped.get("step"), int)
                                    and _is_number(stopped.get("val_metric"))):
        return "its 'stopped' entry is not a validation row"
    world = state.get("world_size")
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        return f"world_size is {world!r}"
    return None
