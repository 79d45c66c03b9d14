"""The stop requests of a training process (SIGTERM, SIGUSR1, SIGINT), caught from its first moment.

``chexflow train`` installs the catcher before it imports torch (seconds): SLURM may send its
warning signal (``--signal=USR1@300``) at once when the time limit is shorter than the warning, and
a rank without a handler dies of it. What arrives before training starts is remembered and acted on
at the first step (the trainer checks at the first step of every run): SIGUSR1 writes a checkpoint
and training goes on; SIGTERM/SIGINT write a checkpoint and end the run for the retry to resume.
Loader workers leave these signals to the trainer (chexflow.data.workers).
"""
from __future__ import annotations

import signal

from chexflow.data.workers import PARENT_SIGNALS

STOP_SIGNALS = PARENT_SIGNALS


class Signals:
    """Remembers the strongest stop request: SIGTERM over SIGINT (both end the run) over SIGUSR1
    (checkpoint and go on), so a warning never hides a later request to stop."""

    def __init__(self) -> None:
        self.received = 0
        self.ensure_installed()

    def ensure_installed(self) -> None:
        """(Again) the handler of every stop signal: a caller may have put its own back meanwhile."""
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) != self._handle:
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.received in (0, signal.SIGUSR1) or signum == signal.SIGTERM:
            self.received = int(signum)


_CATCHER: Signals | None = None


def install() -> Signals:
    """The process's one catcher (installed on the first call; later calls return the same one, with
    what it received so far, its handlers put back if something replaced them)."""
    global _CATCHER
    if _CATCHER is None:
        _CATCHER = Signals()
    else:
        _CATCHER.ensure_installed()
    return _CATCHER
