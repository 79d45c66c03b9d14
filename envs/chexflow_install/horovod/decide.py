"""Pure decisions of the Horovod build: C++ standard, MPI and NCCL ops, the cache key, the build environment."""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Mapping

from chexflow_install.horovod.common import NO_CUDA_ENV, InstallError


def parse_torch_version(version: str) -> tuple[int, int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14, 1)``; ``"2.1"`` -> ``(2, 1, 0)``."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not match:
        raise ValueError(f"torch version {version!r}: expected MAJOR.MINOR[.PATCH][...]")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def choose_cxx_std(torch_version: str) -> int:
    """C++ standard that the headers of this torch version compile with: 20 from 2.14 on, else 17."""
    major, minor, _ = parse_torch_version(torch_version)
    return 20 if (major, minor) >= (2, 14) else 17


def python_tag(impl: str | None = None, version: tuple[int, int] | None = None) -> str:
    """Wheel-style interpreter tag, e.g. ``cp311``."""
    impl = impl if impl is not None else sys.implementation.name
    major, minor = version if version is not None else sys.version_info[:2]
    short = {"cpython": "cp", "pypy": "pp"}.get(impl, impl)
    return f"{short}{major}{minor}"


@dataclasses.dataclass(frozen=True)
class BuildKey:
    """Everything that makes two Horovod wheels binary-incompatible."""

    horovod: str
    torch: str
    python: str
    machine: str
    cxx_std: int
    mpi: bool
    nccl: bool

    def dirname(self) -> str:
        raw = (
            f"horovod-{self.horovod}_torch-{self.torch}_{self.python}_{self.machine}"
            f"_cxx{self.cxx_std}_mpi{int(self.mpi)}_nccl{int(self.nccl)}"
        )
        return re.sub(r"[^A-Za-z0-9._+-]", "-", raw)

    def local_version(self) -> str:
        """PEP 440 local version label carried by the wheel, e.g. ``chexflow.t2.14.1.cu130.cp311...``."""
        torch = ".".join(p for p in re.split(r"[^A-Za-z0-9]+", self.torch.lower()) if p)
        return f"chexflow.t{torch}.{self.python}.cxx{self.cxx_std}.mpi{int(self.mpi)}.nccl{int(self.nccl)}"

    def version(self) -> str:
        return f"{self.horovod}+{self.local_version()}"


def decide_mpi(mode: str, compiler: str | None, why_found: str) -> tuple[bool, str]:
    """(build MPI ops?, reason). ``mode`` is auto|yes|no."""
    if mode == "no":
        return False, "no (--with-mpi no)"
    if compiler is None:
        if mode == "yes":
            raise InstallError(
                "--with-mpi yes: no MPI C++ compiler found (set MPICXX=/path/to/mpicxx, load your MPI "
                "module, or install libopenmpi-dev)"
            )
        return False, "no (auto: no MPI C++ compiler found; set MPICXX to use one)"
    how = "--with-mpi yes" if mode == "yes" else "auto"
    return True, f"yes ({how}: {compiler} {why_found})"


def decide_nccl(mode: str, cuda_available: bool) -> tuple[bool, str]:
    """(build NCCL/CUDA ops?, reason). Without a usable GPU only ``--with-nccl yes`` builds them."""
    if mode == "no":
        return False, "no (--with-nccl no)"
    if mode == "yes":
        return True, "yes (--with-nccl yes)"
    if cuda_available:
        return True, "yes (auto: torch.cuda.is_available() is True)"
    return False, "no (auto: torch.cuda.is_available() is False; CUDA detection disabled)"


def find_mpi_compiler(env: Mapping[str, str]) -> tuple[str | None, str]:
    """(path of the MPI C++ compiler wrapper or None, where it came from)."""
    path = env.get("PATH", os.defpath)
    if env.get("MPICXX"):
        found = shutil.which(env["MPICXX"], path=path)
        if not found:
            raise InstallError(f"MPICXX={env['MPICXX']!r}: not an executable file")
        return found, "(from $MPICXX)"
    if env.get("HOROVOD_MPICXX_SHOW"):
        words = shlex.split(env["HOROVOD_MPICXX_SHOW"])
        found = shutil.which(words[0], path=path) if words else None
        if not found:
            raise InstallError(
                f"HOROVOD_MPICXX_SHOW={env['HOROVOD_MPICXX_SHOW']!r}: its first word is not an executable"
            )
        return found, "(from $HOROVOD_MPICXX_SHOW)"
    for name in ("mpicxx", "mpic++", "mpiCC"):
        found = shutil.which(name, path=path)
        if found:
            return found, "(on PATH)"
    return None, ""


def build_env(
    base: Mapping[str, str],
    key: BuildKey,
    *,
    mpi_compiler: str | None,
    jobs: int,
    nccl_home: str | None = None,
) -> dict[str, str]:
    """The environment for ``pip wheel``: the user's, plus what selects this build's features."""
    env = dict(base)
    for name in ("HOROVOD_WITHOUT_PYTORCH", "HOROVOD_WITH_TENSORFLOW", "HOROVOD_WITH_MXNET",
                 "HOROVOD_WITHOUT_GLOO", "HOROVOD_WITH_MPI", "HOROVOD_WITHOUT_MPI", NO_CUDA_ENV):
        env.pop(name, None)
    env.update(
        HOROVOD_WITH_PYTORCH="1",
        HOROVOD_WITHOUT_TENSORFLOW="1",
        HOROVOD_WITHOUT_MXNET="1",
        HOROVOD_WITH_GLOO="1",
        HOROVOD_LOCAL_VERSION=key.local_version(),
    )
    env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")  # CMake 4 refuses cmake_minimum_required < 3.5
    env.setdefault("MAKEFLAGS", f"-j{jobs}")
    if key.mpi:
        env["HOROVOD_WITH_MPI"] = "1"
        if mpi_compiler:  # CMake's FindMPI looks for the wrapper on PATH first
            env["PATH"] = os.pathsep.join([str(Path(mpi_compiler).parent), env.get("PATH", os.defpath)])
    else:
        env["HOROVOD_WITHOUT_MPI"] = "1"
    if key.nccl:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        for name in ("HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER", "HOROVOD_GPU_BROADCAST",
                     "HOROVOD_GPU_ALLTOALL", "HOROVOD_GPU_REDUCESCATTER"):
            env.pop(name, None)
        if env.get("HOROVOD_CUDA_HOME"):
            env.setdefault("CUDA_HOME", env["HOROVOD_CUDA_HOME"])  # torch.utils.cpp_extension reads it
        if nccl_home:
            env["HOROVOD_NCCL_HOME"] = nccl_home
            env.setdefault("HOROVOD_NCCL_LINK", "SHARED")
    else:
        for name in list(env):
            if name.startswith("HOROVOD_GPU"):
                env.pop(name)
        env[NO_CUDA_ENV] = "1"
    return env
