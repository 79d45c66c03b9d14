"""Changing a few resources of a Snakemake profile without restating the rest.

Snakemake (9.x) takes a mapping-valued option (``set-resources``, ``default-resources``) given by
a later profile or on the command line as a whole: ``--set-resources pretrain_model:runtime=60``
replaces every rule's entry of ``profiles/slurm`` (pretraining then runs on the CPU partition with
one task and no warning signal). Profiles are YTE templates, so an overlay profile can compute the
merged mapping instead; ``profiles/slurm-overrides/profile.yaml`` is one:

    __use_yte__: true
    __definitions__:
      - from chexflow.profiles import set_resources
    __variables__:
      changes:                            # one line per rule that changes
        pretrain_model: {runtime: 60}
    set-resources: ?set_resources("slurm", changes)

    snakemake --profile profiles/slurm --profile profiles/slurm-overrides

Only the YAML reader is imported: Snakemake evaluates this while it reads its profiles.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO_PROFILES = Path(__file__).resolve().parents[2] / "profiles"


class ProfileError(ValueError):
    """A base profile that cannot be read or merged; the message names it."""


# A profile directory's file, in the order Snakemake (>= 9.19) looks for it: profile.yaml is the current
# name, config.yaml the older one it still reads.
PROFILE_FILE_NAMES = ("profile.yaml", "config.yaml")


def profile_file(base: str | Path) -> Path:
    """``base``'s YAML file: a profile file, a profile directory (its profile.yaml, or an older profile's
    config.yaml), or the name of one of this repository's profiles (``"slurm"`` = profiles/slurm)."""
    for candidate in (Path(base), REPO_PROFILES / str(base)):
        if candidate.is_file():
            return candidate
        for name in PROFILE_FILE_NAMES:
            if (candidate / name).is_file():
                return candidate / name
    raise ProfileError(f"profile {base!r}: no such profile file or directory with "
                       f"{' or '.join(PROFILE_FILE_NAMES)} (nor {REPO_PROFILES / str(base)})")


def _section(base: str | Path, key: str) -> dict:
    path = profile_file(base)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"{path}: cannot read profile ({exc})") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: not a profile (a YAML mapping of options)")
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise ProfileError(f"{path}: {key} is not a mapping")
    return section


def set_resources(base: str | Path, changes: dict[str, dict[str, Any]] | None = None, **rules: dict[str, Any]) -> dict:
    """``base``'s ``set-resources`` with ``changes`` (and keyword arguments, rule=mapping) merged in
    rule by rule and key by key: a rule's other resources, and the other rules, stay as they are."""
    merged = {rule: dict(values or {}) for rule, values in _section(base, "set-resources").items()}
    for rule, values in {**(changes or {}), **rules}.items():
        if not isinstance(values, dict):
            raise ProfileError(f"set-resources change for {rule!r}: expected a mapping of resources, got {values!r}")
        merged[rule] = {**merged.get(rule, {}), **values}
    return merged

