"""Loader worker processes: started by a fork server that runs no thread, and leaving the stop
signals to the process that started them.

**No worker is forked from a process that runs threads.** The trainer runs threads before its
loaders start workers (Horovod's background loop, the lease heartbeat, a loader's queue feeders
and pin-memory thread, tqdm's monitor, gloo/NCCL), and a child forked while another thread holds a
lock the child needs (CPython's thread-state lock in ``PyOS_AfterFork_Child``, an allocator's, a
module's own) waits for it forever: a fine-tuning job hung so at its first validation. Workers
are therefore forked by multiprocessing's fork server: one process started by fork+exec (nothing of
this process but its file descriptors crosses), which imports :data:`PRELOAD` once and runs a
single thread, so every worker forked from it starts with no lock held and torch already imported
(``bench/worker_start.py`` measures the cost against forking this process directly).

**Signals.** SLURM signals every process of a job step (a requeue, the time limit, ``scancel``):
the trainer and its DataLoader workers alike. A worker killed by SIGTERM takes the trainer down with
it (torch's SIGCHLD handler raises ``DataLoader worker (pid ...) is killed by signal: Terminated``)
before the trainer has written the checkpoint its handler promises. So a worker ignores SIGUSR1 and
SIGINT and leaves SIGTERM to the trainer: the trainer finishes its step, checkpoints and then stops
its workers the usual way (end-of-iteration message, join). A SIGTERM that the trainer itself sends
(the DataLoader terminating a worker that did not stop in time) still ends the worker. The fork
server is started with :data:`PARENT_SIGNALS` blocked and never unblocks them, so each worker starts
with them blocked until :func:`shield_worker` has set this up, and the server itself outlives a
SIGTERM until the trainer exits (it stops when its parent does).

**Stacks.** A worker dumps every thread's stack on :data:`STACK_SIGNAL` (``faulthandler``: it works in
a deadlocked process), which the stall watchdog (``chexflow.watchdog``) sends before it stops them.
"""
from __future__ import annotations

import faulthandler
import functools
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import re
import threading
from pathlib import Path

from chexflow.watchdog import STACK_SIGNAL

# the signals a worker leaves to its parent (the trainer catches exactly these)
PARENT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# imported once by the fork server: what a loader worker runs (torch, numpy, the shard reader)
PRELOAD = ["chexflow.data.loader"]


def _ensure_server() -> None:
    """The fork server running, started (the first time, or again should it have died) with
    PARENT_SIGNALS blocked: fork+exec keeps the calling thread's signal mask, the server never
    changes it, and its children inherit it."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _ShieldedForkServerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        _ensure_server()
        return multiprocessing.context.ForkServerProcess._Popen(process_obj)


class WorkerContext(multiprocessing.context.ForkServerContext):
    """The fork-server context whose processes start with PARENT_SIGNALS blocked."""
    Process = _ShieldedForkServerProcess


def loader_processes(workers: int) -> dict:
    """The DataLoader arguments that start ``workers`` processes this way (none for ``workers`` 0:
    the batches are then read in this process)."""
    if workers <= 0:
        return {}
    return dict(multiprocessing_context=WorkerContext(),
                worker_init_fn=functools.partial(shield_worker, trainer=os.getpid()))


def shield_worker(_worker_id: int | None = None, *, trainer: int | None = None) -> None:
    """``worker_init_fn``: SIGUSR1/SIGINT ignored, SIGTERM taken by a thread that ends the worker
    only when ``trainer`` (the process that made the loader; default: the parent) sent it, and every
    thread's stack dumped on STACK_SIGNAL. Runs in the worker's main thread (threads started later,
    such as the result queue's feeder, inherit the blocked SIGTERM)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    others = [s for s in PARENT_SIGNALS if s != signal.SIGTERM]
    for sig in others:
        signal.signal(sig, signal.SIG_IGN)        # a pending one is discarded here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, others)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what the trainer's SIGTERM does (main thread only)
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    sender = os.getppid() if trainer is None else trainer
    threading.Thread(target=_take_sigterm, args=(sender,), name="chexflow-sigterm", daemon=True).start()


def _take_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:       # die of it, as an unshielded worker would
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class LoaderWorkerDied(RuntimeError):
    """A loader worker ended without being asked to: killed by a signal (the kernel's OOM killer's
    is SIGKILL) or exited. torch says so in a RuntimeError with the worker's pid; this says it in one
    line (:func:`worker_death`)."""


_TORCH_DEATH = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: (.+?)\.?\s*$|exited "
                          r"unexpectedly)")


def worker_death(exc: BaseException) -> BaseException:
    """``exc`` as a :class:`LoaderWorkerDied` when it is torch's report of a dead loader worker, else
    ``exc`` itself."""
    found = _TORCH_DEATH.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if found is None:
        return exc
    pids, how = found.group(1).strip(" ,"), found.group(2)
    if how is None:
        return LoaderWorkerDied(f"loader worker pid {pids} exited unexpectedly (its own error, if any, is "
                                "printed above it in this log)")
    oom = _oom_kills()
    cause = (f"; the kernel's OOM killer ended {oom} process(es) of this job's cgroup: the job ran out of memory"
             if oom else "")
    return LoaderWorkerDied(f"loader worker pid {pids} was killed by signal {how}{cause}")


def _oom_kills() -> int:
    """The OOM kills counted in this process's cgroup (v2 ``memory.events``); 0 when unknown."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[-1].split(":", 2)[2]
        events = Path("/sys/fs/cgroup" + rel) / "memory.events"
        counts = dict(line.split() for line in events.read_text().splitlines())
        return int(counts.get("oom_kill", 0))
    except (OSError, IndexError, ValueError):
        return 0
