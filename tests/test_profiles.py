"""The Snakemake profiles: each is a directory with a `profile.yaml` (Snakemake >= 9.19's name for it),
Snakemake's own lookup finds that file, a dry run of the workflow applies its settings, and
`chexflow.profiles` (the merging overlay's helper) reads the same file."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO, cli_env, job_counts

from chexflow import profiles

PROFILE_DIRS = sorted(p for p in (REPO / "profiles").iterdir() if p.is_dir()) + [REPO / "tests/slurm_cluster/ci-overlay"]


def test_every_profile_is_a_profile_yaml_that_snakemake_finds():
    from snakemake.cli import get_profile_dir
    assert [p.name for p in PROFILE_DIRS[:3]] == ["default", "slurm", "slurm-overrides"]
    for directory in PROFILE_DIRS:
        assert sorted(f.name for f in directory.iterdir()) == ["profile.yaml"], directory
        assert get_profile_dir(str(directory)) == (directory, directory / "profile.yaml")
        assert profiles.profile_file(directory) == directory / "profile.yaml"


def test_the_snakemake_required_reads_profile_yaml():
    """9.19.0 is the first release whose profile lookup knows `profile.yaml` (9.18.2 reads only
    `config(.vN+).yaml`): pyproject's floor and the pinned version are both at or above it."""
    groups = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    req = next(Requirement(r) for r in groups["workflow"] if Requirement(r).name == "snakemake")
    assert Version("9.18.2") not in req.specifier and Version("9.19.0") in req.specifier
    pinned = re.search(r"^snakemake==(\S+)$", (REPO / "envs/requirements.txt").read_text(), re.M).group(1)
    assert Version(pinned) in req.specifier


def test_profile_file_prefers_profile_yaml_and_still_reads_an_older_config_yaml(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.yaml").write_text("set-resources: {a: {runtime: 5}}\n")
    assert profiles.profile_file(old) == old / "config.yaml"
    assert profiles.set_resources(old, {"a": {"mem_mb": 10}}) == {"a": {"runtime": 5, "mem_mb": 10}}
    (old / "profile.yaml").write_text("set-resources: {a: {runtime: 7}}\n")
    assert profiles.set_resources(old) == {"a": {"runtime": 7}}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(profiles.ProfileError, match=r"'.*empty'.*profile\.yaml or config\.yaml"):
        profiles.profile_file(empty)


def test_repository_profile_by_name_resolves_the_slurm_anchors():
    merged = profiles.set_resources("slurm", {"pretrain_model": {"runtime": 60}})
    pre = merged["pretrain_model"]
    assert (pre["runtime"], pre["nodes"], pre["gpu"], pre["tasks"], pre["slurm_partition"]) == (60, 2, 8, 8, "gpu")
    assert merged["finetune_model"]["gpu"] == 4 and merged["finetune_model"]["runtime"] == 720


def _dry_run(tmp_path, *args: str) -> str:
    (tmp_path / "config.yaml").write_text((REPO / "config.yaml").read_text())
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path),
                           *args, "-n"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_dry_run_with_the_default_profile_applies_its_settings(tmp_path):
    """`printshellcmds: true` is the profile's: without a profile a dry run prints no command."""
    plain = _dry_run(tmp_path, "--workflow-profile", "none", "--cores", "2")
    assert "Shell command:" not in plain
    out = _dry_run(tmp_path, "--profile", "profiles/default")
    assert "Using profiles profiles/default and workflow specific profile profiles/default" in out
    jobs = job_counts(out)
    assert out.count("Shell command:") == jobs["total"] > 20      # one per job


def test_dry_run_with_the_slurm_profiles_applies_their_resources(tmp_path):
    out = _dry_run(tmp_path, "--profile", "profiles/slurm", "--profile", "profiles/slurm-overrides")
    assert "Using profiles profiles/slurm and profiles/slurm-overrides and workflow specific profile" in out
    block = out.split("rule pretrain_model:", 1)[1].split("\n\n", 1)[0]
    resources = dict(re.findall(r"(\w+)=([^,\n]+)", block.split("resources: ", 1)[1].split("\n", 1)[0]))
    assert {k: resources[k] for k in ("slurm_partition", "nodes", "gpu", "tasks", "runtime", "slurm_extra")} == {
        "slurm_partition": "gpu", "nodes": "2", "gpu": "8", "tasks": "8", "runtime": "1440",
        "slurm_extra": "--signal=USR1@300"}
    assert "srun --mpi=pmix --kill-on-bad-exit=1 --gpu-bind=single:1 -n 8 chexflow train" in block
