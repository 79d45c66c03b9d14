"""Reproducible build of Horovod 0.28.1 (PyTorch frontend only) against the installed torch.

Horovod 0.28.1 (the last release) does not build against torch 2.x as shipped. This module takes
the PyPI sdist, patches it (C++ standard, CUDA detection guard, missing standard includes), builds a
wheel with ``pip wheel --no-build-isolation`` against the torch of the running interpreter, keeps
the wheel in a cache keyed by everything that makes it binary-incompatible, installs it with
``sys.executable -m pip`` and checks that ``hvd.init()`` works.

Usage::

    python -m chexflow.install.horovod [--with-mpi auto|yes|no] [--with-nccl auto|yes|no]
        [--cxx-std 17|20] [--sdist PATH] [--cache-dir DIR] [--jobs N]
        [--force] [--reinstall] [--no-install] [--dry-run] [--keep-build-dir]

Decisions (one line each, prefixed ``horovod-install:``):

* C++ standard: 17 for torch <= 2.13, 20 for torch >= 2.14 (``--cxx-std`` overrides).
* MPI ops (``--with-mpi auto``): built when an MPI C++ compiler is found: ``$MPICXX``, the first
  word of ``$HOROVOD_MPICXX_SHOW``, or ``mpicxx``/``mpic++``/``mpiCC`` on ``PATH``.
* NCCL/CUDA ops (``--with-nccl auto``): built only when ``torch.cuda.is_available()``; otherwise
  CUDA detection is switched off so that a stray ``nvcc`` does not pull CUDA kernels into a CPU
  build. ``HOROVOD_CUDA_HOME``, ``HOROVOD_NCCL_HOME/_INCLUDE/_LIB/_LINK``, ``CC``/``CXX``,
  ``HOROVOD_BUILD_CUDA_CC_LIST`` are passed through; without ``HOROVOD_NCCL_*`` the NCCL of the
  ``nvidia-nccl-*`` wheel that CUDA builds of torch depend on is used when present.
* Gloo is always built; TensorFlow and MXNet frontends never.

Cache: ``--cache-dir`` > ``$CHEXFLOW_WHEEL_CACHE`` > ``~/.cache/chexflow/wheels``; one sub-directory
per :class:`BuildKey` (horovod version, torch version with local tag, python tag, machine, C++
standard, MPI, NCCL) holding the wheel, and ``logs/`` holding the build logs. The key is also baked
into the wheel's local version (``0.28.1+chexflow...``) so that an installed Horovod can be matched
against it: when the installed one has the same key and its torch ops work, nothing is done
(``--force`` rebuilds, ``--reinstall`` reinstalls from the cache).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from chexflow.fsutil import atomic_path, write_text_atomic

HOROVOD_VERSION = "0.28.1"
SAY_PREFIX = "horovod-install:"
LOG_TAIL_LINES = 80

# Import name -> distribution name of what Horovod's setup.py needs at build time (and at run time).
BUILD_DEPS: tuple[tuple[str, str], ...] = (
    ("cloudpickle", "cloudpickle"),
    ("psutil", "psutil"),
    ("yaml", "pyyaml"),
    ("packaging", "packaging"),
    ("cffi", "cffi"),
    ("setuptools", "setuptools"),
    ("wheel", "wheel"),
)

# Files whose ``set(CMAKE_CXX_STANDARD 14)`` pins a standard that torch 2.x headers reject.
CXX_STD_FILES: tuple[str, ...] = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
# nvcc of CUDA >= 12.x/13 rejects or warns on C++11 host code with newer GCC (horovod PR #4313).
CUDA_STD_FILE = "horovod/common/ops/cuda/CMakeLists.txt"
CUDA_STD = 17
CUDA_GUARD_FILE = "CMakeLists.txt"
FIND_PYTORCH_FILE = "cmake/Modules/FindPytorch.cmake"
# Environment switch read by the patched CMake files: 1 = ignore nvcc / CUDA builds of torch.
NO_CUDA_ENV = "CHEXFLOW_HOROVOD_WITHOUT_CUDA"

# Standard headers that these files use (std::string, std::runtime_error, uint8_t & co.) without
# including them, relying on transitive includes that GCC >= 13 / 15 removed. Found by tracing each
# header's own include closure inside the source tree (the headers every translation unit reaches
# first); adding them is harmless on older compilers.
MISSING_INCLUDES: dict[str, tuple[str, ...]] = {
    "horovod/common/common.h": ("cstdint", "stdexcept", "string"),
    "horovod/common/message.h": ("cstdint", "string"),
    "horovod/common/message.cc": ("stdexcept",),
    "horovod/common/group_table.h": ("cstdint", "string"),
    "horovod/common/nvtx_op_range.h": ("cstdint",),
    "horovod/common/parameter_manager.h": ("cstdint",),
    "horovod/common/optim/gaussian_process.cc": ("cstdint",),
    "third_party/gloo/gloo/types.h": ("cstdint",),
    "third_party/gloo/gloo/common/error.h": ("stdexcept", "string"),
    "third_party/gloo/gloo/rendezvous/store.h": ("cstdint",),
}
INCLUDE_BANNER = "// chexflow: standard headers this file uses but newer GCC no longer provides transitively"


class InstallError(RuntimeError):
    """A decision or step that cannot go on; the message says what and where."""


# --------------------------------------------------------------------------------------------
# pure decisions


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


def resolve_cache_dir(arg: str | None, env: Mapping[str, str], home: Path) -> Path:
    if arg:
        return Path(arg).expanduser()
    if env.get("CHEXFLOW_WHEEL_CACHE"):
        return Path(env["CHEXFLOW_WHEEL_CACHE"]).expanduser()
    return home / ".cache" / "chexflow" / "wheels"


# --------------------------------------------------------------------------------------------
# pure source patches (text in, text out; each one idempotent)


def set_cxx_standard(text: str, std: int, *, source: str = "CMakeLists.txt") -> str:
    """Rewrite every ``set(CMAKE_CXX_STANDARD N)`` statement (not those inside strings) to ``std``."""
    pattern = re.compile(r"^(?P<head>[ \t]*set\(\s*CMAKE_CXX_STANDARD\s+)\d+(?P<tail>\s*\))", re.M)
    if not pattern.search(text):
        raise InstallError(f"{source}: no 'set(CMAKE_CXX_STANDARD N)' statement to patch")
    return pattern.sub(lambda m: f"{m['head']}{std}{m['tail']}", text)


def set_cuda_standard(text: str, std: int, *, source: str = CUDA_STD_FILE) -> str:
    pattern = re.compile(r"^(?P<head>[ \t]*set\(\s*CMAKE_CUDA_STANDARD\s+)\d+(?P<tail>\s*\))", re.M)
    if not pattern.search(text):
        raise InstallError(f"{source}: no 'set(CMAKE_CUDA_STANDARD N)' statement to patch")
    return pattern.sub(lambda m: f"{m['head']}{std}{m['tail']}", text)


_GUARD_OPEN = f'if(NOT "$ENV{{{NO_CUDA_ENV}}}" STREQUAL "1")  # chexflow: CUDA detection guard\n'
_GUARD_CLOSE = "endif()  # chexflow: CUDA detection guard\n"


def guard_cuda_detection(text: str, *, source: str = CUDA_GUARD_FILE) -> str:
    """Wrap the top-level CUDA compiler detection (check_language .. enable_language) in an env guard."""
    if _GUARD_OPEN in text:
        return text
    start = text.find("check_language(CUDA)")
    end_stmt = text.find("enable_language(CUDA)", start)
    if start < 0 or end_stmt < 0:
        raise InstallError(f"{source}: cannot find 'check_language(CUDA)' ... 'enable_language(CUDA)'")
    start = text.rfind("\n", 0, start) + 1
    close = re.compile(r"^[ \t]*endif\s*\(\s*\)[^\n]*\n", re.M).search(text, end_stmt)
    if close is None:
        raise InstallError(f"{source}: no endif() after 'enable_language(CUDA)'")
    return text[:start] + _GUARD_OPEN + text[start:close.end()] + _GUARD_CLOSE + text[close.end():]


def guard_pytorch_cuda(text: str, *, source: str = FIND_PYTORCH_FILE) -> str:
    """Make FindPytorch report a CPU torch when the guard env var is set (no CUDAExtension, no add_cuda)."""
    anchor = 'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n'
    marker = f'if("$ENV{{{NO_CUDA_ENV}}}" STREQUAL "1")  # chexflow: CPU-only build\n'
    if marker in text:
        return text
    if anchor not in text:
        raise InstallError(f"{source}: cannot find {anchor.strip()!r}")
    return text.replace(anchor, anchor + marker + "    set(Pytorch_CUDA FALSE)\nendif()\n", 1)


def add_includes(text: str, headers: Sequence[str]) -> str:
    """Prepend ``#include <h>`` for each header in ``headers`` that ``text`` does not include yet."""
    missing = [
        h for h in headers
        if not re.search(rf"^[ \t]*#[ \t]*include[ \t]*<{re.escape(h)}>", text, re.M)
    ]
    if not missing:
        return text
    block = INCLUDE_BANNER + "\n" + "".join(f"#include <{h}>\n" for h in missing)
    return block + text


def patch_file_text(relpath: str, text: str, cxx_std: int) -> str:
    """All patches that apply to one file of the sdist, by its path relative to the tree root."""
    if relpath in CXX_STD_FILES:
        text = set_cxx_standard(text, cxx_std, source=relpath)
    if relpath == CUDA_GUARD_FILE:
        text = guard_cuda_detection(text, source=relpath)
    if relpath == FIND_PYTORCH_FILE:
        text = guard_pytorch_cuda(text, source=relpath)
    if relpath == CUDA_STD_FILE:
        text = set_cuda_standard(text, CUDA_STD, source=relpath)
    if relpath in MISSING_INCLUDES:
        text = add_includes(text, MISSING_INCLUDES[relpath])
    return text


def files_to_patch() -> tuple[str, ...]:
    names = [*CXX_STD_FILES, CUDA_GUARD_FILE, FIND_PYTORCH_FILE, CUDA_STD_FILE, *MISSING_INCLUDES]
    return tuple(dict.fromkeys(names))


def patch_source_tree(root: Path, cxx_std: int) -> list[str]:
    """Apply :func:`patch_file_text` to the extracted sdist in place; return the files changed."""
    changed = []
    for rel in files_to_patch():
        path = root / rel
        if not path.is_file():
            raise InstallError(f"{path}: expected in the Horovod {HOROVOD_VERSION} sdist, not found")
        old = path.read_text()
        new = patch_file_text(rel, old, cxx_std)
        if new != old:
            write_text_atomic(path, new)
            changed.append(rel)
    return changed


# --------------------------------------------------------------------------------------------
# probing the interpreter


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


# --------------------------------------------------------------------------------------------
# steps with side effects


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


def obtain_sdist(sdist: str | None, workdir: Path, python: str, log: Path) -> Path:
    if sdist:
        path = Path(sdist).expanduser()
        if not path.is_file():
            raise InstallError(f"--sdist {sdist}: no such file")
        say(f"sdist: {path} (--sdist)")
        return path
    dest = workdir / "sdist"
    dest.mkdir()
    cmd = [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"horovod=={HOROVOD_VERSION}", "-d", str(dest)]
    if run_logged(cmd, log) != 0:
        raise InstallError(f"pip download of horovod=={HOROVOD_VERSION} failed; see {log}")
    found = sorted(dest.glob(f"horovod-{HOROVOD_VERSION}.tar.gz"))
    if not found:
        raise InstallError(f"pip download put no horovod-{HOROVOD_VERSION}.tar.gz into {dest}")
    say(f"sdist: downloaded {found[0].name} from the package index")
    return found[0]


def extract_sdist(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    roots = [p for p in dest.iterdir() if (p / "setup.py").is_file()]
    if len(roots) != 1:
        raise InstallError(f"{sdist}: expected one top-level directory with setup.py, found {len(roots)}")
    return roots[0]


def cached_wheel(cache_dir: Path, key: BuildKey) -> Path | None:
    wheels = sorted((cache_dir / key.dirname()).glob("horovod-*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None


def store_wheel(wheel: Path, cache_dir: Path, key: BuildKey) -> Path:
    final = cache_dir / key.dirname() / wheel.name
    with atomic_path(final) as tmp:
        shutil.copyfile(wheel, tmp)
    return final


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_wheel(src: Path, env: Mapping[str, str], python: str, out_dir: Path, log: Path) -> Path:
    cmd = [python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", "-w", str(out_dir), str(src)]
    if run_logged(cmd, log, env=env, cwd=src) != 0:
        raise InstallError(f"building the Horovod wheel failed:\n{log_tail(log)}\n(full build log: {log})")
    wheels = sorted(out_dir.glob("horovod-*.whl"))
    if len(wheels) != 1:
        raise InstallError(f"pip wheel left {len(wheels)} horovod wheels in {out_dir}; see {log}")
    return wheels[0]


def ensure_build_deps(python: str, log: Path) -> None:
    missing = missing_modules(python, [mod for mod, _ in BUILD_DEPS])
    if not missing:
        say("build deps: all present (" + ", ".join(dist for _, dist in BUILD_DEPS) + ")")
        return
    dists = [dist for mod, dist in BUILD_DEPS if mod in missing]
    say(f"build deps: installing missing {', '.join(dists)}")
    if run_logged([python, "-m", "pip", "install", *dists], log) != 0:
        raise InstallError(f"pip install {' '.join(dists)} failed:\n{log_tail(log)}\n(log: {log})")


def install_wheel(python: str, wheel: Path, log: Path) -> None:
    cmd = [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)]
    if run_logged(cmd, log) != 0:
        raise InstallError(f"pip install {wheel} failed:\n{log_tail(log)}\n(log: {log})")


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


# --------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m chexflow.install.horovod",
        description=f"Build (or take from the cache) and install Horovod {HOROVOD_VERSION} for the "
        "torch of this interpreter.",
    )
    p.add_argument("--with-mpi", choices=("auto", "yes", "no"), default="auto",
                   help="build MPI ops (auto: when an MPI C++ compiler is found)")
    p.add_argument("--with-nccl", choices=("auto", "yes", "no"), default="auto",
                   help="build NCCL/CUDA ops (auto: when torch.cuda.is_available())")
    p.add_argument("--cxx-std", type=int, choices=(17, 20), default=None,
                   help="C++ standard (default: 17 for torch <= 2.13, 20 for torch >= 2.14)")
    p.add_argument("--sdist", default=None, help=f"horovod-{HOROVOD_VERSION}.tar.gz to use instead of downloading")
    p.add_argument("--cache-dir", default=None,
                   help="wheel cache (default: $CHEXFLOW_WHEEL_CACHE or ~/.cache/chexflow/wheels)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (MAKEFLAGS)")
    p.add_argument("--force", action="store_true", help="rebuild even if installed or cached")
    p.add_argument("--reinstall", action="store_true",
                   help="reinstall even if the installed horovod matches (uses the cached wheel)")
    p.add_argument("--no-install", action="store_true",
                   help="only build (or find) the wheel in the cache, e.g. to fill a shared cache")
    p.add_argument("--dry-run", action="store_true", help="print the decisions, change nothing")
    p.add_argument("--keep-build-dir", action="store_true", help="keep the temporary build tree")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    python = sys.executable
    env = dict(os.environ)
    try:
        return _run(args, python, env)
    except InstallError as err:
        print(f"{SAY_PREFIX} ERROR: {err}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace, python: str, env: dict[str, str]) -> int:
    torch = probe_torch(python)
    say(f"python: {python} ({python_tag()})")
    say(f"torch: {torch.version} (CUDA {torch.cuda_version or 'none'}, cuda available: {torch.cuda_available})")
    if args.cxx_std is not None:
        cxx_std, why = args.cxx_std, "--cxx-std"
    else:
        cxx_std, why = choose_cxx_std(torch.version), "17 for torch <= 2.13, 20 for torch >= 2.14"
    say(f"c++ standard: {cxx_std} ({why})")
    mpi_compiler, where = find_mpi_compiler(env) if args.with_mpi != "no" else (None, "")
    mpi, why = decide_mpi(args.with_mpi, mpi_compiler, where)
    say(f"mpi ops: {why}")
    nccl, why = decide_nccl(args.with_nccl, torch.cuda_available)
    say(f"nccl/cuda ops: {why}")
    say("gloo: yes (always); frontends: pytorch only")
    compilers = ", ".join(f"{n}={env[n]}" for n in ("CC", "CXX") if env.get(n)) or "CMake default (c++ on PATH)"
    say(f"compiler: {compilers}")
    key = BuildKey(HOROVOD_VERSION, torch.version, python_tag(), platform.machine(), cxx_std, mpi, nccl)
    cache_dir = resolve_cache_dir(args.cache_dir, env, Path.home())
    say(f"cache key: {key.dirname()} (wheel version {key.version()})")
    say(f"cache dir: {cache_dir}")

    if args.force:
        say("installed check: skipped (--force)")
    elif args.reinstall or args.no_install:
        say(f"installed check: skipped ({'--reinstall' if args.reinstall else '--no-install'})")
    else:
        ok, why = installed_status(python, key)
        if ok:
            say(f"nothing to do: {why} (same key; --force rebuilds)")
            return 0
        say(f"installed check: {why}")

    wheel = None if args.force else cached_wheel(cache_dir, key)
    if args.dry_run:
        plan = f"install cached wheel {wheel}" if wheel else "build a new wheel"
        say(f"dry run: would {plan}")
        return 0

    logs = cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{key.dirname()}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    ensure_build_deps(python, log)      # also Horovod's run-time deps: the wheel is installed --no-deps
    if wheel is not None:
        say(f"wheel: using cached {wheel} (no rebuild)")
    else:
        with file_lock(cache_dir / f".{key.dirname()}.lock"):
            wheel = None if args.force else cached_wheel(cache_dir, key)  # built meanwhile by another process?
            if wheel is not None:
                say(f"wheel: using cached {wheel} (built by a concurrent run)")
            else:
                say(("wheel: rebuilding (--force)" if args.force else "wheel: not in cache, building")
                    + f"; build log: {log}")
                wheel = _build(args, python, env, key, cache_dir, mpi_compiler, log)
    if args.no_install:
        say(f"install: skipped (--no-install); wheel: {wheel}")
        return 0
    say(f"install: pip install {wheel.name} into {python}")
    install_wheel(python, wheel, log)
    verify(python)
    say("done")
    return 0


def _build(args: argparse.Namespace, python: str, env: Mapping[str, str], key: BuildKey,
           cache_dir: Path, mpi_compiler: str | None, log: Path) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="chexflow-horovod-build-"))
    try:
        sdist = obtain_sdist(args.sdist, workdir, python, log)
        src = extract_sdist(sdist, workdir / "src")
        changed = patch_source_tree(src, key.cxx_std)
        say(f"patch: {len(changed)} files changed ({', '.join(changed)})")
        nccl_home = None
        if key.nccl and not any(env.get(n) for n in ("HOROVOD_NCCL_HOME", "HOROVOD_NCCL_INCLUDE", "HOROVOD_NCCL_LIB")):
            pip_nccl = find_pip_nccl(python)
            if pip_nccl is not None:
                nccl_home = str(make_nccl_shim(pip_nccl, workdir / "nccl"))
                say(f"nccl: using the NCCL wheel at {pip_nccl} (set HOROVOD_NCCL_HOME to use another)")
            else:
                say("nccl: no HOROVOD_NCCL_HOME and no nvidia-nccl wheel; CMake searches the CUDA toolkit")
        benv = build_env(env, key, mpi_compiler=mpi_compiler, jobs=args.jobs, nccl_home=nccl_home)
        shown = {k: v for k, v in benv.items() if k.startswith(("HOROVOD_", "CHEXFLOW_HOROVOD", "CMAKE_", "MAKEFLAGS"))}
        with open(log, "a") as fh:
            fh.write("build environment (selected):\n" + json.dumps(shown, indent=1, sort_keys=True) + "\n")
        started = time.monotonic()
        built = build_wheel(src, benv, python, workdir / "wheelhouse", log)
        minutes = (time.monotonic() - started) / 60
        final = store_wheel(built, cache_dir, key)
        say(f"wheel: built in {minutes:.1f} min, cached as {final}")
        return final
    finally:
        if args.keep_build_dir:
            say(f"build dir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
