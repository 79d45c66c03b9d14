"""What every step of the Horovod installer shares: the version, messages, errors, logged commands."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

HOROVOD_VERSION = "0.28.1"
SAY_PREFIX = "horovod-install:"
LOG_TAIL_LINES = 80
# Environment switch read by the patched CMake files: 1 = ignore nvcc / CUDA builds of torch.
NO_CUDA_ENV = "CHEXFLOW_HOROVOD_WITHOUT_CUDA"


class InstallError(RuntimeError):
    """A decision or step that cannot go on; the message says what and where."""


def say(msg: str) -> None:
    print(f"{SAY_PREFIX} {msg}", flush=True)


def run_logged(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
               cwd: Path | None = None) -> int:
    with open(log, "a") as fh:
        fh.write(f"\n$ {shlex.join(str(c) for c in cmd)}\n")
        fh.flush()
        return subprocess.run(list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
