"""A run's progress as a checkpoint records and a resume restores it (chexflow.train.progress)."""
from __future__ import annotations

import math

from chexflow.train.progress import STATE_KEYS, Progress


def test_a_checkpoints_state_restores_the_same_progress():
    row = {"epoch": 2, "step": 17, "val_metric": 0.6}
    prog = Progress(step=17, epoch=1, in_epoch=7, history=[{"epoch": 1, "step": 10}],
                    best={"metric": 0.5, "epoch": 1}, stopped=row)
    state = prog.state(partial={"loss_sum": 1.5, "n": 7})
    assert tuple(state) == STATE_KEYS
    assert state["stopped"] == row and state["step_in_epoch"] == 7
    back = Progress.from_state(state)
    assert back == Progress(step=17, epoch=1, in_epoch=7, history=[{"epoch": 1, "step": 10}],
                            best={"metric": 0.5, "epoch": 1}, partial={"loss_sum": 1.5, "n": 7}, stopped=row)
    # an old checkpoint without history or best starts them afresh
    empty = Progress.from_state({**state, "history": None, "best": None})
    assert empty.history == [] and empty.best == {"metric": -math.inf, "epoch": -1}


def test_a_max_steps_stop_row_belongs_to_its_step_only():
    prog = Progress(step=7, epoch=0, in_epoch=7, stopped={"step": 7, "val_metric": 0.4})
    assert prog.stopped_here() == {"step": 7, "val_metric": 0.4} and not prog.unvalidated()
    prog.step, prog.in_epoch = 9, 9           # training went on past the stop
    assert prog.stopped_here() is None and prog.state(None)["stopped"] is None
    assert prog.unvalidated()                 # steps of this epoch no validation has seen
    assert not Progress(step=20, epoch=2, in_epoch=0).unvalidated()


def test_remap_to_another_world_keeps_the_samples_done():
    # 4 ranks x 8 images x 6 steps = 192 samples of epoch 2 done; resumed by 3 ranks x 8 images = 24 per step
    prog = Progress(step=6 + 2 * 50, epoch=2, in_epoch=6, partial={"loss_sum": 3.0, "n": 6})
    prog.remap(samples_done=4 * 8 * 6, global_batch=3 * 8, steps_per_epoch=50)
    assert (prog.in_epoch, prog.step, prog.partial) == (8, 2 * 50 + 8, None)
    prog = Progress(step=5, epoch=0, in_epoch=5)
    prog.remap(samples_done=10_000, global_batch=8, steps_per_epoch=12)   # never past the epoch's end
    assert (prog.in_epoch, prog.step) == (12, 12)
