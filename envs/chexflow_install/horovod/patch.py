"""The Horovod sdist: downloaded (or given), extracted, and patched to build against torch 2.x.

Each patch is a pure text-in, text-out function and idempotent; :func:`patch_source_tree` applies them all."""
from __future__ import annotations

import re
from backports import tarfile   # extraction filters on every Python 3.11 (chexflow.data.archives)
from pathlib import Path
from typing import Sequence

from chexflow.fsutil import write_text_atomic
from chexflow_install.horovod.common import HOROVOD_VERSION, NO_CUDA_ENV, InstallError, run_logged, say

# Files whose ``set(CMAKE_CXX_STANDARD 14)`` pins a standard that torch 2.x headers reject.
CXX_STD_FILES: tuple[str, ...] = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
# nvcc of CUDA >= 12.x/13 rejects or warns on C++11 host code with newer GCC (horovod PR #4313).
CUDA_STD_FILE = "horovod/common/ops/cuda/CMakeLists.txt"
CUDA_STD = 17
CUDA_GUARD_FILE = "CMakeLists.txt"
FIND_PYTORCH_FILE = "cmake/Modules/FindPytorch.cmake"
# Environment switch read by the patched CMake files: 1 = ignore nvcc / CUDA builds of torch.

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
