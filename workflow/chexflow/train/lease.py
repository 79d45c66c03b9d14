"""One trainer at a time in a checkpoint directory, across nodes and on a shared file system.

A trainer (its rank 0) holds ``<checkpoint dir>/lease.json`` for its whole life: a record naming
its host, pid (and the process's start time, so a reused pid is no holder) and SLURM job id,
created atomically by ``link(2)`` of a complete temporary file (atomic on NFS, Lustre and GPFS,
where ``flock`` may not be), renewed by a heartbeat (the file's mtime, every ``stale_s / 10``)
and removed when training ends. A second trainer -- a Snakemake rerun that submitted the same
training while the first job still runs (its controller was killed), or a retry started while the
failed attempt is still being torn down -- waits up to ``wait_s`` for the holder to go, then stops
with a message naming it (exit code EXIT_LEASE_HELD). A lease whose holder is dead is taken over
and the takeover logged; the holder is dead when

* it ran on this host and its process is gone (or the pid now belongs to another process),
* it names this very SLURM job and is not a live process of it here (an earlier run of a
  requeued job: SLURM never runs two at once),
* its SLURM job is no longer running (``squeue``), or
* without either answer (another host, no SLURM), its heartbeat is older than ``stale_s``.

The workflow asks the same question before it submits anything (:func:`live_holders`, the
Snakefile's ``onstart``), so a rerun names the orphaned job and what to ``scancel`` instead of
starting a second one (the SLURM executor plugin does not know a dead controller's jobs:
snakemake-executor-plugin-slurm#109 asks for that). Only the standard library is imported here
(psutil if present; chexflow.fsutil, itself standard library only): the Snakefile imports this module.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from chexflow.fsutil import NotRegularFile, read_regular

LEASE_NAME = "lease.json"
EXIT_LEASE_HELD = 5   # another trainer holds the checkpoint directory (or took it over); 3, 4: trainer.py
MAX_BYTES = 64 * 1024       # a lease is a few hundred bytes; anything larger is not one
# squeue states in which the processes of a job may still run (and write)
SLURM_LIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
              "RESIZING"}


class LeaseHeld(RuntimeError):
    """The checkpoint directory is held by a live trainer; the message names it."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    pid_started: float | None       # process start time (psutil-style, seconds since the epoch)
    slurm_job_id: str | None
    token: str                      # unique per lease: who owns the file now
    since: float                    # when the lease was taken (time.time() of the holder)

    @classmethod
    def this_process(cls) -> "Holder":
        return cls(host=socket.gethostname(), pid=os.getpid(), pid_started=_started(os.getpid()),
                   slurm_job_id=os.environ.get("SLURM_JOB_ID") or None, token=uuid.uuid4().hex, since=time.time())

    def describe(self) -> str:
        job = f"SLURM job {self.slurm_job_id}, " if self.slurm_job_id else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{job}host {self.host}, pid {self.pid}, since {since}"


def _started(pid: int) -> float | None:
    """When process ``pid`` started; None if unknown (no psutil, no such process) or it is a zombie
    (it has ended: it writes nothing any more)."""
    try:
        import psutil
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else round(proc.create_time(), 2)
    except Exception:  # noqa: BLE001 - no psutil, no such process, no permission: unknown
        return None


def _pid_is(pid: int, started: float | None) -> bool:
    """Is process ``pid`` on this host alive (not a zombie) and the one that started at ``started``?"""
    try:
        import psutil
    except ImportError:         # the workflow's environment may lack it: existence only
        psutil = None
    if psutil is not None:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            return started is None or abs(proc.create_time() - started) < 1.0
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------- reading

def read_holder(path: Path) -> Holder:
    """The holder named by lease file ``path``; ValueError naming the file and what is wrong."""
    try:        # a FIFO there would block a plain open
        raw = read_regular(path, max_bytes=MAX_BYTES, follow_symlinks=False, what="lease")
    except NotRegularFile as exc:       # also a file over MAX_BYTES
        raise ValueError(f"{exc}; not a chexflow lease") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a chexflow lease (not JSON: {exc})") from None
    types = {"host": str, "pid": int, "pid_started": (float, int, type(None)), "slurm_job_id": (str, type(None)),
             "token": str, "since": (float, int)}
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a chexflow lease (a JSON {type(obj).__name__}, not an object)")
    wrong = [k for k, t in types.items() if not isinstance(obj.get(k), t) or isinstance(obj.get(k), bool)]
    if wrong:
        raise ValueError(f"{path}: not a chexflow lease (missing or mistyped: {', '.join(wrong)})")
    return Holder(**{k: obj[k] for k in types})


def slurm_state(job_id: str) -> str | None:
    """The job's state as squeue reports it, "GONE" for a job SLURM no longer knows, None when
    SLURM cannot be asked (no squeue here, no controller)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode == 0:
        return proc.stdout.split()[0] if proc.stdout.split() else "GONE"
    return "GONE" if "Invalid job id" in proc.stderr else None


def holder_alive(holder: Holder, age_s: float, *, stale_s: float, me: Holder | None = None) -> tuple[bool, str]:
    """(is the holder alive, why): see the module docstring for the rules, in their order."""
    here = socket.gethostname()
    if me is not None and holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id:
        if holder.host == here and _pid_is(holder.pid, holder.pid_started):
            return True, f"process {holder.pid} of this SLURM job still runs"
        return False, f"an earlier run of this SLURM job {holder.slurm_job_id} (requeued) held it"
    if holder.host == here:
        if _pid_is(holder.pid, holder.pid_started):
            return True, f"process {holder.pid} on this host still runs"
        return False, f"process {holder.pid} on this host is gone"
    if holder.slurm_job_id:
        state = slurm_state(holder.slurm_job_id)
        if state in SLURM_LIVE:
            return True, f"SLURM job {holder.slurm_job_id} is {state}"
        if state is not None:
            gone = "no longer known to SLURM" if state == "GONE" else state
            return False, f"SLURM job {holder.slurm_job_id} is {gone}"
    if age_s > stale_s:
        return False, f"no heartbeat for {age_s:.0f} s (more than {stale_s:.0f} s)"
    return True, f"heartbeat {age_s:.0f} s ago"


def _age(path: Path) -> float:
    return max(0.0, time.time() - path.stat().st_mtime)


# ------------------------------------------------------------------------------- holding

class Lease:
    """A held lease; :meth:`release` (or the ``with`` block's end) gives it back."""

    def __init__(self, path: Path, holder: Holder, *, heartbeat_s: float, on_lost: Callable[[str], None]):
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s, on_lost), name="chexflow-lease",
                                        daemon=True)
        self._thread.start()

    def _owned(self) -> bool:
        try:
            return read_holder(self.path).token == self.holder.token
        except (OSError, ValueError):
            return False

    def _beat(self, every: float, on_lost: Callable[[str], None]) -> None:
        while not self._stop.wait(every):
            if not self._owned():
                on_lost(f"lost the lease {self.path}: another trainer took over this checkpoint directory "
                        f"({_describe_current(self.path)}); stopping without writing")
                return
            try:
                os.utime(self.path)
            except OSError:
                pass        # a transient file system error: the next beat tries again

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._owned():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _describe_current(path: Path) -> str:
    try:
        return read_holder(path).describe()
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"


def _create(path: Path, holder: Holder) -> bool:
    """Publish ``holder`` as ``path`` if there is none: a complete temporary file, hard-linked."""
    tmp = path.with_name(f".{path.name}.{holder.token}")
    tmp.write_text(json.dumps(asdict(holder)))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # NFS may lose the reply of a link that was made: two links to the temporary file say it was
        return tmp.stat().st_nlink == 2
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale(path: Path, judged: str | None) -> None:
    """Move the stale lease away (rename is atomic: of two takers, one moves it); if what was moved is
    not the lease judged stale (``judged``: its token; None for an unreadable file), put it back."""
    aside = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = read_holder(aside).token
    except (OSError, ValueError):
        moved = None
    if moved != judged:
        try:
            os.link(aside, path)
        except OSError:
            pass
    aside.unlink(missing_ok=True)


def acquire(ckpt_dir: Path, *, wait_s: float, stale_s: float, log: Callable[[str], None] = print,
            on_lost: Callable[[str], None] | None = None, poll_s: float = 2.0) -> Lease:
    """Hold ``ckpt_dir``'s lease: take a free or stale one at once, wait up to ``wait_s`` for a live
    holder, then raise LeaseHeld naming it. ``on_lost``: called (from the heartbeat thread) if
    another trainer takes the lease over; the default ends the process with EXIT_LEASE_HELD."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / LEASE_NAME
    me = Holder.this_process()
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        if _create(path, me):
            return Lease(path, me, heartbeat_s=max(stale_s / 10, 0.5), on_lost=on_lost or _exit_lost(log))
        try:
            age = _age(path)
            current: Holder | None = read_holder(path)
            alive, why = holder_alive(current, age, stale_s=stale_s, me=me)
        except FileNotFoundError:
            continue                    # released meanwhile: try again
        except ValueError as exc:       # not a lease: a stale one if old, else someone is writing it
            current, alive = None, age <= stale_s
            why = f"{exc}; {'modified' if alive else 'untouched for'} {age:.0f} s ago"
        if not alive:
            log(f"taking over the lease {path} ({current.describe() if current else 'unreadable'}): {why}")
            _remove_stale(path, current.token if current else None)
            continue
        who = current.describe() if current else "an unreadable lease"
        if time.monotonic() >= deadline:
            raise LeaseHeld(f"checkpoint directory {ckpt_dir} is in use by another trainer ({who}; {why}). "
                            f"Two trainers must not write one checkpoint directory: {advice(current)}")
        if not waiting:
            log(f"checkpoint directory {ckpt_dir} is in use ({who}; {why}); waiting up to {wait_s:.0f} s")
            waiting = True
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.05)))


def advice(holder: Holder | None) -> str:
    """What the user does about a live holder."""
    if holder is None:
        return "if no trainer runs, remove the lease file."
    if holder.slurm_job_id:
        return (f"wait until SLURM job {holder.slurm_job_id} has ended (`squeue -j {holder.slurm_job_id}`) and run "
                f"again, or stop it with `scancel {holder.slurm_job_id}` and run again; training resumes from "
                "the newest checkpoint either way.")
    return (f"wait for process {holder.pid} on {holder.host} to end, or stop it with `kill {holder.pid}` there "
            "(it writes a checkpoint on SIGTERM), and run again; training resumes from the newest checkpoint.")


def _exit_lost(log: Callable[[str], None]) -> Callable[[str], None]:
    def lost(msg: str) -> None:
        log(msg)
        os._exit(EXIT_LEASE_HELD)       # from the heartbeat thread: nothing more may be written here
    return lost


# ------------------------------------------------------------------------------- the workflow's check

def live_holders(root: Path, *, stale_s: float) -> list[tuple[Path, Holder, str]]:
    """The live holders of the checkpoint directories under ``root`` (``results/``): (directory,
    holder, why). Asked before a workflow submits anything: a live holder then is a training job
    or process that outlived the Snakemake that started it."""
    found = []
    for path in sorted(Path(root).glob(f"**/checkpoints/{LEASE_NAME}")):
        try:
            holder = read_holder(path)
            alive, why = holder_alive(holder, _age(path), stale_s=stale_s)
        except (OSError, ValueError):
            continue            # unreadable or just released: the trainer's own acquire deals with it
        if alive:
            found.append((path.parent, holder, why))
    return found


def orphan_message(found: list[tuple[Path, Holder, str]]) -> str:
    lines = ["Training started by an earlier run of this workflow is still running (its Snakemake was stopped "
             "or killed); starting it again would put a second trainer into the same checkpoint directory:"]
    for ckpt_dir, holder, why in found:
        lines.append(f"  {ckpt_dir}: {holder.describe()} ({why})")
        lines.append(f"    -> {advice(holder)}")
    return "\n".join(lines)
