"""Snakemake whose SLURM executor checks its jobs every few seconds: how the tests run it on the local cluster.

Usage: ``python tests/slurm_cluster/snakemake_polling.py <snakemake arguments>`` (what ``python -m snakemake``
takes). Everything is Snakemake's and snakemake-executor-plugin-slurm's own except the wait between two
status checks (``sacct``/``squeue``) and which of Snakemake's threads a SIGINT reaches (below).

Why: the plugin (2.8.0) waits ``slurm-init-seconds-before-status-checks`` after a check that saw a job end and
10 s more after every check that saw none, up to 180 s; the growth is hard-coded (``check_active_jobs``), a
policy that spares a production slurmdbd. On the test cluster ``sacct`` is local and costs milliseconds, and
the policy was about a third of the SLURM tests' wall time: the demo workflow spent 130 s of its 388 s between
a job's end and the next submission (slurmctld.log, session 38). Here every check comes
``CHEXFLOW_TEST_SLURM_POLL_S`` seconds (default 2) after the previous one. Users' runs (``snakemake
--profile profiles/slurm``) keep the plugin's policy; the tests' assertions never depend on the interval.

And SIGINT (a test's Ctrl-C) is blocked in every thread but the main one, so the kernel delivers it there. Sent to
the process, it may land on any thread that does not block it; Python runs its handler only in the main thread,
which, blocked in the scheduler's wait with no job left to wake it (a cancelled job), never saw it: Snakemake
waited forever (a full run on 2026-12-07; it ended at once when SIGINT was sent to its main thread alone). A
thread inherits the mask of the thread that creates it: SIGINT is blocked before the imports (importing the
plugin starts a native thread) and in every ``threading.Thread.start``, and unblocked in the main thread only.
"""
from __future__ import annotations

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})     # before any import can start a thread

import asyncio  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402

import snakemake_executor_plugin_slurm as slurm_plugin  # noqa: E402

POLL_S = float(os.environ.get("CHEXFLOW_TEST_SLURM_POLL_S", "2"))


async def _fixed_sleep(self) -> None:
    await asyncio.sleep(POLL_S)


slurm_plugin.Executor.sleep = _fixed_sleep       # RemoteExecutor.sleep: the wait between two checks
_thread_start = threading.Thread.start


def _start_without_sigint(self) -> None:
    """A new thread inherits the signal mask of the thread that starts it, whatever its run()."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        _thread_start(self)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


threading.Thread.start = _start_without_sigint

if __name__ == "__main__":
    from snakemake.cli import main

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    main()
