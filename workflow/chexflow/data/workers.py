"""Loader worker processes that leave the stop signals to the process that started them.

SLURM signals every process of a job step (a requeue, the time limit, `scancel`): the trainer and
its DataLoader workers alike. A worker killed by SIGTERM takes the trainer down with it (torch's
SIGCHLD handler raises ``DataLoader worker (pid ...) is killed by signal: Terminated``) before the
trainer has written the checkpoint its handler promises. So a worker ignores SIGUSR1 and SIGINT
and leaves SIGTERM to its parent: the trainer finishes its step, checkpoints and then stops its
workers the usual way (end-of-iteration message, join). A SIGTERM that the parent itself sends (the
DataLoader terminating a worker that did not stop in time) still ends the worker.

The signals are blocked from before the fork until the worker has set this up, so a signal that
arrives while a worker starts is never delivered to torch's own handlers.
"""
from __future__ import annotations

import multiprocessing.context
import os
import signal
import threading

# the signals a worker leaves to its parent (the trainer catches exactly these)
PARENT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class _ShieldedForkProcess(multiprocessing.context.ForkProcess):
    @staticmethod
    def _Popen(process_obj):
        # the child inherits this mask; only the calling thread of the parent blocks, briefly
        old = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
        try:
            return multiprocessing.context.ForkProcess._Popen(process_obj)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class ShieldedForkContext(multiprocessing.context.ForkContext):
    """The fork context (torch's default on Linux) whose processes start with PARENT_SIGNALS blocked."""
    Process = _ShieldedForkProcess


def shield_worker(_worker_id: int | None = None) -> None:
    """``worker_init_fn``: SIGUSR1/SIGINT ignored, SIGTERM taken by a thread that ends the worker
    only when the parent sent it. Runs in the worker's main thread (threads started later, such
    as the result queue's feeder, inherit the blocked SIGTERM)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    others = [s for s in PARENT_SIGNALS if s != signal.SIGTERM]
    for sig in others:
        signal.signal(sig, signal.SIG_IGN)        # a pending one is discarded here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, others)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what the parent's SIGTERM does (main thread only)
    threading.Thread(target=_take_sigterm, args=(os.getppid(),), name="chexflow-sigterm", daemon=True).start()


def _take_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:       # die of it, as an unshielded worker would
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
