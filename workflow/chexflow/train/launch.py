"""Start N ranks of a command: locally (horovodrun / torchrun) or under SLURM (srun).

The training rule runs ``{resources.mpi} -n {resources.tasks} chexflow train ...``. On SLURM the
profile sets ``mpi`` to an ``srun --mpi=pmix ...`` line; on a workstation to ``chexflow launch``,
which starts the ranks on this machine with the launcher of the configured backend
(``CHEXFLOW_BACKEND``): ``horovodrun --gloo`` for Horovod, ``torchrun`` for DDP. If any rank dies
the launcher stops the others and exits non-zero, so Snakemake sees a failure and a retry resumes.
``chexflow launch`` then exits with the first failed rank's own status and repeats its refusal
line last (chexflow.errors): the launchers exit 1 whatever their ranks exited with.

The local ranks share the job's cores: each gets an even share of its threads (:func:`rank_threads`).
Snakemake sets ``OMP_NUM_THREADS`` (and the BLAS libraries' equivalents) to the job's ``threads``, which
every rank would otherwise take for itself: 2 ranks of 2 threads on 2 cores took 1.2 (ResNet-18) to
1.9 (ShuffleNet v2 x0.5) times the CPU of 2 ranks of 1 for the same steps (BENCHMARKS.md).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from chexflow import errors
from chexflow.settings import ConfigError

BACKENDS = ("horovod", "ddp", "single")
# the variables Snakemake sets to a job's threads (snakemake.shell), each shared by the local ranks
THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def job_threads(env: dict[str, str]) -> tuple[int, str]:
    """The threads of the job (``OMP_NUM_THREADS``, which Snakemake sets to the rule's ``threads``; else the
    cores this process may run on) and where that number came from."""
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return len(os.sched_getaffinity(0)), "the cores this process may run on"
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise ConfigError(f"OMP_NUM_THREADS: {raw!r} is not a number of threads (a positive integer): "
                          "chexflow launch shares the job's threads among its ranks")
    return int(raw), "OMP_NUM_THREADS"


def rank_threads(env: dict[str, str], n: int) -> dict[str, str]:
    """The thread variables of each of ``n`` local ranks sharing one job: the job's threads divided
    evenly, at least 1 each; ``OMP_NUM_THREADS`` and every other variable of :data:`THREAD_VARS` the job set."""
    share = str(max(1, job_threads(env)[0] // n))
    return {var: share for var in THREAD_VARS if var == "OMP_NUM_THREADS" or var in env}


def local_command(backend: str, n: int, cmd: list[str]) -> list[str]:
    if not cmd:
        raise ConfigError("no command to launch (expected: chexflow launch -n N CMD ...)")
    if n < 1:
        raise ConfigError(f"-n: {n} ranks; launch needs at least 1")
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is none of {' | '.join(BACKENDS)} (--backend, or CHEXFLOW_BACKEND)")
    if backend == "horovod":
        horovodrun = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")
        if not os.path.exists(horovodrun):
            raise FileNotFoundError("horovodrun not found: build Horovod with `bash envs/setup.sh`"
                                    " or set train.backend: ddp")
        return [horovodrun, "-np", str(n), "-H", f"localhost:{n}", "--gloo", "--network-interface", "lo",
                "--start-timeout", "120", *cmd]
    if backend == "ddp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
        return [torchrun, "--nnodes", "1", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
                "--master-port", str(port), "--no-python", *cmd]
    if backend == "single":
        if n != 1:
            raise ConfigError(f"-n: backend 'single' runs one rank, not {n}")
        return list(cmd)
    raise AssertionError(backend)       # (every name of BACKENDS is handled above)


def _become_subreaper() -> None:
    """Orphaned ranks (e.g. after the horovodrun/torchrun process died) are re-parented to us."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _descendants() -> list:
    import psutil
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _signal_all(signum: int) -> None:
    import psutil
    for child in _descendants():
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def launch(backend: str, n: int, cmd: list[str]) -> int:
    """Run the ranks below this process; SIGTERM/SIGUSR1/SIGINT go to every rank directly.

    If the rank launcher exits (any rank failed, or the launcher itself died) every remaining
    descendant is killed, so no rank outlives the job and a failure is seen at once.
    """
    argv = local_command(backend, n, cmd)
    env = dict(os.environ)
    threads = rank_threads(env, n)
    print("launch:", " ".join(argv), file=sys.stderr, flush=True)
    print("launch: {} rank(s) of {} thread(s): the job's {} ({}) shared".format(
        n, threads["OMP_NUM_THREADS"], *job_threads(env)), file=sys.stderr, flush=True)
    _become_subreaper()
    with tempfile.TemporaryDirectory(prefix="chexflow-ranks-") as statuses:
        proc = subprocess.Popen(argv, env={**env, **threads, errors.RANK_STATUS_ENV: statuses})
        return _ranks_status(_wait(proc), statuses)


def _ranks_status(code: int, statuses: str) -> int:
    """The launcher's exit status, or when it failed, that of the first rank that recorded its own;
    where the launcher said otherwise, that rank's refusal lines again (the job's log ends with them)."""
    found = errors.first_recorded_exit(statuses) if code != 0 else None
    if found is None:
        return code
    rank_code, lines = found
    if lines and rank_code != code:
        print("\n".join(lines), file=sys.stderr, flush=True)
    return rank_code


def _wait(proc: subprocess.Popen) -> int:
    """The launcher's exit status; meanwhile signals go to every rank, and no rank outlives it."""

    def forward(signum, _frame):
        _signal_all(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    _signal_all(signal.SIGKILL)
    for child in _descendants():
        try:
            child.wait(timeout=10)
        except Exception:  # noqa: BLE001
            pass
    return code
