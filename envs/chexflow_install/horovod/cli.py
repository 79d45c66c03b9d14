"""``python -m chexflow_install.horovod``: the decisions, then the cached wheel or a build, then install and verify."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from chexflow_install.horovod.common import HOROVOD_VERSION, SAY_PREFIX, InstallError, say
from chexflow_install.horovod.decide import (BuildKey, build_env, choose_cxx_std, decide_mpi, decide_nccl,
                                             find_mpi_compiler, python_tag)
from chexflow_install.horovod.patch import extract_sdist, obtain_sdist, patch_source_tree
from chexflow_install.horovod.probe import find_pip_nccl, installed_status, make_nccl_shim, probe_torch, verify
from chexflow_install.horovod.wheel import (build_wheel, cached_wheel, ensure_build_deps, file_lock, install_wheel,
                                            resolve_cache_dir, store_wheel)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m chexflow_install.horovod",
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
    key, mpi_compiler = _decide(args, python, env)
    cache_dir = resolve_cache_dir(args.cache_dir, env, Path.home())
    say(f"cache key: {key.dirname()} (wheel version {key.version()})")
    say(f"cache dir: {cache_dir}")
    if _installed_already(args, python, key):
        return 0
    wheel = None if args.force else cached_wheel(cache_dir, key)
    if args.dry_run:
        plan = f"install cached wheel {wheel}" if wheel else "build a new wheel"
        say(f"dry run: would {plan}")
        return 0
    logs = cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{key.dirname()}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    ensure_build_deps(python, log)      # also Horovod's run-time deps: the wheel is installed --no-deps
    wheel = _wheel(args, python, env, key, cache_dir, mpi_compiler, log, wheel)
    if args.no_install:
        say(f"install: skipped (--no-install); wheel: {wheel}")
        return 0
    say(f"install: pip install {wheel.name} into {python}")
    install_wheel(python, wheel, log)
    verify(python)
    say("done")
    return 0


def _decide(args: argparse.Namespace, python: str, env: Mapping[str, str]) -> tuple[BuildKey, str | None]:
    """(the build key, the MPI compiler), each decision said on its own line."""
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
    return BuildKey(HOROVOD_VERSION, torch.version, python_tag(), platform.machine(), cxx_std, mpi, nccl), mpi_compiler


def _installed_already(args: argparse.Namespace, python: str, key: BuildKey) -> bool:
    """Whether the installed Horovod has this key and works (then nothing is to be done)."""
    if args.force:
        say("installed check: skipped (--force)")
    elif args.reinstall or args.no_install:
        say(f"installed check: skipped ({'--reinstall' if args.reinstall else '--no-install'})")
    else:
        ok, why = installed_status(python, key)
        if ok:
            say(f"nothing to do: {why} (same key; --force rebuilds)")
            return True
        say(f"installed check: {why}")
    return False


def _wheel(args: argparse.Namespace, python: str, env: Mapping[str, str], key: BuildKey, cache_dir: Path,
           mpi_compiler: str | None, log: Path, cached: Path | None) -> Path:
    """The cached wheel, or one built now (under a lock, so two concurrent runs build it once)."""
    if cached is not None:
        say(f"wheel: using cached {cached} (no rebuild)")
        return cached
    with file_lock(cache_dir / f".{key.dirname()}.lock"):
        wheel = None if args.force else cached_wheel(cache_dir, key)  # built meanwhile by another process?
        if wheel is not None:
            say(f"wheel: using cached {wheel} (built by a concurrent run)")
            return wheel
        say(("wheel: rebuilding (--force)" if args.force else "wheel: not in cache, building")
            + f"; build log: {log}")
        return _build(args, python, env, key, cache_dir, mpi_compiler, log)


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
