"""Where a report comes from: git commit and dirty flag, host, date, package versions, SLURM job."""
from __future__ import annotations

import os
import platform
import socket
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

PROVENANCE_PACKAGES = ("torch", "torchvision", "horovod", "snakemake", "scikit-learn", "numpy", "pandas",
                       "matplotlib", "jinja2", "webdataset")


def package_versions(names: tuple[str, ...] = PROVENANCE_PACKAGES) -> dict[str, str]:
    """Installed distribution versions (``"not installed"`` when absent), plus python."""
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _git(repo_dir: Path, *args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def collect_provenance(repo_dir: Path | None) -> dict[str, Any]:
    """Git commit (``"unknown"`` without git/repo), dirty flag, host, UTC date, versions, SLURM job id."""
    commit = dirty = None
    if repo_dir is not None:
        commit = _git(Path(repo_dir), "rev-parse", "HEAD")
        if commit is not None:
            status = _git(Path(repo_dir), "status", "--porcelain", "--untracked-files=no")
            dirty = bool(status) if status is not None else None
    prov: dict[str, Any] = {
        "git_commit": commit or "unknown",
        "git_dirty": dirty,
        "host": socket.gethostname(),
        "date_utc": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "platform": platform.platform(),
        "packages": package_versions(),
    }
    if os.environ.get("SLURM_JOB_ID"):
        prov["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return prov

