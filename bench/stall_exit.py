"""From a stall to the job's exit: how long after its bound the watchdog ends a process (chexflow.watchdog).

Each run is a fresh process that arms the watchdog (``--floor`` seconds, factor 10), reads batches from a
persistent loader of 2 workers (chexflow's fork server), marks each one, then stops one worker (SIGSTOP)
and waits for the next batch: a stall. Measured from the last mark to the process's exit: the bound, the
time to exit, and the overshoot (exit - mark - bound: the watchdog's polling, every thread's stack, the
workers' stacks and their kill, the line). Medians of ``--runs``.

    .venv/bin/python bench/stall_exit.py [--floor 5] [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(floor: float) -> None:
    """In this process: the stall; prints the last mark's time (time.time) and then never returns."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from chexflow import watchdog
    from chexflow.data.workers import loader_processes

    watchdog.arm("bench", watchdog.WatchdogConfig(start_s=600, floor_s=floor, factor=10))
    loader = DataLoader(TensorDataset(torch.arange(10_000.0)), batch_size=1, num_workers=2, persistent_workers=True,
                        **loader_processes(2))
    it = iter(loader)
    for _ in range(20):
        next(it)
        watchdog.beat("training")
    os.kill(it._workers[it._task_info[it._rcvd_idx][0]].pid, signal.SIGSTOP)    # the worker of the next batch
    print(json.dumps({"mark": time.time(), "bound": watchdog._ACTIVE.bound()}), flush=True)
    next(it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floor", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one_run(args.floor)
        return
    rows = []
    for _ in range(args.runs):
        proc = subprocess.Popen([sys.executable, __file__, "--one", "--floor", str(args.floor)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "workflow")})
        first = json.loads(proc.stdout.readline())
        proc.wait(timeout=600)
        ended = time.time()
        assert proc.returncode == 14, proc.stderr.read()[-2000:]
        rows.append({"bound": first["bound"], "exit": ended - first["mark"],
                     "overshoot": ended - first["mark"] - first["bound"]})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"stall to exit (medians of {args.runs}): bound {med['bound']:.1f} s, exit after {med['exit']:.2f} s, "
          f"overshoot {med['overshoot']:.2f} s (max {max(r['overshoot'] for r in rows):.2f} s)")


if __name__ == "__main__":
    main()
