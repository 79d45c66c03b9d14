"""Snakemake's own judges on the workflow: `snakefmt --check` (formatting of the Snakefile and
rules/*.smk, settings in pyproject.toml's [tool.snakefmt]) and `snakemake --lint` (rule hygiene:
log files, no path composition with `+`, ...). Both must have nothing to say."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from conftest import REPO, VENV_BIN, cli_env, snakemake

WORKFLOW_FILES = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]


def test_snakefmt_would_change_nothing():
    exe = shutil.which("snakefmt", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert exe, "snakefmt is not installed (envs/requirements.txt pins it: bash envs/setup.sh --test)"
    proc = subprocess.run([exe, "--check", "--diff", *map(str, WORKFLOW_FILES)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"snakefmt would reformat (run `snakefmt .`):\n{proc.stdout}{proc.stderr}"[-6000:]


def test_snakemake_lint_is_clean(tmp_path: Path):
    shutil.copy(REPO / "config.yaml", tmp_path / "config.yaml")
    proc = snakemake(tmp_path, "--lint", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Lints for" not in out, f"snakemake --lint:\n{out}"[-6000:]
