"""The training loop's policy of when to check, save and stop (chexflow.train.cadence): step numbers in,
decisions out. The loop below walks the cadence as Trainer.train_one_epoch and _fit do; the expected
steps are written out by hand from the settings."""
from __future__ import annotations

import signal

import pytest

from chexflow.settings import from_dict
from chexflow.train.cadence import Cadence, Decision
from chexflow.train.config import TrainConfig
from test_distributed import train_cfg


def cadence_of(spe: int = 20, **over) -> Cadence:
    return Cadence.of(from_dict(TrainConfig, train_cfg("single", **over)), steps_per_epoch=spe)


def walk(c: Cadence, *, epochs: int, arrivals: dict[int, int] | None = None,
         diverge_after: int | None = None, done: int = 0) -> dict[str, list]:
    """The loop over ``epochs`` epochs from ``done`` steps on. ``arrivals``: a signal arriving during step
    k (received until a check acts on it); ``diverge_after``: the loss is non-finite from that step on."""
    arrivals, received = arrivals or {}, 0
    seen: dict[str, list] = {"checks": [], "saves": [], "ends": [], "stop": []}
    step, epoch = done, done // c.steps_per_epoch
    while epoch < epochs and step < c.total_steps:
        in_epoch = step - epoch * c.steps_per_epoch
        while c.more(step, in_epoch):
            step, in_epoch = step + 1, in_epoch + 1
            received = max(received, arrivals.get(step, 0))
            if not c.check_due(step, in_epoch):
                continue
            seen["checks"].append(step)
            act = c.decide(step, in_epoch, signal_received=received,
                           diverged=diverge_after is not None and step >= diverge_after)
            if act.save:
                seen["saves"].append(step)
            if act.stop:
                seen["stop"] = [act.stop, step]
                return seen
            if received == signal.SIGUSR1:
                received = 0            # acted on: the trainer resets it and goes on
            if act.end:
                seen["ends"].append(step)
        seen["saves"].append(step)      # the end of the epoch (or of the run) validates and saves
        epoch += in_epoch == c.steps_per_epoch
    return seen


def test_every_7_steps_over_20_saves_at_7_14_and_the_end():
    c = cadence_of(epochs=1, check_every_steps=20, checkpoint={"every_steps": 7}, spe=20)
    assert (c.total_steps, c.every_steps, c.check_every_steps) == (20, 7, 20)
    seen = walk(c, epochs=1)
    assert seen["saves"] == [7, 14, 20]
    assert seen["checks"] == [1, 7, 14, 20]     # the first step, the checkpoints, the epoch's end
    assert seen["ends"] == [20] and seen["stop"] == []


def test_checks_every_n_steps_at_checkpoints_at_the_first_step_and_each_epoch_end():
    c = cadence_of(epochs=2, check_every_steps=5, checkpoint={"every_steps": 7}, spe=12)
    seen = walk(c, epochs=2)
    assert seen["checks"] == [1, 5, 7, 10, 12, 14, 15, 20, 21, 24]
    assert seen["saves"] == [7, 12, 14, 21, 24]
    assert seen["ends"] == [12, 24]


def test_no_periodic_checkpoint_saves_only_at_epoch_ends():
    c = cadence_of(epochs=3, check_every_steps=4, checkpoint={"every_steps": 0}, spe=6)
    assert walk(c, epochs=3)["saves"] == [6, 12, 18]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_agreed_at_step_k_saves_then_stops_at_k(sig):
    c = cadence_of(epochs=2, check_every_steps=3, checkpoint={"every_steps": 7}, spe=10)
    seen = walk(c, epochs=2, arrivals={8: sig})     # arrives during step 8, the next check is step 9
    assert seen["stop"] == ["signal", 9]
    assert seen["saves"] == [7, 9] and seen["checks"][-1] == 9
    assert c.decide(9, 9, signal_received=sig) == Decision(save=True, stop="signal")


def test_a_stop_signal_at_an_epochs_last_step_saves_in_the_loop_and_skips_the_epoch_end():
    c = cadence_of(epochs=2, check_every_steps=3, checkpoint={"every_steps": 0}, spe=10)
    seen = walk(c, epochs=2, arrivals={10: signal.SIGTERM})
    assert seen["stop"] == ["signal", 10] and seen["saves"] == [10] and seen["ends"] == []


def test_sigusr1_saves_and_goes_on_once_per_step():
    c = cadence_of(epochs=1, check_every_steps=3, checkpoint={"every_steps": 0}, spe=10)
    seen = walk(c, epochs=1, arrivals={5: signal.SIGUSR1, 10: signal.SIGUSR1})
    # saved at its check (6); at the epoch's last step only the end of the epoch writes the checkpoint
    assert seen["saves"] == [6, 10] and seen["stop"] == []
    assert c.decide(10, 10, signal_received=signal.SIGUSR1) == Decision(save=False, end=True)


def test_sigterm_after_sigusr1_still_stops():
    c = cadence_of(epochs=1, check_every_steps=4, checkpoint={"every_steps": 0}, spe=10)
    seen = walk(c, epochs=1, arrivals={2: signal.SIGUSR1, 3: signal.SIGTERM})
    assert seen["stop"] == ["signal", 4] and seen["saves"] == [4]


def test_divergence_stops_at_the_next_check_and_saves_nothing():
    c = cadence_of(epochs=1, check_every_steps=3, checkpoint={"every_steps": 2}, spe=10)
    seen = walk(c, epochs=1, diverge_after=5)
    assert seen["stop"] == ["diverged", 6] and seen["saves"] == [2, 4]
    # divergence wins over a periodic step, a signal and the epoch's end: no checkpoint of a diverged model
    assert c.decide(10, 10, signal_received=signal.SIGTERM, diverged=True) == Decision(stop="diverged")


def test_max_steps_stops_exactly_there_inside_an_epoch():
    c = cadence_of(epochs=3, max_steps=13, check_every_steps=20, checkpoint={"every_steps": 0}, spe=5)
    assert c.total_steps == 13
    seen = walk(c, epochs=3)
    assert seen["ends"] == [5, 10, 13] and seen["saves"] == [5, 10, 13]
    assert not c.more(13, 3) and c.more(12, 2)
    # a max_steps beyond the epochs changes nothing
    assert cadence_of(epochs=2, max_steps=99, spe=5).total_steps == 10


def test_a_resumed_run_checks_at_its_first_step():
    c = cadence_of(epochs=2, check_every_steps=5, checkpoint={"every_steps": 4}, spe=10)
    resumed = c.starting_at(6)          # the checkpoint of step 6 (a signal), resumed
    assert c.first_check_step == 1 and resumed.first_check_step == 7
    assert walk(resumed, epochs=2, done=6)["checks"] == [7, 8, 10, 12, 15, 16, 20]
    assert not c.check_due(7, 7) and resumed.check_due(7, 7)
