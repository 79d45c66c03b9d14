"""The wheel: its cache (one directory per build key), building it with pip, installing it."""
from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
import shutil
from typing import Iterator, Mapping

from chexflow.fsutil import atomic_path
from chexflow_install.horovod.common import InstallError, log_tail, run_logged, say
from chexflow_install.horovod.decide import BuildKey
from chexflow_install.horovod.probe import missing_modules

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


def resolve_cache_dir(arg: str | None, env: Mapping[str, str], home: Path) -> Path:
    if arg:
        return Path(arg).expanduser()
    if env.get("CHEXFLOW_WHEEL_CACHE"):
        return Path(env["CHEXFLOW_WHEEL_CACHE"]).expanduser()
    return home / ".cache" / "chexflow" / "wheels"



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
