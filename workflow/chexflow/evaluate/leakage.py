"""The test split evaluation scores, checked from its files: no test patient is a patient of the
splits training read, and the split's own digest recorded.

A model's run id covers what shapes its training, the train and val splits
(``chexflow.train.identity``), not the test split, which training never reads: test shards rebuilt
alone neither restart training nor make the model stale. What makes scoring it on the test split
sound is checked here instead: the patients of the train and val shards and of the test shards
(every shard checked against the manifest's sha256, the patients read from the samples'
``meta.json``) share none. The hash is the shard check's (``chexflow.data.manifest.verify_shards``):
a shard this process has checked, or whose verification stamp vouches for it (evaluation checks every
split it reads with the stamps first, and training stamped the train split), is not read again; what
is left is the small ``meta.json`` members.
"""
from __future__ import annotations

from pathlib import Path

from chexflow.data.manifest import ManifestError, read_manifest, split_shards
from chexflow.data.shard_reader import shard_patients
from chexflow.train.identity import TRAINING_SPLITS, split_summary

SHOWN = 5       # shared patients named in a refusal


class PatientLeakError(ManifestError):
    """Test patients that are also train or val patients (names the manifest and some of them)."""


def training_splits(manifest: Path) -> list[str]:
    """The splits training reads that ``manifest`` has (a test patient must be in none of them)."""
    return [s for s in TRAINING_SPLITS if s in (read_manifest(Path(manifest)).get("splits") or {})]


def checked_test_split(manifest: Path) -> dict:
    """The test split of ``manifest``: its digest, counts and the patients checked against it, after
    :class:`PatientLeakError` for any test patient that is a patient of a training split."""
    manifest = Path(manifest)
    present = training_splits(manifest)
    test = shard_patients(split_shards(manifest, "test"))
    checked = {}
    for split in present:
        patients = shard_patients(split_shards(manifest, split))
        shared = sorted(patients & test)
        if shared:
            more = f" and {len(shared) - SHOWN} more" if len(shared) > SHOWN else ""
            raise PatientLeakError(f"{manifest}: {len(shared)} test patient(s) are {split} patients too "
                                   f"({', '.join(shared[:SHOWN])}{more}): a model would be scored on patients it "
                                   "was trained or selected on; rebuild the dataset's split and shards")
        checked[split] = len(patients)
    summary = split_summary(manifest, "test")
    return {"sha256": summary["sha256"], "n_images": summary["n_images"], "n_patients": len(test),
            "n_shards": len(summary["shards"]), "patients_of": checked, "shared_patients": 0,
            "check": f"no test patient is a patient of {' or '.join(present)}, read from the shards"}
