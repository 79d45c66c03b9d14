"""NIH ChestX-ray14 in its native layout: label table, official split lists, image archives.

Used both for the real release (``images_001.tar.gz`` … ``images_012.tar.gz``,
``Data_Entry_2017_v2020.csv``, ``train_val_list.txt``, ``test_list.txt``) and for the synthetic
"mini-NIH" phantom release of :mod:`chexflow.data.phantoms`, which has the same layout.

Nothing here imports torch or torchxrayvision.
"""
from __future__ import annotations

import gzip
import importlib.util
import logging
import tarfile
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pandas as pd

from chexflow.data.archives import ArchiveError, posix_basename, safe_members

log = logging.getLogger(__name__)

LABELS: tuple[str, ...] = (
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
    "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
)
NO_FINDING = "No Finding"
LABEL_CSV_NAME = "Data_Entry_2017_v2020.csv"
# columns of Data_Entry_2017_v2020.csv, in the order of the real file
CSV_COLUMNS: tuple[str, ...] = (
    "Image Index", "Finding Labels", "Follow-up #", "Patient ID", "Patient Age", "Patient Gender",
    "View Position", "OriginalImage[Width", "Height]", "OriginalImagePixelSpacing[x", "y]",
)
REQUIRED_COLUMNS: tuple[str, ...] = ("Image Index", "Finding Labels", "Patient ID")
SPLIT_NAMES = ("train", "val", "test")
SPLIT_SOURCE = ("official NIH split lists: test = test_list.txt; train and val = train_val_list.txt, "
                "val carved out by patient (seeded)")


@dataclass(frozen=True)
class ReleaseCounts:
    """What the release's tables contain, as published with ChestX-ray14 (README_CHESTXRAY.pdf,
    Wang et al. 2017): the label table's images and patients, and the two split lists' lengths."""
    n_images: int
    n_patients: int
    n_train_val: int
    n_test: int


PUBLISHED = ReleaseCounts(n_images=112_120, n_patients=30_805, n_train_val=86_524, n_test=25_596)


class NIHError(ValueError):
    """A label file, split list or split assignment is inconsistent; the message names the file."""


def display_name(label: str) -> str:
    """Human-readable label name: ``Pleural_Thickening`` -> ``Pleural Thickening``."""
    if label not in LABELS:
        raise KeyError(f"unknown NIH label {label!r}; known: {', '.join(LABELS)}")
    return label.replace("_", " ")


# --------------------------------------------------------------------------- label table

def labels_from_findings(findings: pd.Series, *, source: str = "<findings>") -> pd.DataFrame:
    """Turn 'Finding Labels' strings ('A|B', 'No Finding') into float32 0/1 columns in LABELS order."""
    if findings.isna().any():
        bad = list(findings.index[findings.isna()][:5])
        raise NIHError(f"{source}: empty 'Finding Labels' for {int(findings.isna().sum())} rows, e.g. {bad}")
    dummies = findings.astype(str).str.get_dummies(sep="|")
    dummies.columns = [c.strip() for c in dummies.columns]
    unknown = sorted(set(dummies.columns) - set(LABELS) - {NO_FINDING})
    if unknown:
        raise NIHError(f"{source}: unknown finding label(s) {unknown}; known: {list(LABELS)} and {NO_FINDING!r}")
    out = pd.DataFrame(0.0, index=findings.index, columns=list(LABELS), dtype=np.float32)
    for label in LABELS:
        if label in dummies.columns:
            out[label] = dummies[label].to_numpy(dtype=np.float32)
    return out


def read_label_table(csv_path: Path | str) -> pd.DataFrame:
    """The raw label CSV as strings (``.csv`` or ``.csv.gz``), with the required columns checked."""
    csv_path = Path(csv_path)
    if not csv_path.is_file():
        raise FileNotFoundError(f"{csv_path}: NIH label file not found")
    try:
        raw = pd.read_csv(csv_path, dtype=str, keep_default_na=False, na_values=[""])
    except (OSError, EOFError, zlib.error, pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise NIHError(f"{csv_path}: cannot read the label CSV ({exc})") from exc
    raw.columns = [c.strip() for c in raw.columns]
    missing = [c for c in REQUIRED_COLUMNS if c not in raw.columns]
    if missing:
        raise NIHError(f"{csv_path}: missing column(s) {missing}; found {list(raw.columns)}")
    if raw["Image Index"].isna().any() or raw["Patient ID"].isna().any():
        raise NIHError(f"{csv_path}: empty 'Image Index' or 'Patient ID' values")
    dup = raw["Image Index"][raw["Image Index"].duplicated()]
    if len(dup):
        raise NIHError(f"{csv_path}: {len(dup)} duplicate 'Image Index' values, e.g. {list(dup[:5])}")
    return raw


def read_labels(csv_path: Path | str) -> pd.DataFrame:
    """Read ``Data_Entry_2017*.csv[.gz]``: a DataFrame indexed by image name (index name ``image``)
    with column ``patient`` (str) and the 14 LABELS columns as float32 0/1 ("No Finding": all 0)."""
    raw = read_label_table(csv_path)
    labels = labels_from_findings(raw["Finding Labels"], source=str(csv_path))
    out = pd.DataFrame({"patient": raw["Patient ID"].astype(str).to_numpy()}, index=raw["Image Index"].to_numpy())
    out = pd.concat([out, labels.set_axis(out.index)], axis=1)
    out.index.name = "image"
    return out


def read_split_list(path: Path | str) -> list[str]:
    """Image names of an official split list (one per line; blank lines ignored)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: split list not found")
    names = [line.strip() for line in path.read_text().splitlines()]
    names = [n for n in names if n]
    if len(set(names)) != len(names):
        dup = pd.Series(names)
        raise NIHError(f"{path}: duplicate image names, e.g. {list(dup[dup.duplicated()][:5])}")
    return names


def assign_splits(labels: pd.DataFrame, train_val: Sequence[str], test: Sequence[str], *,
                  val_fraction: float, seed: int, strict: bool = True) -> pd.Series:
    """Image -> "train" / "val" / "test".

    Test is the official test list. Validation is carved out of the train_val list by patient:
    the sorted distinct patients of train_val are permuted with ``numpy.random.default_rng(seed)``
    and the first ``round(val_fraction * n_patients)`` of them (at least one when
    ``0 < val_fraction`` and there are two or more patients) go to "val".

    Errors (``NIHError``): a listed image without a label row, an image in both lists, a patient
    in both lists, and (``strict=True``) label rows in neither list. With ``strict=False`` those
    unlisted images are logged and left out of the result.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if "patient" not in labels.columns:
        raise NIHError("assign_splits: the label table has no 'patient' column (use read_labels)")
    tv = pd.Index(list(train_val))
    te = pd.Index(list(test))
    for name, idx in (("train_val list", tv), ("test list", te)):
        unknown = idx.difference(labels.index)
        if len(unknown):
            raise NIHError(f"{name}: {len(unknown)} image(s) have no label row, e.g. {list(unknown[:5])}")
    both = tv.intersection(te)
    if len(both):
        raise NIHError(f"{len(both)} image(s) are in both train_val and test lists, e.g. {list(both[:5])}")
    p_tv = labels.loc[tv, "patient"]
    p_te = labels.loc[te, "patient"]
    shared = sorted(set(p_tv) & set(p_te))
    if shared:
        raise NIHError(f"{len(shared)} patient(s) have images in both train_val and test lists, e.g. {shared[:5]}")
    unlisted = labels.index.difference(tv.append(te))
    if len(unlisted):
        msg = f"{len(unlisted)} labelled image(s) are in neither split list, e.g. {list(unlisted[:5])}"
        if strict:
            raise NIHError(msg)
        log.warning("%s; they are left out", msg)

    patients = np.array(sorted(set(p_tv)), dtype=object)
    n_val = int(round(val_fraction * len(patients)))
    if val_fraction > 0 and n_val == 0 and len(patients) >= 2:
        n_val = 1
    rng = np.random.default_rng(seed)
    val_patients = set(patients[rng.permutation(len(patients))[:n_val]])
    tv_split = np.where(p_tv.isin(val_patients).to_numpy(), "val", "train")
    split = pd.concat([pd.Series(tv_split, index=tv), pd.Series("test", index=te)])
    split = split.loc[labels.index.intersection(split.index, sort=False)]  # label-file order
    split.index.name = "image"
    split.name = "split"
    return split


def verify_tables(labels: pd.DataFrame, train_val: Sequence[str], test: Sequence[str], *,
                  expected: ReleaseCounts = PUBLISHED, where: str = "the NIH tables") -> None:
    """Check the label table and split lists against the release's published content.

    The tables have no published checksum, so they are checked by what they must contain:
    ``expected.n_images`` labelled images of ``expected.n_patients`` patients, split lists of
    ``expected.n_train_val`` and ``expected.n_test`` images, every listed image labelled, no image
    and no patient in both lists. Raises ``NIHError`` listing every difference. A pilot on part of
    the archives still needs the full tables (the split is defined by them).
    """
    tv, te = pd.Index(list(train_val)), pd.Index(list(test))
    found = ReleaseCounts(n_images=len(labels), n_patients=int(labels["patient"].nunique()),
                          n_train_val=len(tv), n_test=len(te))
    problems = [f"{f.name} is {getattr(found, f.name):,}, expected {getattr(expected, f.name):,}"
                for f in fields(ReleaseCounts) if getattr(found, f.name) != getattr(expected, f.name)]
    for list_name, idx in (("train_val_list.txt", tv), ("test_list.txt", te)):
        unknown = idx.difference(labels.index)
        if len(unknown):
            problems.append(f"{list_name} names {len(unknown)} image(s) without a label row, e.g. {list(unknown[:5])}")
    both = tv.intersection(te)
    if len(both):
        problems.append(f"{len(both)} image(s) are in both lists, e.g. {list(both[:5])}")
    shared = sorted(set(labels["patient"].reindex(tv).dropna()) & set(labels["patient"].reindex(te).dropna()))
    if shared:
        problems.append(f"{len(shared)} patient(s) have images in both lists, e.g. {shared[:5]}")
    if problems:
        raise NIHError(f"{where} are not the published ChestX-ray14 tables ({LABEL_CSV_NAME}, "
                       f"train_val_list.txt, test_list.txt): " + "; ".join(problems))


# --------------------------------------------------------------------------- archives

_TAR_READ_BYTES = 1 << 20


def _log_skip(member: str, reason: str) -> None:
    log.warning("skipping archive member %r: %s", member, reason)


def iter_archive(path: Path | str, *, on_skip: Callable[[str, str], None] | None = None
                 ) -> Iterator[tuple[str, bytes]]:
    """Stream ``(basename, bytes)`` for every ``.png`` member of a ``.tar.gz``, in archive order.

    Reads without extracting, in tarfile's streaming mode (``r|`` over a ``gzip`` stream), so an
    archive is read once, sequentially. Every member first passes ``tarfile.data_filter`` (the
    'data' extraction filter: ``..``, links pointing outside, device files are rejected); in
    addition absolute member names (which the filter would merely strip) are rejected and only
    regular files are accepted (no symlinks or hard links at all).
    Rejected members are reported through ``on_skip(member_name, reason)`` (default: a logged
    warning) and skipped; directories and non-PNG files are skipped silently.

    A truncated or corrupt archive raises ``ArchiveError`` naming it: the gzip stream is read to
    its end, so a missing gzip trailer or a CRC mismatch is detected even when the tar part ends
    on a member boundary.
    """
    path = Path(path)
    report = on_skip or _log_skip
    if not path.is_file():
        raise FileNotFoundError(f"{path}: archive not found")
    try:
        with gzip.open(path, "rb") as gz:
            # 1 MiB reads instead of tarfile's 10 KiB records: far fewer gzip calls per image
            with tarfile.open(fileobj=gz, mode="r|", bufsize=_TAR_READ_BYTES) as tar:
                for member in safe_members(tar, report):
                    if not member.name.lower().endswith(".png"):
                        continue
                    fh = tar.extractfile(member)
                    if fh is None:  # pragma: no cover - isfile() members always have data
                        report(member.name, "no data")
                        continue
                    data = fh.read()
                    yield posix_basename(member.name), data
            while gz.read(1 << 20):  # drain: verifies the gzip trailer (length and CRC)
                pass
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ArchiveError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from exc
    except OSError as exc:
        raise ArchiveError(f"{path}: cannot read archive ({exc})") from exc


# --------------------------------------------------------------------------- label CSV shipped with torchxrayvision

def find_label_csv() -> Path:
    """``Data_Entry_2017_v2020.csv.gz`` inside the installed torchxrayvision package (not imported)."""
    spec = importlib.util.find_spec("torchxrayvision")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "torchxrayvision is not installed, so its copy of the NIH label file "
            f"{LABEL_CSV_NAME}.gz cannot be found; install envs/requirements.txt "
            "(torchxrayvision==1.5.7) or pass the label CSV explicitly")
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / "data" / f"{LABEL_CSV_NAME}.gz"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"torchxrayvision is installed at {list(spec.submodule_search_locations)} but has no "
        f"data/{LABEL_CSV_NAME}.gz")
