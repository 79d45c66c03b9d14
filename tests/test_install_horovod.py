"""Tests of chexflow_install.horovod (envs/): pure decisions and patches, plus (slow) a real 2-rank run."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from packaging.version import Version

from chexflow_install.horovod import cli, common, decide, patch, probe, wheel
from conftest import REPO

ROOT_CMAKE = textwrap.dedent(
    """\
    cmake_minimum_required(VERSION 3.13 FATAL_ERROR)
    project(horovod CXX)

    set(CMAKE_CXX_STANDARD 14)
    set(CMAKE_CXX_STANDARD_REQUIRED ON)

    # CUDA and ROCM
    if(DEFINED ENV{HOROVOD_CUDA_HOME})
        set(CMAKE_CUDA_COMPILER "$ENV{HOROVOD_CUDA_HOME}/bin/nvcc")
    endif()
    include(CheckLanguage)
    check_language(CUDA)
    if(NOT CMAKE_CUDA_COMPILER)
        find_package(CUDAToolkit)
        if(CUDAToolkit_BIN_DIR)
            set(CMAKE_CUDA_COMPILER "${CUDAToolkit_BIN_DIR}/nvcc")
            check_language(CUDA)
        endif()
    endif()
    if(CMAKE_CUDA_COMPILER)
        if(FOO)
            set(CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS} -std=c++11")
        endif()
        enable_language(CUDA)
    endif()

    if(HAVE_GLOO AND (DEFINED Tensorflow_CXX17 AND Tensorflow_CXX17))
        string(PREPEND GLOO_CMAKE "set(CMAKE_CXX_STANDARD 17)\\n")
    endif()
    """
)

TORCH_CMAKE = textwrap.dedent(
    """\
    parse_version(${Pytorch_VERSION} VERSION_DEC)
    if(NOT Pytorch_VERSION VERSION_LESS "1.5.0")
        set(CMAKE_CXX_STANDARD 14)
    endif()
    """
)

FIND_PYTORCH = textwrap.dedent(
    """\
    execute_process(COMMAND ${PY_EXE} -c "print(True)" OUTPUT_VARIABLE Pytorch_CUDA)
    string(REGEX REPLACE "No (CUDA|ROCm) runtime[^\\n]*\\n?" "" Pytorch_CUDA "${Pytorch_CUDA}")
    string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)
    if (Pytorch_CUDA OR Pytorch_ROCM)
        set(Pytorch_EXT "CUDAExtension")
    endif()
    """
)

CUDA_CMAKE = "set(CMAKE_CUDA_STANDARD 11)\nset(CMAKE_CUDA_STANDARD_REQUIRED ON)\n"

HEADER = textwrap.dedent(
    """\
    // Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
    #ifndef HOROVOD_COMMON_H
    #define HOROVOD_COMMON_H
    #include <string>
    #include <vector>
    struct X { uint8_t b; std::string s; };
    #endif
    """
)


def key(**over) -> decide.BuildKey:
    base = dict(horovod="0.28.1", torch="2.14.1+cu130", python="cp311", machine="x86_64",
                cxx_std=20, mpi=True, nccl=False)
    base.update(over)
    return decide.BuildKey(**base)


# ---------------------------------------------------------------- C++ standard


@pytest.mark.parametrize(
    "version, std",
    [("2.13.0", 17), ("2.13.1+cpu", 17), ("2.14.1+cu130", 20), ("2.14.0", 20), ("2.1.0", 17),
     ("2.0.1+cu118", 17), ("1.13.1", 17), ("2.15.0.dev20260101", 20), ("3.0.0", 20), ("2.14", 20)],
)
def test_choose_cxx_std(version, std):
    assert decide.choose_cxx_std(version) == std


def test_parse_torch_version_rejects_garbage():
    with pytest.raises(ValueError, match="torch version 'abc'"):
        decide.parse_torch_version("abc")


def test_set_cxx_standard_patches_statements_not_strings():
    out = patch.set_cxx_standard(ROOT_CMAKE, 20)
    assert "\nset(CMAKE_CXX_STANDARD 20)\n" in out
    assert "set(CMAKE_CXX_STANDARD 14)" not in out
    # the TF-compat gloo string is data, not a statement: left alone
    assert 'string(PREPEND GLOO_CMAKE "set(CMAKE_CXX_STANDARD 17)\\n")' in out
    assert patch.set_cxx_standard(out, 20) == out  # idempotent
    torch = patch.set_cxx_standard(TORCH_CMAKE, 17)
    assert "    set(CMAKE_CXX_STANDARD 17)\n" in torch
    assert patch.set_cxx_standard(torch, 17) == torch
    assert "CMAKE_CXX_STANDARD 20" in patch.set_cxx_standard(torch, 20)  # re-targetable


def test_set_cxx_standard_names_file_when_nothing_to_patch():
    with pytest.raises(common.InstallError, match="horovod/torch/CMakeLists.txt: no 'set"):
        patch.set_cxx_standard("project(x)\n", 20, source="horovod/torch/CMakeLists.txt")


def test_cuda_standard_patch():
    out = patch.set_cuda_standard(CUDA_CMAKE, 17)
    assert "set(CMAKE_CUDA_STANDARD 17)" in out and patch.set_cuda_standard(out, 17) == out


# ---------------------------------------------------------------- CUDA guards


def _balanced(text: str) -> bool:
    import re

    opens = len(re.findall(r"^\s*if\s*\(", text, re.M))
    closes = len(re.findall(r"^\s*endif\s*\(", text, re.M))
    return opens == closes


def test_guard_cuda_detection_wraps_whole_block_and_is_idempotent():
    out = patch.guard_cuda_detection(ROOT_CMAKE)
    assert _balanced(ROOT_CMAKE) and _balanced(out)
    guard = out.index(common.NO_CUDA_ENV)
    assert guard < out.index("check_language(CUDA)")
    assert out.index("enable_language(CUDA)") < out.index("endif()  # chexflow: CUDA detection guard")
    assert out.index("endif()  # chexflow: CUDA detection guard") < out.index("string(PREPEND")
    assert patch.guard_cuda_detection(out) == out


def test_guard_cuda_detection_missing_anchor():
    with pytest.raises(common.InstallError, match="CMakeLists.txt: cannot find"):
        patch.guard_cuda_detection("project(x)\n")


def test_guard_pytorch_cuda_idempotent():
    out = patch.guard_pytorch_cuda(FIND_PYTORCH)
    assert out.count("set(Pytorch_CUDA FALSE)") == 1
    assert out.index("set(Pytorch_CUDA FALSE)") < out.index("Pytorch_EXT")
    assert patch.guard_pytorch_cuda(out) == out
    assert _balanced(out)


# ---------------------------------------------------------------- includes


def test_add_includes_prepends_only_missing_and_is_idempotent():
    out = patch.add_includes(HEADER, ("cstdint", "stdexcept", "string"))
    assert out.startswith(patch.INCLUDE_BANNER)
    assert out.count("#include <cstdint>") == 1 and out.count("#include <stdexcept>") == 1
    assert out.count("#include <string>") == 1  # already there: not added again
    assert out.endswith(HEADER)
    assert patch.add_includes(out, ("cstdint", "stdexcept", "string")) == out


def test_add_includes_noop_when_all_present():
    text = "#include <cstdint>\n#  include <stdexcept>\nint x;\n"
    assert patch.add_includes(text, ("cstdint", "stdexcept")) == text


def test_missing_includes_table_only_standard_headers():
    allowed = {"cstdint", "stdexcept", "string"}
    for rel, headers in patch.MISSING_INCLUDES.items():
        assert rel.endswith((".h", ".cc")) and not rel.startswith("/")
        assert set(headers) <= allowed, rel


def _fake_tree(root: Path) -> None:
    contents = {
        "CMakeLists.txt": ROOT_CMAKE,
        "horovod/torch/CMakeLists.txt": TORCH_CMAKE,
        patch.FIND_PYTORCH_FILE: FIND_PYTORCH,
        patch.CUDA_STD_FILE: CUDA_CMAKE,
    }
    for rel in patch.MISSING_INCLUDES:
        contents.setdefault(rel, HEADER)
    for rel, text in contents.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_patch_source_tree_then_idempotent(tmp_path):
    _fake_tree(tmp_path)
    changed = patch.patch_source_tree(tmp_path, 20)
    assert set(changed) == set(patch.files_to_patch())
    assert "set(CMAKE_CXX_STANDARD 20)" in (tmp_path / "horovod/torch/CMakeLists.txt").read_text()
    assert "#include <cstdint>" in (tmp_path / "third_party/gloo/gloo/types.h").read_text()
    assert patch.patch_source_tree(tmp_path, 20) == []
    assert not list(tmp_path.rglob(".*.tmp*"))  # no temp files left behind


def test_patch_source_tree_names_missing_file(tmp_path):
    _fake_tree(tmp_path)
    (tmp_path / "third_party/gloo/gloo/types.h").unlink()
    with pytest.raises(common.InstallError, match="gloo/types.h: expected in the Horovod"):
        patch.patch_source_tree(tmp_path, 20)


# ---------------------------------------------------------------- keys, decisions, env


def test_cache_key_differs_per_field():
    base = key()
    variants = [key(mpi=False), key(nccl=True), key(cxx_std=17), key(torch="2.14.1+cpu"),
                key(torch="2.14.0+cu130"), key(python="cp312"), key(machine="aarch64"),
                key(horovod="0.28.0")]
    dirs = {base.dirname()} | {v.dirname() for v in variants}
    assert len(dirs) == len(variants) + 1
    versions = {base.version()} | {v.version() for v in variants if v.machine == base.machine}
    assert len(versions) == len(variants)  # machine is in the dir name only
    assert base == key()  # deterministic


def test_cache_key_is_filename_safe_and_a_valid_version():
    k = key(torch="2.14.1+cu130")
    assert "/" not in k.dirname() and " " not in k.dirname()
    assert k.dirname() == "horovod-0.28.1_torch-2.14.1+cu130_cp311_x86_64_cxx20_mpi1_nccl0"
    v = Version(k.version())
    assert v.public == "0.28.1" and v.local == k.local_version()
    assert str(v) == k.version()  # already normalised: compares equal to importlib.metadata's


def test_decide_mpi():
    assert decide.decide_mpi("auto", "/usr/bin/mpicxx", "(on PATH)")[0] is True
    assert decide.decide_mpi("auto", None, "")[0] is False
    assert decide.decide_mpi("no", "/usr/bin/mpicxx", "(on PATH)")[0] is False
    with pytest.raises(common.InstallError, match="--with-mpi yes"):
        decide.decide_mpi("yes", None, "")


def test_decide_nccl():
    assert decide.decide_nccl("auto", False)[0] is False
    assert decide.decide_nccl("auto", True)[0] is True
    assert decide.decide_nccl("yes", False)[0] is True
    assert decide.decide_nccl("no", True)[0] is False


def _exe(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_mpi_compiler(tmp_path):
    mpicxx = _exe(tmp_path / "mympicxx")
    assert decide.find_mpi_compiler({"MPICXX": str(mpicxx), "PATH": ""}) == (str(mpicxx), "(from $MPICXX)")
    show = {"HOROVOD_MPICXX_SHOW": f"{mpicxx} -show", "PATH": ""}
    assert decide.find_mpi_compiler(show)[0] == str(mpicxx)
    _exe(tmp_path / "mpicxx")
    assert decide.find_mpi_compiler({"PATH": str(tmp_path)}) == (str(tmp_path / "mpicxx"), "(on PATH)")
    assert decide.find_mpi_compiler({"PATH": str(tmp_path / "nothing")}) == (None, "")
    with pytest.raises(common.InstallError, match="MPICXX='/no/such'"):
        decide.find_mpi_compiler({"MPICXX": "/no/such", "PATH": ""})


def test_build_env_cpu_with_mpi():
    user = {"PATH": "/usr/bin", "HOROVOD_GPU_ALLREDUCE": "NCCL", "HOROVOD_WITHOUT_MPI": "1",
            "CXX": "g++-13", "HOROVOD_CUDA_HOME": "/opt/cuda"}
    env = decide.build_env(user, key(mpi=True, nccl=False), mpi_compiler="/opt/mpi/bin/mpicxx", jobs=4)
    assert env["HOROVOD_WITH_MPI"] == "1" and "HOROVOD_WITHOUT_MPI" not in env
    assert env["PATH"].split(os.pathsep)[0] == "/opt/mpi/bin"
    assert env[common.NO_CUDA_ENV] == "1"
    assert not any(k.startswith("HOROVOD_GPU") for k in env)
    assert env["HOROVOD_WITH_PYTORCH"] == "1" and env["HOROVOD_WITHOUT_TENSORFLOW"] == "1"
    assert env["HOROVOD_WITHOUT_MXNET"] == "1" and env["HOROVOD_WITH_GLOO"] == "1"
    assert env["MAKEFLAGS"] == "-j4" and env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert env["CXX"] == "g++-13"  # user's compiler passes through
    assert env["HOROVOD_LOCAL_VERSION"] == key(mpi=True, nccl=False).local_version()
    assert user["HOROVOD_WITHOUT_MPI"] == "1"  # input not mutated


def test_build_env_nccl_without_mpi_respects_user_settings():
    user = {"PATH": "/usr/bin", "MAKEFLAGS": "-j32", "CMAKE_POLICY_VERSION_MINIMUM": "3.10",
            "HOROVOD_CUDA_HOME": "/opt/cuda", "HOROVOD_WITH_MPI": "1"}
    env = decide.build_env(user, key(mpi=False, nccl=True), mpi_compiler=None, jobs=2, nccl_home="/x/nccl")
    assert env["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in env
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and common.NO_CUDA_ENV not in env
    assert env["CUDA_HOME"] == "/opt/cuda" and env["HOROVOD_NCCL_HOME"] == "/x/nccl"
    assert env["MAKEFLAGS"] == "-j32" and env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.10"
    assert env["PATH"] == "/usr/bin"


def test_resolve_cache_dir(tmp_path):
    home = tmp_path / "home"
    assert wheel.resolve_cache_dir(None, {}, home) == home / ".cache/chexflow/wheels"
    assert wheel.resolve_cache_dir(None, {"CHEXFLOW_WHEEL_CACHE": "/c"}, home) == Path("/c")
    assert wheel.resolve_cache_dir("/d", {"CHEXFLOW_WHEEL_CACHE": "/c"}, home) == Path("/d")


def test_store_and_find_cached_wheel(tmp_path):
    k = key()
    assert wheel.cached_wheel(tmp_path, k) is None
    built = tmp_path / "build" / f"horovod-{k.version()}-cp311-cp311-linux_x86_64.whl"
    built.parent.mkdir()
    built.write_bytes(b"PK fake")
    stored = wheel.store_wheel(built, tmp_path / "cache", k)
    assert stored.parent == tmp_path / "cache" / k.dirname() and stored.read_bytes() == b"PK fake"
    assert wheel.cached_wheel(tmp_path / "cache", k) == stored
    assert wheel.cached_wheel(tmp_path / "cache", key(mpi=False)) is None
    assert [p.name for p in stored.parent.iterdir()] == [stored.name]  # no temp file left


def test_cli_rejects_bad_choice(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--with-mpi", "maybe"])
    args = cli.parse_args(["--cxx-std", "17", "--with-nccl", "no", "--force"])
    assert args.cxx_std == 17 and args.with_nccl == "no" and args.force


# ---------------------------------------------------------------- slow: real Horovod


def _horovod_or_skip():
    try:
        import horovod.torch as hvd  # noqa: F401
    except Exception as err:  # ImportError, or a broken native extension
        pytest.skip(f"horovod.torch is not importable ({err}); run `bash envs/setup.sh` first")
    return hvd


def _run_module(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [str(REPO / "workflow"), str(REPO / "envs"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return subprocess.run([sys.executable, "-m", "chexflow_install.horovod", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


TRAIN_SCRIPT = textwrap.dedent(
    """\
    import sys
    from pathlib import Path

    import numpy as np
    import torch
    import horovod.torch as hvd

    out = Path(sys.argv[1])
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(1000 + rank)  # rank-dependent init: broadcast must fix it
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.save(out / f"init_rank{rank}.npy", flat())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    gen = torch.Generator().manual_seed(2000 + rank)  # rank-dependent data
    for _ in range(3):
        x = torch.randn(32, 8, generator=gen)
        y = torch.randint(0, 3, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    np.save(out / f"final_rank{rank}.npy", flat())
    print(f"rank {rank}/{hvd.size()} done")
    """
)


@pytest.mark.slow
@pytest.mark.horovod
def test_horovodrun_two_ranks_gloo_stay_in_sync(tmp_path):
    _horovod_or_skip()
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    horovodrun = probe.horovodrun_path(sys.executable)
    if not shutil.which(horovodrun):
        pytest.skip(f"{horovodrun} not found")
    proc = subprocess.run(
        [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final0, final1 = (np.load(tmp_path / f"final_rank{r}.npy") for r in (0, 1))
    init0, init1 = (np.load(tmp_path / f"init_rank{r}.npy") for r in (0, 1))
    assert not np.array_equal(init0, init1)  # the ranks really started apart
    assert np.array_equal(final0, final1)  # bit-identical after broadcast + averaged steps
    assert not np.array_equal(final1, init1)
    assert not np.array_equal(final0, init0)


@pytest.mark.slow
@pytest.mark.horovod
def test_second_install_uses_cache_without_rebuilding():
    _horovod_or_skip()
    plan = _run_module("--reinstall", "--dry-run")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    if "would install cached wheel" not in plan.stdout:
        pytest.skip("no cached wheel for this environment's key (horovod was installed another way)")
    proc = _run_module("--reinstall")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{common.SAY_PREFIX} wheel: using cached" in proc.stdout
    assert "building" not in proc.stdout and "build log" not in proc.stdout
    assert "hvd.init() ok" in proc.stdout


@pytest.mark.slow
@pytest.mark.horovod
def test_install_is_a_noop_when_installed_with_same_key():
    _horovod_or_skip()
    proc = _run_module("--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "installed horovod is" in proc.stdout:
        pytest.skip("the installed horovod was not built by chexflow_install.horovod for this key")
    assert f"{common.SAY_PREFIX} nothing to do:" in proc.stdout, proc.stdout
