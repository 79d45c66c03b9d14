"""NIH ChestX-ray14 in its native layout: label table, official split lists, image archives.

Used both for the real release (``images_001.tar.gz`` … ``images_012.tar.gz``,
``Data_Entry_2017_v2020.csv``, ``train_val_list.txt``, ``test_list.txt``) and for the synthetic
"mini-NIH" phantom release of :mod:`chexflow.data.phantoms`, which has the same layout.

Nothing here imports torch or torchxrayvision.
"""
from __future__ import annotations

import importlib.util
import io
import logging
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd

from chexflow.data.config import ShardConfig
from chexflow.data import images, table_rows, tables
# the release's image archives are read by chexflow.data.archives (imported here for its readers)
from chexflow.data.archives import ArchiveError, iter_archive, iter_members, posix_basename  # noqa: F401
from chexflow.data.dataset import Dataset, DatasetInfo, Report, ShardError
from chexflow.data.sources import RemoteFile, Source
from chexflow.fsutil import read_regular, read_text_regular

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
# The release's bounding boxes (BBox_List_2017.csv: 984 boxes of 880 images, 8 findings), in pixels
# of the release's PNGs, which are all PNG_SIDE x PNG_SIDE (README_CHESTXRAY.pdf); the file spells
# Infiltration "Infiltrate". Header: Image Index, Finding Label, Bbox [x, y, w, h] over four columns,
# then three empty ones.
BOX_LIST_NAME = "BBox_List_2017.csv"
BOX_HEADER = ("Image Index", "Finding Label", "Bbox [x", "y", "w", "h]", "", "", "")
BOX_SPELLING = {"Infiltration": "Infiltrate"}
PNG_SIDE = 1024
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


# --------------------------------------------------------------------------- the release's files
_NIH_HOW = (
    "The NIH ChestX-ray14 label and split files are in the NIH Box folder "
    "https://nihcc.app.box.com/v/ChestXray-NIHCC (Data_Entry_2017_v2020.csv, train_val_list.txt, "
    "test_list.txt); Data_Entry_2017_v2020.csv is also shipped inside the torchxrayvision wheel. "
    "Put them in a directory (or serve it over HTTP) and pass it as the mirror."
)
# (Box shared-link id, md5) of images_001.tar.gz ... images_012.tar.gz, as published with
# PyHealth's ChestX-ray14 loader (not verified by chexflow).
_NIH_ARCHIVES = (
    ("vfk49d74nhbxq3nqjg0900w5nvkorp5c", "fe8ed0a6961412fddcbb3603c11b3698"),
    ("i28rlmbvmfjbl8p2n3ril0pptcmcu9d1", "ab07a2d7cbe6f65ddd97b4ed7bde10bf"),
    ("f1t00wrtdk94satdfb9olcolqx20z2jp", "2301d03bde4c246388bad3876965d574"),
    ("0aowwzs5lhjrceb3qp67ahp0rd1l1etg", "9f1b7f5aae01b13f4bc8e2c44a4b8ef6"),
    ("v5e3goj22zr6h8tzualxfsqlqaygfbsn", "1861f3cd0ef7734df8104f2b0309023b"),
    ("asi7ikud9jwnkrnkj99jnpfkjdes7l6l", "456b53a8b351afd92a35bc41444c58c8"),
    ("jn1b4mw4n6lnh74ovmcjb8y48h8xj07n", "1075121ea20a137b87f290d6a4a5965e"),
    ("tvpxmn7qyrgl0w8wfh9kqfjskv6nmm1j", "b61f34cec3aa69f295fbb593cbd9d443"),
    ("upyy3ml7qdumlgk2rfcvlb9k6gvqq2pj", "442a3caa61ae9b64e61c561294d1e183"),
    ("l6nilvfa9cg3s28tqv1qc1olm3gnz54p", "09ec81c4c31e32858ad8cf965c494b74"),
    ("hhq8fkdgvcari67vfhs7ppg2w6ni4jze", "499aefc67207a5a97692424cf5dbeed5"),
    ("ioqwiy20ihqwyr8pf4c24eazhh281pbu", "dc9fda1757c2de0032b63347a7d2895c"),
)
NIH_TABLES = (LABEL_CSV_NAME, "train_val_list.txt", "test_list.txt")
NIH_N_ARCHIVES = len(_NIH_ARCHIVES)


def archive_name(i: int) -> str:
    """Name of the i-th (1-based) NIH image archive: ``images_001.tar.gz``."""
    return f"images_{i:03d}.tar.gz"


def _nih_tables() -> tuple[RemoteFile, ...]:
    label, *splits = NIH_TABLES
    return (RemoteFile(label, None, role="labels"),
            *(RemoteFile(s, None, role="split_list") for s in splits))


def _check_n_archives(source: str, n_archives: int | None) -> int:
    if n_archives is None:
        raise ValueError(f"source {source!r} needs n_archives (how many images_NNN.tar.gz the release has)")
    if isinstance(n_archives, bool) or not isinstance(n_archives, int) or n_archives < 1:
        raise ValueError(f"source {source!r}: n_archives must be a positive integer, got {n_archives!r}")
    if n_archives > 999:
        raise ValueError(f"source {source!r}: n_archives={n_archives} exceeds the images_NNN naming (max 999)")
    return n_archives


def _box_list() -> RemoteFile:
    """The box list: optional (datasets.nih.boxes), sha256 recorded on first download like the tables."""
    return RemoteFile(BOX_LIST_NAME, None, role="boxes")


def release_source(n_archives: int | None) -> Source:
    if n_archives is not None:
        raise ValueError(f"source 'nih' always has its {NIH_N_ARCHIVES} archives; a pilot on part of the "
                         "release is declared with datasets.nih.archives (e.g. [1, 2])")
    archives = tuple(
        RemoteFile(archive_name(i), f"https://nihcc.box.com/shared/static/{box_id}.gz", md5=md5, role="archive")
        for i, (box_id, md5) in enumerate(_NIH_ARCHIVES, start=1))
    return Source(name="nih", title="NIH ChestX-ray14 (NIH Clinical Center)",
                  files=archives + _nih_tables() + (_box_list(),), how_to_obtain=_NIH_HOW)


def demo_source(n_archives: int | None, name: str = "nih_demo", *, boxes: bool = True) -> Source:
    """A generated release's files (``boxes``: with its box list; a pretraining corpus has none)."""
    n = _check_n_archives(name, n_archives)
    archives = tuple(RemoteFile(archive_name(i), None, role="archive") for i in range(1, n + 1))
    return Source(
        name=name, title="Synthetic phantom release in the NIH ChestX-ray14 layout",
        files=archives + _nih_tables() + ((_box_list(),) if boxes else ()), checksums_file="SHA256SUMS",
        synthetic=True,
        how_to_obtain="The phantom release is generated locally (chexflow.data.phantoms); "
                      "pass the directory it was written to as the mirror.")


# --------------------------------------------------------------------------- label table

def labels_from_findings(findings: pd.Series, *, source: str = "<findings>", names: pd.Series | None = None):
    """Turn 'Finding Labels' strings ('A|B', 'No Finding') into float32 0/1 columns in LABELS order;
    a bad row is named by its image (``names``: the rows' 'Image Index') and its line in ``source``."""
    unknown = findings.fillna("").str.split("|").map(lambda r: sorted({s.strip() for s in r} - {*LABELS, NO_FINDING}))
    for bad, what in ((findings.isna(), "empty 'Finding Labels'"), (unknown.map(bool), "unknown finding(s) {}")):
        if bad.any():
            first, row, more = table_rows.first_bad(bad, source, "Image Index", names)
            raise NIHError(f"{source}: {row}: {what.format(unknown[first])}{more}; known: {list(LABELS)} + {NO_FINDING!r}")
    # the names as checked above, stripped: 'Mass | Nodule' and ' Mass' are Mass's column, not two columns
    names_only = findings.str.split("|").map(lambda r: "|".join(s.strip() for s in r))
    return names_only.str.get_dummies(sep="|").reindex(columns=list(LABELS), fill_value=0).astype(np.float32)


def read_label_table(csv_path: Path | str) -> pd.DataFrame:
    """The raw label CSV as strings (``.csv`` or ``.csv.gz``), with the required columns checked."""
    csv_path = Path(csv_path)
    if not csv_path.exists():     # a FIFO or a device: refused by name when read
        raise FileNotFoundError(f"{csv_path}: NIH label file not found")
    try:
        raw = pd.read_csv(io.BytesIO(read_regular(csv_path, what="label table")), dtype=str, keep_default_na=False,
                          na_values=[""], compression="gzip" if csv_path.suffix == ".gz" else None)
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
    labels = labels_from_findings(raw["Finding Labels"], source=str(csv_path), names=raw["Image Index"])
    out = pd.DataFrame({"patient": raw["Patient ID"].astype(str).to_numpy()}, index=raw["Image Index"].to_numpy())
    out = pd.concat([out, labels.set_axis(out.index)], axis=1)
    out.index.name = "image"
    return out


def read_split_list(path: Path | str) -> list[str]:
    """Image names of an official split list (one per line; blank lines ignored)."""
    path = Path(path)
    if not path.exists():     # a FIFO or a device: refused by name when read
        raise FileNotFoundError(f"{path}: split list not found")
    names = [line.strip() for line in read_text_regular(path, what="split list").splitlines()]
    names = [n for n in names if n]
    if len(set(names)) != len(names):
        dup = pd.Series(names)
        raise NIHError(f"{path}: duplicate image names, e.g. {list(dup[dup.duplicated()][:5])}")
    return names


def assign_splits(labels: pd.DataFrame, train_val: Sequence[str], test: Sequence[str], *,
                  val_fraction: float, seed: int, strict: bool = True) -> pd.Series:
    """Image -> "train" / "val" / "test".

    Test is the official test list. Validation is carved out of the train_val list by patient
    (``tables.carve``, with ``numpy.random.default_rng(seed)``).

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

    val_patients = tables.carve(p_tv, val_fraction, seed, stream=None)
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


# --------------------------------------------------------------------------- bounding boxes

def write_box_list(path: Path | str, boxes: Sequence[tuple[str, str, float, float, float, float]]) -> None:
    """``BBox_List_2017.csv`` in the release's layout from (image, label, x, y, w, h) rows (chexflow's
    label spellings; written with the file's own, e.g. Infiltrate)."""
    from chexflow.fsutil import write_bytes_atomic
    lines = [",".join(BOX_HEADER)]
    for image, label, x, y, w, h in boxes:
        if label not in LABELS:
            raise NIHError(f"{path}: unknown finding {label!r} for a box")
        lines.append(f"{image},{BOX_SPELLING.get(label, label)},{x:.6g},{y:.6g},{w:.6g},{h:.6g},,,")
    write_bytes_atomic(Path(path), ("\n".join(lines) + "\n").encode())


def read_box_list(path: Path | str, *, frame: int = PNG_SIDE) -> pd.DataFrame:
    """The release's box list as rows ``image, label, x, y, w, h`` (chexflow's label spellings), boxes
    in pixels of a ``frame`` x ``frame`` image. An untrusted file: a missing column, an unknown
    finding, a non-finite or non-positive size, or a box outside the frame fails naming the row."""
    path = Path(path)
    if not path.exists():     # a FIFO or a device: refused by name when read
        raise FileNotFoundError(f"{path}: box list not found")
    try:
        raw = pd.read_csv(io.BytesIO(read_regular(path, what="box list")), dtype=str, keep_default_na=False, header=0)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise NIHError(f"{path}: cannot read the box list ({exc})") from exc
    cols = [c.strip() for c in raw.columns]
    if len(cols) < 6 or tuple(cols[:6]) != BOX_HEADER[:6]:
        raise NIHError(f"{path}: expected the columns {list(BOX_HEADER[:6])}, found {cols[:6]}")
    raw = raw.iloc[:, :6].set_axis(["image", "label", "x", "y", "w", "h"], axis=1)
    spelled = {v: k for k, v in BOX_SPELLING.items()}
    raw["label"] = raw["label"].str.strip().map(lambda v: spelled.get(v, v))
    unknown = sorted(set(raw["label"]) - set(LABELS))
    if unknown:
        raise NIHError(f"{path}: unknown finding(s) {unknown}; known: {list(LABELS)} (Infiltrate for Infiltration)")
    nums = raw[["x", "y", "w", "h"]].apply(pd.to_numeric, errors="coerce")
    bad = ~np.isfinite(nums.to_numpy(float)).all(axis=1) | (nums["w"] <= 0).to_numpy() | (nums["h"] <= 0).to_numpy()
    outside = ((nums["x"] < 0) | (nums["y"] < 0) | (nums["x"] + nums["w"] > frame * 1.001)
               | (nums["y"] + nums["h"] > frame * 1.001)).to_numpy()
    for problem, rows in (("not a box (non-numeric, or width/height <= 0)", bad),
                          (f"outside the {frame} x {frame} px image", outside & ~bad)):
        if rows.any():
            i = int(np.flatnonzero(rows)[0])
            raise NIHError(f"{path}: row {i + 2} ({raw['image'].iloc[i]}, {raw['label'].iloc[i]}): {problem}; "
                           f"{int(rows.sum())} such row(s)")
    if (raw["image"].str.strip() == "").any():
        raise NIHError(f"{path}: empty 'Image Index' in row {int(np.flatnonzero(raw['image'].str.strip() == '')[0]) + 2}")
    return pd.concat([raw[["image", "label"]], nums.astype(float)], axis=1)


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


# --------------------------------------------------------------------------- the adapter (chexflow.data.registry)

def check_archives(archives: Sequence[int] | None) -> tuple[int, ...] | None:
    """A declared pilot subset of the release's archives (1-based numbers, e.g. ``[1, 2]``),
    sorted; ``None`` (the full release) stays ``None``."""
    if archives is None:
        return None
    if isinstance(archives, (str, bytes)) or not isinstance(archives, Sequence) or not archives:
        raise ShardError(f"datasets.nih.archives: expected a non-empty list of archive numbers 1..{NIH_N_ARCHIVES} "
                         f"or null (all), got {archives!r}")
    bad = [a for a in archives if isinstance(a, bool) or not isinstance(a, int) or not 1 <= a <= NIH_N_ARCHIVES]
    if bad:
        raise ShardError(f"datasets.nih.archives: {bad} not archive number(s) of the release (1..{NIH_N_ARCHIVES})")
    if len(set(archives)) != len(archives):
        raise ShardError(f"datasets.nih.archives: {list(archives)} lists an archive twice")
    return tuple(sorted(archives))


@dataclass(frozen=True)
class NIHDataset(Dataset):
    """ChestX-ray14 in its release layout: one shard job per ``images_NNN.tar.gz``, reading it and
    the label table; the split comes from the official lists (val carved out by patient).

    ``release_config`` set (``generated``): the synthetic phantom release
    (``chexflow.data.phantoms``), whose archive count is its own (``n_archives``) and whose tables
    are not the published ones. Otherwise the real release: its 12 archives (a pilot subset is
    ``ShardConfig.archives``), tables checked against the published content. ``patient_pool``: the generated release's pool of NIH patients
    (``phantoms.release.PATIENT_POOLS``; releases of different pools share no patient)."""
    name: str = "nih"
    stage: str = "finetune"
    split_roles: tuple[str, ...] = ("labels", "split_list")
    shard_options: tuple[str, ...] = ("max_member_mb", "max_image_megapixels")
    patient_pool: str = "finetune"

    def source_options(self) -> dict:
        if self.generated:
            return {}
        return {"archives": {"type": ["array", "null"], "minItems": 1, "uniqueItems": True,
                             "items": {"type": "integer", "minimum": 1, "maximum": NIH_N_ARCHIVES}},
                # BBox_List_2017.csv from the mirror (localisation scores); false: heatmaps without scores
                "boxes": {"type": "boolean"}}

    def evaluation_files(self, source: Source, boxes: bool = True) -> dict[str, RemoteFile]:
        """The label table (subgroups) and, unless ``datasets.nih.boxes: false``, the box list."""
        files = {"label_table": next(f for f in source.files if f.role == "labels")}
        if self.has_boxes and (self.generated or boxes):
            files["boxes"] = source.file(BOX_LIST_NAME)
        return files

    def box_frame(self) -> int | None:
        return None if self.generated else PNG_SIDE

    @property
    def has_boxes(self) -> bool:
        """Whether the release has a box list: the real one, and a generated release of fine-tuning data
        (evaluated with localisation); a generated pretraining corpus is never evaluated: none."""
        return not self.generated or self.stage == "finetune"

    def source(self, n_archives: int | None = None) -> Source:
        return demo_source(n_archives, self.name, boxes=self.has_boxes) if self.generated else release_source(n_archives)

    def parts(self, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
        """``images_001`` ... one per archive: ``n_archives`` of a generated release, else the
        12 of the real one or the declared pilot subset ``cfg.archives``."""
        if self.generated:
            chosen = range(1, (n_archives or 1) + 1)
        else:
            chosen = check_archives(cfg.archives) or range(1, NIH_N_ARCHIVES + 1)
        return [archive_name(i).removesuffix(".tar.gz") for i in chosen]

    def part_files(self, source: Source, part: str) -> list[RemoteFile]:
        return [source.file(f"{part}.tar.gz"), *(f for f in source.files if f.role == "labels")]

    def info(self, raw_dir: Path | None = None) -> DatasetInfo:
        if self.generated:
            title = ("mini-NIH synthetic phantoms (embedded demo)" if self.stage == "finetune" else
                     "mini-NIH synthetic phantoms, pretraining corpus (patients disjoint from the demo's)")
            return DatasetInfo(self.name, title, "multilabel", tuple(LABELS), True,
                               "the phantom release's own split lists (NIH layout)")
        return DatasetInfo(self.name, "NIH ChestX-ray14", "multilabel", tuple(LABELS), False, SPLIT_SOURCE)

    def split(self, raw_dir: Path, cfg: ShardConfig, *, expected: ReleaseCounts | None = None) -> pd.DataFrame:
        """``nih``: the tables are first checked against the published content (``expected``,
        default ``PUBLISHED``; ``verify_tables``), also for a pilot on part of the archives."""
        raw_dir = Path(raw_dir)
        label_csv, train_val_list, test_list = NIH_TABLES
        labels = read_labels(raw_dir / label_csv)
        train_val = read_split_list(raw_dir / train_val_list)
        test = read_split_list(raw_dir / test_list)
        if not self.generated:
            verify_tables(labels, train_val, test, expected=expected or PUBLISHED, where=f"{raw_dir}/")
        split = assign_splits(labels, train_val, test, val_fraction=cfg.val_fraction, seed=cfg.split_seed)
        return pd.DataFrame({"image": split.index, "patient": labels.loc[split.index, "patient"].values,
                             "split": split.values})

    def samples(self, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
                report: Report) -> Iterator[tuple]:
        """The key of a sample is the member's file name (the label table's ``Image Index``)."""
        split_of = dict(zip(splits["image"], splits["split"]))
        patient_of = dict(zip(splits["image"], splits["patient"]))
        table = read_labels(Path(raw_dir) / LABEL_CSV_NAME)
        targets = dict(zip(table.index, table[list(LABELS)].to_numpy(dtype=np.float32)))
        archive = f"{part}.tar.gz"
        for member, data in iter_members(Path(raw_dir) / archive, on_skip=report,
                                         max_member_bytes=images.million(cfg.max_member_mb)):
            fname = posix_basename(member)
            if fname not in split_of:
                report(member, "not in the label file or split lists")
                continue
            yield fname, str(patient_of[fname]), split_of[fname], targets[fname], data, f"{archive}:{member}"

    def decode(self, data: bytes, key: str, cfg: ShardConfig) -> np.ndarray:
        return images.decode_grey(data, name=key, size=cfg.image_size, max_pixels=images.million(cfg.max_image_megapixels))


ADAPTER = NIHDataset()
DEMO_ADAPTER = NIHDataset(name="nih_demo", release_config="demo_release")
# the demo's pretraining corpus: a second phantom release, patients from the other pool
DEMO_PRETRAIN_ADAPTER = NIHDataset(name="nih_demo_pretrain", stage="pretrain",
                                   release_config="demo_pretrain_release", patient_pool="pretrain")
