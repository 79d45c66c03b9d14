"""Snakemake whose SLURM executor checks its jobs every few seconds: how the tests run it on the local cluster.

Usage: ``python tests/slurm_cluster/snakemake_polling.py <snakemake arguments>`` (what ``python -m snakemake``
takes). Everything is Snakemake's and snakemake-executor-plugin-slurm's own except the wait between two
status checks (``sacct``/``squeue``).

Why: the plugin (2.8.0) waits ``slurm-init-seconds-before-status-checks`` after a check that saw a job end and
10 s more after every check that saw none, up to 180 s; the growth is hard-coded (``check_active_jobs``), a
policy that spares a production slurmdbd. On the test cluster ``sacct`` is local and costs milliseconds, and
the policy was about a third of the SLURM tests' wall time: the demo workflow spent 130 s of its 388 s between
a job's end and the next submission (slurmctld.log, session 38). Here every check comes
``CHEXFLOW_TEST_SLURM_POLL_S`` seconds (default 2) after the previous one. Users' runs (``snakemake
--profile profiles/slurm``) keep the plugin's policy; the tests' assertions never depend on the interval.
"""
from __future__ import annotations

import asyncio
import os

import snakemake_executor_plugin_slurm as slurm_plugin

POLL_S = float(os.environ.get("CHEXFLOW_TEST_SLURM_POLL_S", "2"))


async def _fixed_sleep(self) -> None:
    await asyncio.sleep(POLL_S)


slurm_plugin.Executor.sleep = _fixed_sleep       # RemoteExecutor.sleep: the wait between two checks

if __name__ == "__main__":
    from snakemake.cli import main

    main()
