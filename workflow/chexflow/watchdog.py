"""The stall watchdog: a job whose process stops making progress ends within a bound, with one line.

docs/cluster.md ("Stalls") says what a user sees: the bound, the stacks and the line, the exit, the
retry. A long-running command marks its progress with :func:`beat`; a thread of the process compares
the time since the last mark with :meth:`Watchdog.bound` and, past it, :meth:`Watchdog.fire` ends the
process. Not covered: a deadlock that holds the interpreter's lock, which no Python thread outlives.
Ground floor: imports nothing of chexflow but the refusals' table and settings.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from chexflow import errors
from chexflow.settings import ConfigError, from_dict, setting

ENV = "CHEXFLOW_WATCHDOG"          # the watchdog section of config.yaml, as JSON (set by rules/common.smk)
EXIT_STALLED = errors.REFUSALS["Stalled"].code
# a wake-up of the watchdog's thread this much later than due: the process was stopped meanwhile (SLURM
# suspends a job with SIGSTOP), and that time is not counted as time without progress
SUSPENDED_S = 5.0
# asks a loader worker for every thread's stack (chexflow.data.workers registers it: faulthandler)
STACK_SIGNAL = signal.SIGUSR2


class Stalled(Exception):
    """A job made no progress within its bound (the refusals' table entry of :func:`Watchdog.fire`,
    which exits from the watchdog's thread: the main thread, stalled, cannot raise)."""


@dataclass(frozen=True)
class WatchdogConfig:
    """How long a job may make no progress before it is ended (docs/cluster.md, "Stalls")."""
    enabled: bool = True
    # until a job's first progress mark (start-up: imports, rendezvous, staging, the first batch)
    start_s: float = setting(1800.0, gt=0)
    # after it: the bound is never below floor_s ...
    floor_s: float = setting(300.0, gt=0)
    # ... and is factor x the longest gap between two marks seen (a step, a validation pass's batch)
    factor: float = setting(10.0, ge=1)


def config_from_env(environ=os.environ) -> WatchdogConfig:
    """The settings handed to this job (:data:`ENV`), checked; the defaults when unset."""
    text = environ.get(ENV, "")
    if not text:
        return WatchdogConfig()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{ENV}: not JSON ({exc})") from None
    return from_dict(WatchdogConfig, data, "watchdog")


class Watchdog:
    """One per process (:func:`arm`); :func:`beat` marks progress."""

    def __init__(self, cfg: WatchdogConfig, *, command: str, stream=None, clock=time.monotonic):
        self.cfg, self.command, self.clock = cfg, command, clock
        self.stream = stream if stream is not None else sys.stderr
        self.who = f"pid {os.getpid()}"
        self.phase, self.marks = "start-up", 0
        self.last = clock()
        self.slowest = 0.0
        self.unpaced = False        # past its last paced mark (evaluation's statistics): start_s bounds it
        self._stop = threading.Event()

    # ------------------------------------------------------------------ marks
    def beat(self, phase: str) -> None:
        now = self.clock()
        if self.marks and not self.unpaced:
            self.slowest = max(self.slowest, now - self.last)
        self.last, self.phase, self.marks = now, phase, self.marks + 1

    def unpace(self, phase: str) -> None:
        """From here on the process marks no pace of its own (a computation after its last batch whose
        length no earlier gap predicts): the bound is start_s again, and no gap counts as a step's."""
        self.beat(phase)
        self.unpaced = True

    def bound(self) -> float:
        if not self.marks or self.unpaced:
            return self.cfg.start_s
        return max(self.cfg.floor_s, self.cfg.factor * self.slowest)

    def why_bound(self) -> str:
        if not self.marks:
            return f"start_s {self.cfg.start_s:g} s before the first progress"
        if self.unpaced:
            return f"start_s {self.cfg.start_s:g} s in {self.phase}, which marks no pace"
        return (f"max(floor_s {self.cfg.floor_s:g} s, factor {self.cfg.factor:g} x the slowest gap "
                f"{self.slowest:.2f} s)")

    def stalled_for(self) -> float | None:
        """Seconds without progress when past the bound, else None."""
        idle = self.clock() - self.last
        return idle if idle > self.bound() else None

    # ------------------------------------------------------------------ the thread
    def start(self) -> "Watchdog":
        threading.Thread(target=self._watch, name="chexflow-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        awake = self.clock()
        while not self._stop.wait(interval := min(1.0, self.bound() / 20)):
            now = self.clock()
            asleep = now - awake - interval
            if asleep > SUSPENDED_S:     # the process was stopped (SIGSTOP, `scontrol suspend`): not a stall
                self.last += asleep
            awake = now
            idle = self.stalled_for()
            if idle is not None:
                self.fire(idle)

    def fire(self, idle: float) -> None:
        """Stacks, the workers' stacks, the workers stopped, one line, exit EXIT_STALLED."""
        waiting = waiting_for(threading.main_thread())
        line = (f"chexflow {self.command}: {self.who}: no progress for {idle:.0f} s in {self.phase} (bound "
                f"{self.bound():.0f} s: {self.why_bound()}){f': {waiting}' if waiting else ''} (stacks above) "
                f"({errors.REFUSALS['Stalled'].todo})")
        try:
            print(f"chexflow watchdog: {self.who}: every thread's stack, then the loader workers':",
                  file=self.stream, flush=True)
            faulthandler.dump_traceback(file=self.stream, all_threads=True)
            stop_children()
            print(line, file=self.stream, flush=True)
            errors.record_exit(EXIT_STALLED, [line])
        finally:
            os._exit(EXIT_STALLED)


# where a main thread waits for other ranks, most telling first: chexflow's backend call, Horovod's or
# torch.distributed's, then DDP's gradient all-reduce inside the backward pass
COLLECTIVE_CODE = ("/chexflow/train/backends/", "/horovod/torch/", "/torch/distributed/", "/torch/autograd/")


def waiting_for(thread: threading.Thread) -> str:
    """What ``thread`` waits for, from its stack: a DataLoader's worker (its pid), a collective, or
    else its innermost frame of chexflow."""
    frame, stack = sys._current_frames().get(thread.ident), []
    while frame is not None:
        stack.append((frame, frame.f_code.co_filename.replace(os.sep, "/")))
        frame = frame.f_back
    for frame, _ in stack:
        if frame.f_code.co_name in ("_next_data", "_get_data"):
            worker = _awaited_worker(frame.f_locals.get("self"))
            if worker:
                return worker
    for part in COLLECTIVE_CODE:
        if part == "/torch/autograd/" and not _distributed():
            continue
        for frame, path in stack:
            if part in path:
                return f"collective {frame.f_code.co_name} ({os.path.basename(path)}:{frame.f_lineno})"
    for frame, path in stack:
        if "/chexflow/" in path:
            return f"in {frame.f_code.co_name} ({os.path.basename(path)}:{frame.f_lineno})"
    return ""


def _distributed() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _awaited_worker(it) -> str | None:
    """The worker a torch ``_MultiProcessingDataLoaderIter`` waits for: its next batch's."""
    try:
        info = it._task_info.get(it._rcvd_idx)
        if info is None or len(info) != 1:
            return None
        wid = info[0]
        return f"waiting for loader worker pid {it._workers[wid].pid} (worker {wid} of {len(it._workers)})"
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def stop_children(grace_s: float = 1.0) -> None:
    """Ask this process's descendants for their stacks (loader workers dump them), then kill them."""
    import psutil
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    server = getattr(getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None),
                     "_forkserver_pid", None)
    if not children:
        return
    for child in children:
        if child.pid != server:
            _signal(child, STACK_SIGNAL)
    time.sleep(grace_s)
    for child in children:
        _signal(child, signal.SIGKILL)


def _signal(proc, sig) -> None:
    try:
        proc.send_signal(sig)
    except Exception:  # noqa: BLE001 - gone already, or not ours to signal: nothing left to stop
        pass


_ACTIVE: Watchdog | None = None


def arm(command: str, cfg: WatchdogConfig | None = None) -> Watchdog | None:
    """Start this process's watchdog (once; settings from :data:`ENV` unless given)."""
    global _ACTIVE
    cfg = config_from_env() if cfg is None else cfg
    if _ACTIVE is None and cfg.enabled:
        _ACTIVE = Watchdog(cfg, command=command).start()
    return _ACTIVE


def disarm() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop()
        _ACTIVE = None


def beat(phase: str) -> None:
    """Mark progress in ``phase`` (training, validation, checkpoint, verification, ...); nothing when
    no watchdog is armed."""
    if _ACTIVE is not None:
        _ACTIVE.beat(phase)


def unpaced(phase: str) -> None:
    """The rest of this process marks no pace (:meth:`Watchdog.unpace`); nothing when no watchdog is armed."""
    if _ACTIVE is not None:
        _ACTIVE.unpace(phase)


def name_process(who: str) -> None:
    """How the line names this process (``rank 3``), once it is known."""
    if _ACTIVE is not None:
        _ACTIVE.who = who
