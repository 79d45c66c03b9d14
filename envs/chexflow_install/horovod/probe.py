"""Questions put to the target interpreter in a subprocess: its torch, its installed Horovod, the NCCL wheel."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

from chexflow_install.horovod.common import InstallError, say
from chexflow_install.horovod.decide import BuildKey


@dataclasses.dataclass(frozen=True)
class TorchInfo:
    version: str
    cuda_available: bool
    cuda_version: str | None


_TORCH_PROBE = (
    "import json, torch; print(json.dumps({'version': torch.__version__, "
    "'cuda_available': bool(torch.cuda.is_available()), 'cuda_version': torch.version.cuda}))"
)


def _last_json_line(out: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in output")


def probe_torch(python: str) -> TorchInfo:
    proc = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InstallError(
            f"torch is not importable by {python} (install torch first, see envs/requirements.txt):\n"
            + proc.stderr.strip()[-2000:]
        )
    return TorchInfo(**_last_json_line(proc.stdout))


_HOROVOD_PROBE = r"""
import json, importlib.metadata
out = {"dist_version": importlib.metadata.version("horovod")}
import torch
import horovod.torch as hvd
hvd.init()
out.update(size=hvd.size(), mpi=bool(hvd.mpi_built()), gloo=bool(hvd.gloo_built()),
           nccl=bool(hvd.nccl_built()))
out["allreduce_ok"] = bool(torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.ones(3) * hvd.size()))
hvd.shutdown()
print(json.dumps(out))
"""


def installed_status(python: str, key: BuildKey, timeout: float = 300) -> tuple[bool, str]:
    """(installed Horovod has this key and working torch ops?, reason)."""
    try:
        proc = subprocess.run([python, "-c", _HOROVOD_PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"installed horovod did not finish hvd.init()/allreduce within {timeout:.0f} s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, f"no working horovod.torch in this interpreter ({last})"
    info = _last_json_line(proc.stdout)
    if info["dist_version"] != key.version():
        return False, f"installed horovod is {info['dist_version']}, wanted {key.version()}"
    flags = {"gloo": True, "mpi": key.mpi, "nccl": key.nccl}
    wrong = [f"{k}_built={info[k]}" for k, v in flags.items() if info[k] != v]
    if wrong:
        return False, f"installed horovod {info['dist_version']} has {', '.join(wrong)}"
    if not info["allreduce_ok"]:
        return False, "installed horovod's allreduce returned a wrong result"
    return True, f"horovod {info['dist_version']} is installed and its torch ops work"


def missing_modules(python: str, modules: Sequence[str]) -> list[str]:
    code = (
        "import importlib.util, json, sys; "
        "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))"
    )
    proc = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def find_pip_nccl(python: str) -> Path | None:
    """Root of the ``nvidia-nccl-*`` wheel (include/nccl.h, lib/libnccl.so.2), if installed."""
    code = (
        "import importlib.util; s = importlib.util.find_spec('nvidia.nccl'); "
        "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    root = Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else None
    if root and (root / "include" / "nccl.h").is_file() and sorted((root / "lib").glob("libnccl.so*")):
        return root
    return None


def make_nccl_shim(nccl_root: Path, dest: Path) -> Path:
    """A HOROVOD_NCCL_HOME layout over the pip NCCL wheel, whose lib/ lacks the ``libnccl.so`` link."""
    (dest / "lib").mkdir(parents=True, exist_ok=True)
    if not (dest / "include").exists():
        (dest / "include").symlink_to(nccl_root / "include")
    libs = sorted((nccl_root / "lib").glob("libnccl.so*"))
    if not (dest / "lib" / "libnccl.so").exists():
        (dest / "lib" / "libnccl.so").symlink_to(libs[0])
    return dest


def horovodrun_path(python: str) -> str:
    beside = Path(python).parent / "horovodrun"
    return str(beside) if beside.is_file() else (shutil.which("horovodrun") or "horovodrun")


def verify(python: str) -> None:
    code = (
        "import horovod.torch as hvd; hvd.init(); "
        "print(f'rank {hvd.rank()}/{hvd.size()} mpi={bool(hvd.mpi_built())} gloo={bool(hvd.gloo_built())} "
        "nccl={bool(hvd.nccl_built())}'); hvd.shutdown()"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise InstallError(f"verification 'import horovod.torch as hvd; hvd.init()' failed:\n{proc.stderr[-3000:]}")
    say(f"verify: hvd.init() ok: {proc.stdout.strip().splitlines()[-1]}")
    proc = subprocess.run([horovodrun_path(python), "--check-build"], capture_output=True, text=True, timeout=300)
    print(proc.stdout.rstrip(), flush=True)
    if proc.returncode != 0:
        raise InstallError(f"horovodrun --check-build failed:\n{proc.stderr[-3000:]}")
