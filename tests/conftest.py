"""Shared fixtures: a tiny demo dataset made by the real chain (phantom release -> verified
download from a file mirror -> patient-wise split -> shards -> manifest)."""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

# One thread per torch process, the workers' own included: the suite runs 3 xdist workers beside their
# subprocesses on a 2-core machine, and torch's default (a thread per core) in each worker made the
# threads of one parallel region wait on each other when the other worker had the second core: the
# in-process training tests took 3-4x their time alone, in CPU as much as in wall time (OpenMP
# waits spinning). Set before torch is imported here; subprocesses inherit it (cli_env).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "envs"))            # chexflow_install: the installers (build tooling)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chexflow.data.config import ShardConfig  # noqa: E402

VENV_BIN = Path(sys.executable).parent

# Shard verification stamps (chexflow.data.stamps) of this test process go to a folder of its own, not
# to the user's ~/.cache: the tests' shards come and go by the thousand. Tests of the stamps set their own.
if "CHEXFLOW_VERIFIED_DIR" not in os.environ:
    os.environ["CHEXFLOW_VERIFIED_DIR"] = tempfile.mkdtemp(prefix="chexflow-test-verified-")
    atexit.register(shutil.rmtree, os.environ["CHEXFLOW_VERIFIED_DIR"], ignore_errors=True)


# The suite runs on pytest-xdist workers (pyproject.toml: -n 3 --dist loadscope): a test file is one
# unit of work, so its module fixtures (a training run, a workflow) are built once; the SLURM files are
# one unit (one cluster). That unit and the container file mostly wait (on SLURM's scheduling; on the
# network and the disk while the image builds), so they start first and the other workers run the
# CPU-bound files beside them; test_workflow.py starts with them, as its tiny chain (made once per
# run, once_per_run) is what the container's run in the image is compared with. (xdist's own
# loadgroup does not group under pytest 9: it renames test ids through an attribute pytest 9 no
# longer reads; a scheduler of our own groups by file.)
FIRST_GROUPS = ("tests/test_container.py", "slurm", "tests/test_workflow.py")


def xdist_group(nodeid: str) -> str:
    """The unit of work of a test: its file, the SLURM files together."""
    path = nodeid.split("::", 1)[0]
    return "slurm" if Path(path).name.startswith("test_slurm") else path


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return FileGroups(config, log)


def pytest_collection_modifyitems(session, config, items):
    order = {group: i for i, group in enumerate(FIRST_GROUPS)}
    items.sort(key=lambda item: order.get(xdist_group(item.nodeid), len(order)))


# The CPU time of each test file, printed after the slowest tests (the suite on 2 cores is bound by CPU,
# and a test's wall time says little about its CPU: a SLURM test waits while a training test beside it
# computes). Each phase of a test (setup, call, teardown) is timed in the process that runs it: its
# own CPU and that of the processes it started and waited for (os.times counts a child once reaped;
# SLURM's jobs run under slurmd and are not counted).
CPU_FILES = 15                          # files listed
CPU_TESTS = 20                          # tests listed (set-up, call and teardown together)
_CPU_AT_START = pytest.StashKey[float]()
_cpu_by_file: dict[str, float] = {}
_cpu_by_test: dict[str, float] = {}


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _start_cpu_clock(item):
    item.stash[_CPU_AT_START] = _cpu_now()
    yield


# the same clock starts each of a test's three phases
pytest_runtest_setup = pytest_runtest_call = pytest_runtest_teardown = pytest.hookimpl(hookwrapper=True)(
    _start_cpu_clock)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _CPU_AT_START in item.stash:
        # a new list: the report's is the item's own, shared by its three phases
        report.user_properties = [*report.user_properties, ("cpu_s", _cpu_now() - item.stash[_CPU_AT_START])]


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "cpu_s":
            path = report.nodeid.split("::", 1)[0]
            _cpu_by_file[path] = _cpu_by_file.get(path, 0.0) + value
            _cpu_by_test[report.nodeid] = _cpu_by_test.get(report.nodeid, 0.0) + value


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not _cpu_by_file:
        return
    terminalreporter.write_sep("=", f"CPU time by test file (the {CPU_FILES} largest)")
    terminalreporter.write_line(f"{sum(_cpu_by_file.values()) / 60:.1f} CPU-minutes in all: the tests and the "
                                "processes they waited for (SLURM's jobs not counted)")
    for path, seconds in sorted(_cpu_by_file.items(), key=lambda kv: -kv[1])[:CPU_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_sep("=", f"CPU time by test (the {CPU_TESTS} largest; a module fixture's counts in "
                                    "the first test that used it)")
    for nodeid, seconds in sorted(_cpu_by_test.items(), key=lambda kv: -kv[1])[:CPU_TESTS]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")


def horovod_available() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


requires_horovod = pytest.mark.skipif(not horovod_available(),
                                      reason="horovod not built here (bash envs/setup.sh)")


def builds_images() -> bool:
    """Whether this host builds and runs chexflow's image (test_container.py's slow tests): root with buildah
    and mmdebstrap (envs/setup.sh --test installs them)."""
    return bool(shutil.which("buildah") and shutil.which("mmdebstrap") and os.geteuid() == 0)


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's file name, ``step-<step>-<run id>.pt`` (chexflow.train.checkpoint)."""
    return int(Path(path).name.split("-")[1])


def cli_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO / 'workflow'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def snakemake(workdir: Path, *args: str, cores: int = 2, timeout: float = 1500) -> subprocess.CompletedProcess:
    """The workflow with the workstation profile in ``workdir`` (a real ``snakemake`` process)."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--profile",
           str(REPO / "profiles/default"), "--cores", str(cores), *args]
    return subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def job_counts(stdout: str) -> dict[str, int]:
    """Jobs per rule from the "Job stats" table Snakemake prints (dry run or real run)."""
    return {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", stdout, re.M)}


def build_demo_dataset(root: Path, *, n_images: int = 240, image_size: int = 32, per_archive: int = 80,
                       samples_per_shard: int = 20, stored_size: int | None = None) -> Path:
    """The demo chain at toy scale through the package's own functions; returns the manifest path.
    ``stored_size``: the shards' side (default ``image_size``, the release's PNG side)."""
    from chexflow.data import download, registry, shards, sources
    from chexflow.data.phantoms.release import make_release
    release = root / "release"
    make_release(release, n_images=n_images, image_size=image_size, images_per_archive=per_archive,
                 test_fraction=0.25, seed=7)
    n_archives = -(-n_images // per_archive)
    src = registry.get_source("nih_demo", n_archives=n_archives)
    raw = root / "raw"
    for name in sources.file_names(src):
        download.fetch_source_file(src, name, raw, str(release), progress=False)
    cfg = ShardConfig(dataset="nih_demo", image_size=stored_size or image_size, samples_per_shard=samples_per_shard,
                      val_fraction=0.2, max_reject_fraction=0.0)
    return shards.build_dataset("nih_demo", raw, root / "shards", cfg, n_archives=n_archives)


@contextlib.contextmanager
def module_scratch(tmp_path_factory, request, name: str) -> Iterator[Path]:
    """The scratch directory of a module-scoped fixture (``tmp_path_factory.mktemp(name)``).

    pytest's ``tmp_path_retention_policy = "failed"`` covers ``tmp_path`` only. This removes the
    directory (training runs: hundreds of MB of checkpoints) when the fixture is torn down, unless a
    test failed while it was in use: then it stays to be looked at."""
    failed_before = request.session.testsfailed
    path = tmp_path_factory.mktemp(name)
    yield path
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)


def run_dir(tmp_path_factory) -> Path:
    """This pytest run's own directory, shared by its xdist workers (each worker's base directory is a
    folder in it, ``popen-gw<n>``); without xdist, the run's base directory itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """A directory made once per pytest run by ``make(directory)`` and read by any test file on any
    xdist worker: an end-to-end run that tests of several files read (each file is a unit of work of
    its own, on whichever worker takes it). The first caller makes it while holding a lock on it; the
    others wait for that and read what it made. A maker that raised leaves no directory behind, so
    the next caller makes it again (and fails the same way, in its own test). Readers must not
    change it: a test that changes a run works on a copy."""
    path = run_dir(tmp_path_factory) / f"once-{name}"
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes, or the process dies
        done = path / ".made"
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)     # a maker that died half-way
            path.mkdir()
            try:
                make(path)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            done.touch()
    return path


@pytest.fixture(scope="session")
def demo_manifest(tmp_path_factory) -> Path:
    return build_demo_dataset(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def fashion_manifest(tmp_path_factory) -> Path:
    """Fashion-MNIST t10k part only (10k real images) as a small pretraining set."""
    from chexflow.data import download, registry, shards, sources
    root = tmp_path_factory.mktemp("fmnist")
    src = registry.get_source("fashion_mnist")
    raw = root / "raw"
    for name in sources.file_names(src):
        download.fetch_source_file(src, name, raw, "/usr/share/datasets/fashion-mnist", progress=False)
    cfg = ShardConfig(dataset="fashion_mnist", image_size=32, samples_per_shard=1000, val_fraction=0.1,
                      max_reject_fraction=0.0)
    out = root / "shards"
    shards.split_dataset("fashion_mnist", raw, cfg, out / "splits.csv")
    shards.write_part("fashion_mnist", "t10k", raw, out / "splits.csv", out / "parts" / "t10k", cfg)
    # the t10k part is all 'test'; relabel its shards as train/val for a quick pretraining set
    import json
    m = json.loads((out / "parts" / "t10k" / "manifest.json").read_text())
    for i, sh in enumerate(m["shards"]):
        sh["split"] = "val" if i == 0 else "train"
    (out / "parts" / "t10k" / "manifest.json").write_text(json.dumps(m))
    shards.gather("fashion_mnist", [out / "parts" / "t10k" / "manifest.json"], out / "manifest.json", cfg)
    return out / "manifest.json"


def loader_workers(pid: int) -> list[int]:
    """The loader workers of process ``pid``: its descendants started by its fork server (the workers'
    parent), not the fork server itself (chexflow.data.workers)."""
    import psutil
    try:
        return sorted(p.pid for p in psutil.Process(pid).children(recursive=True) if p.ppid() != pid)
    except psutil.Error:
        return []
