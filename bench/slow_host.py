"""Run a command on this machine slowed down, as on a slower host of the same kind: busy loops beside it.

    python bench/slow_host.py --hogs 3 -- bash .ci/run
    python bench/slow_host.py --hogs 3 -- python bench/suite_processes.py --log procs.jsonl -- bash .ci/run

Each hog is a process that spins at the command's own priority, so the kernel shares the cores evenly
between the hogs and whatever the command runs: a process of the command gets 2/(n + hogs) of a core on 2
cores while n of its processes want one. On a 2-core host with three hogs that is 2.1 times slower for a
C++ build (Horovod's wheel: 6.3 minutes against 3.0 alone) and for a one-thread training step, and worse
for two threads that must meet at every operation (a hog holds one of them up). What it does not slow:
the disk, the network, a wait on SLURM's timers, i.e. what a slower CPU does not slow either.

The speed figure (`bench/machine_speed.py`) printed inside the command measures the slowed machine. A
same-work yardstick between hosts is Horovod's wheel build (`envs/setup.sh` on a fresh machine prints its
minutes): compare it with the host to stand in for. The hogs stop when the command ends, or is interrupted,
and the command's exit status is this script's.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

HOG_TAG = "chexflow-slow-host-hog"      # in each hog's arguments: `pgrep -f` finds them


def start_hogs(n: int, timeout: float = 30.0) -> list[subprocess.Popen]:
    """``n`` busy loops, each its own process group, with the tag in their arguments; returns once each runs.

    ``Popen`` returns when the child's exec began, before the kernel has set up its arguments: a command
    started at once could look in ``/proc`` and miss a hog (seen in CI, on a loaded machine). So each hog's
    ``/proc/<pid>/cmdline`` is waited for (where there is a ``/proc``)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass", HOG_TAG], stdin=subprocess.DEVNULL,
                             start_new_session=True) for _ in range(n)]
    deadline = time.monotonic() + timeout
    for hog in hogs:
        while os.path.isdir("/proc") and not _shows_tag(hog.pid):
            if hog.poll() is not None or time.monotonic() > deadline:
                status = hog.poll()
                stop_hogs(hogs)
                raise RuntimeError(f"slow_host: busy loop {hog.pid} did not start in {timeout:g} s "
                                   f"(exit status {status})")
            time.sleep(0.01)
    return hogs


def _shows_tag(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")[-2:-1] == [HOG_TAG.encode()]
    except OSError:
        return False


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        if hog.poll() is None:
            hog.kill()
    for hog in hogs:
        hog.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=3, help="busy loops beside the command (default 3)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --")
    if args.hogs < 0:
        parser.error(f"--hogs {args.hogs}: a number of busy loops, 0 or more")
    hogs = start_hogs(args.hogs)
    print(f"slow_host: {args.hogs} busy loop(s) beside `{' '.join(command)}` on {os.cpu_count()} core(s)",
          file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(command)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            return proc.wait()
    finally:
        stop_hogs(hogs)


if __name__ == "__main__":
    sys.exit(main())
