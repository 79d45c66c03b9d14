"""Datasets described by a label table beside a folder of images (CheXpert, CSV-described folders):
reading the table, its observations under an uncertainty policy, its image paths, its patient-wise
split and the fields the subgroup audits use.

The table is untrusted: every row that cannot be read as the dataset's layout says is refused with
the file, its line and the column (``TableError``); an image path must lead to a file inside the
image folder (no absolute path, no ``..``, no symbolic link out of it). What a row's image file turns
out to be (missing, a link out of the folder, too large, not an image) is a reject of the shard stage
(named with its line), counted against ``max_reject_fraction``.

Observations (CheXpert's convention; Irvin et al., AAAI 2019): 1 positive, 0 negative, -1 uncertain,
blank not mentioned. The policy says what each becomes: an uncertain one positive (``ones``),
negative (``zeros``) or unknown (``ignore``: NaN, masked out of the loss and of that finding's
metrics on that image); a blank negative or unknown. The policy is recorded in the manifest
(``labelling``) and shown in the report.
"""
from __future__ import annotations

import csv
import io
import os
import posixpath
import re
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from chexflow.data import dicom, images
from chexflow.data.config import DEFAULT_POLICY, ShardConfig
from chexflow.data.dataset import RawSample, Report, ShardError
from chexflow.fsutil import NotRegularFile, check_regular, read_regular

UNCERTAIN_VALUE = {"ones": 1.0, "zeros": 0.0, "ignore": np.nan}
BLANK_VALUE = {"negative": 0.0, "ignore": np.nan}
# what an observation cell may hold: positive, negative, uncertain (as numbers; pandas reads text)
_CODES = {"1": 1.0, "1.0": 1.0, "0": 0.0, "0.0": 0.0, "-1": -1.0, "-1.0": -1.0}
SEXES = {"m": "M", "male": "M", "f": "F", "female": "F"}
LATERAL_VIEWS = {"lateral", "lat", "ll", "rl"}
FRONTAL_VIEWS = {"pa": "PA", "ap": "AP"}
MAX_AGE = 120
MAX_TABLE_BYTES = 1 << 30


class TableError(ValueError):
    """A label table does not hold what its dataset's layout says; names the file, line and column."""


# --------------------------------------------------------------------------- reading a table

def record_lines(data: bytes) -> tuple[int, list[tuple[int, int]]]:
    """The header's number of fields, and (line, number of fields) of each record after it: the line
    (1-based; the header is line 1) it starts on, blank lines skipped as pandas skips them (a quoted
    field may span lines)."""
    reader = csv.reader(io.StringIO(data.decode("utf-8"), newline=""))
    header = next(reader, [])
    out, start = [], reader.line_num + 1
    for record in reader:
        if record:
            out.append((start, len(record)))
        start = reader.line_num + 1
    return len(header), out


def read_table(path: Path | str, required: Sequence[str], *, what: str = "label table",
               shown: Path | str | None = None) -> pd.DataFrame:
    """The CSV ``path`` as strings (blank cells: ""), header names stripped, with a ``_line`` column
    (the line each row starts on); a missing required column or an unreadable file is a ``TableError``.
    ``shown``: the file messages name (a CSV dataset's table as the user gave it, not its copy)."""
    try:
        data = read_regular(path, max_bytes=MAX_TABLE_BYTES, what=what)   # a FIFO: "not a regular file"
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: {what} not found") from None
    path = Path(shown or path)
    try:
        width, lines = record_lines(data)
        wrong = [(line, n) for line, n in lines if n != width]
        if wrong:      # pandas would shift or pad such a row's cells, or stop without the line
            raise TableError(f"{path}: line {wrong[0][0]}: {wrong[0][1]} fields, but the header names {width} "
                             f"({len(wrong)} such record(s))")
        raw = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False, na_filter=False, index_col=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, csv.Error, zlib.error) as exc:
        raise TableError(f"{path}: cannot read the {what} as CSV ({' '.join(str(exc).split())})") from exc
    raw.columns = [str(c).strip() for c in raw.columns]
    missing = [c for c in required if c not in raw.columns]
    if missing:
        raise TableError(f"{path}: missing column(s) {missing}; found {list(raw.columns)}")
    if len(lines) != len(raw):
        raise TableError(f"{path}: {len(raw)} rows but {len(lines)} records (a stray quote?)")
    raw = raw.apply(lambda col: col.str.strip())
    raw["_line"] = [line for line, _ in lines]
    return raw


def where(path: Path | str, row: pd.Series, column: str, image_column: str | None = None) -> str:
    """``<file>: line N (<image>), column <column>``: the place of one cell, for messages."""
    image = f" ({row[image_column]})" if image_column and image_column in row else ""
    return f"{path}: line {row['_line']}{image}, column {column!r}"


def refuse_rows(bad: pd.Series, table: pd.DataFrame, path: Path | str, column: str, problem: str,
                image_column: str | None = None) -> None:
    """A ``TableError`` naming the first row where ``bad`` holds (and how many more), if any; ``{value!r}``
    in ``problem`` becomes that row's cell."""
    if not bad.any():
        return
    first = table.loc[bad.idxmax()]
    more = f" (and {int(bad.sum()) - 1} more row(s) like it)" if bad.sum() > 1 else ""
    raise TableError(f"{where(path, first, column, image_column)}: {problem.replace('{value!r}', repr(first[column]))}"
                     f"{more}")


# --------------------------------------------------------------------------- observations and the policy

def observations(table: pd.DataFrame, columns: Mapping[str, str], path: Path | str,
                 image_column: str) -> np.ndarray:
    """Float ``[N, F]`` of the findings' columns (``finding -> column``): 1, 0, -1 (uncertain) or NaN
    (blank); any other value is a ``TableError`` naming the line, image and column."""
    out = np.empty((len(table), len(columns)), dtype=np.float64)
    for j, (finding, column) in enumerate(columns.items()):
        cells = table[column]
        codes = cells.map(_CODES)
        refuse_rows(codes.isna() & (cells != ""), table, path, column,
                    f"{{value!r}} is not an observation of {finding!r} (1, 0, -1 uncertain or blank)", image_column)
        out[:, j] = codes.astype(float).to_numpy()
    return out


def resolve_policy(findings: Sequence[str], uncertain: Mapping[str, str]) -> dict[str, str]:
    """The uncertainty policy of each finding: its own entry, else ``default`` (``ignore`` without one)."""
    fallback = uncertain.get(DEFAULT_POLICY, "ignore")
    return {f: uncertain.get(f, fallback) for f in findings}


def policy_problems(findings: Sequence[str], uncertain: Mapping[str, str], key: str) -> list[str]:
    """``shards.<name>.uncertain`` naming a finding the dataset does not have: one problem each."""
    return [f"{key}.{name}: not a finding of this dataset (its findings: {', '.join(findings)}; "
            f"{DEFAULT_POLICY!r} covers the others)" for name in uncertain if name != DEFAULT_POLICY
            and name not in findings]


def targets(obs: np.ndarray, findings: Sequence[str], uncertain: Mapping[str, str], blank: str) -> np.ndarray:
    """float32 ``[N, F]`` targets of observations (``observations``) under the policy: 1 and 0 as they
    are, -1 by the finding's uncertainty policy, blank by ``blank``; NaN = unknown."""
    policy = resolve_policy(findings, uncertain)
    out = obs.copy()
    for j, finding in enumerate(findings):
        col = out[:, j]
        col[col == -1.0] = UNCERTAIN_VALUE[policy[finding]]
        col[np.isnan(obs[:, j])] = BLANK_VALUE[blank]
    return out.astype(np.float32)


def labelling(findings: Sequence[str], cfg: ShardConfig, notes: Sequence[str] = ()) -> dict:
    """What the manifest records of how the targets were made (the report shows it)."""
    return {"uncertain": resolve_policy(findings, cfg.uncertain), "blank": cfg.blank, "views": cfg.views,
            "notes": list(notes)}


# --------------------------------------------------------------------------- fields of the audits

def sexes(cells: pd.Series) -> pd.Series:
    """``M`` / ``F`` / "" (unknown) of a column of sexes (M, F, Male, Female; any case)."""
    return cells.str.lower().map(SEXES).fillna("")


# DICOM's Age String (PS3.5 6.2, Patient's Age 0010,1010): three digits and a unit, as PACS exports write it
DICOM_AGE = re.compile(r"^(\d{3})([DWMY])$")
YEARS_PER = {"D": 1 / 365.25, "W": 7 / 365.25, "M": 1 / 12, "Y": 1.0}
AGE_FORMATS = "years (45, 45.5), a top band (90+) or DICOM's nnnY/M/W/D (045Y, 006M)"


def ages(cells: pd.Series) -> pd.Series:
    """Ages in years as text ("" unknown): a number of years, ``90+`` (a de-identified top band, read as
    its lower bound) or DICOM's ``nnnY``/``M``/``W``/``D`` (``045Y`` 45, ``006M`` 0.5), in 0..MAX_AGE;
    what else a cell holds is unknown (``unread_ages`` counts it)."""
    text = cells.str.strip().str.upper()
    dicom_age = text.str.extract(DICOM_AGE)
    years = pd.to_numeric(text.str.removesuffix("+"), errors="coerce").where(~text.str.startswith("+"))
    coded = dicom_age[0].astype(float) * dicom_age[1].map(YEARS_PER)
    years = coded.where(dicom_age[0].notna(), years)
    years = years.where((years >= 0) & (years <= MAX_AGE))
    return years.map(lambda v: "" if pd.isna(v) else f"{round(v, 2):g}")


def unread_ages(cells: pd.Series, read: pd.Series, lines: pd.Series, path: Path | str, column: str,
                dataset: str) -> str | None:
    """The split log's line on the ``cells`` of ``column`` that hold something ``ages`` did not read
    (``read``: its result; ``lines``: each row's line): how many, the first and its line; None when every
    filled cell was read."""
    bad = (cells.str.strip() != "") & (read == "")
    if not bad.any():
        return None
    first = bad.idxmax()
    return (f"{dataset}: {int(bad.sum())} age(s) not read in {path}, column {column!r} (first: {cells[first]!r} on "
            f"line {lines[first]}): in no age group; an age is {AGE_FORMATS}, 0 to {MAX_AGE} years")


def views(cells: pd.Series) -> pd.Series:
    """``PA`` / ``AP`` / ``lateral`` / "" (unknown, e.g. a frontal image without its projection)."""
    low = cells.str.lower()
    return low.map(lambda v: "lateral" if v in LATERAL_VIEWS else FRONTAL_VIEWS.get(v, ""))


# --------------------------------------------------------------------------- image paths

_BAD_PATH = re.compile(r"[\x00-\x1f\\]")


def path_problem(rel: str) -> str | None:
    """Why ``rel`` is not a relative path inside the image folder (None: it is)."""
    if not rel:
        return "an empty image path"
    if _BAD_PATH.search(rel):
        return "a control character or backslash in the image path"
    if rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        return "an absolute image path (paths are relative to the image folder)"
    if ".." in rel.split("/"):
        return "'..' in the image path (it would lead out of the image folder)"
    return None


def refuse_paths(table: pd.DataFrame, column: str, path: Path | str) -> pd.Series:
    """The image column, normalised (``a/./b`` -> ``a/b``); a path that could lead out of the image
    folder is a ``TableError`` naming its line."""
    problems = table[column].map(path_problem)
    bad = problems.notna()
    if bad.any():
        refuse_rows(bad, table, path, column, f"{{value!r}}: {problems[bad.idxmax()]}")
    return table[column].map(posixpath.normpath)


def image_file(root: Path | str, rel: str, max_bytes: int) -> bytes:
    """The bytes of image ``rel`` under ``root``: a regular file inside the folder (no link leads out of
    it), at most ``max_bytes``; otherwise an ``OSError`` (``NotRegularFile`` for the refusals) saying why."""
    root = Path(root)
    path = root / rel
    real, inside = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, inside]) != inside:
        raise NotRegularFile(path, f"a symbolic link out of the image folder {root} (to {real})")
    size = check_regular(path).st_size
    if size > max_bytes:
        raise NotRegularFile(path, f"{size / 1e6:g} MB, more than max_member_mb ({max_bytes / 1e6:g} MB); not read")
    return read_regular(path, max_bytes=max_bytes, what="image")


def decode_any(data: bytes, key: str, cfg: ShardConfig) -> np.ndarray:
    """PNG, JPEG or DICOM to uint8 ``cfg.image_size`` square grey, as ``chexflow predict`` reads them."""
    limit = images.million(cfg.max_image_megapixels)
    if dicom.is_dicom(bytes(data[:132])):
        return images.resize_square(dicom.decode_dicom(data, name=key, max_pixels=limit), cfg.image_size)
    return images.decode_grey(data, name=key, size=cfg.image_size, max_pixels=limit)


# How an image file becomes a model's stored pixels, by the name a model file's ``predict.decoding``
# gives (``Dataset.decoding``): "grey" is PNG/JPEG to 8-bit grey, DICOM through its modality and VOI
# LUTs, the central square resized (PIL bilinear): the shard stage of NIH, CheXpert and CSV folders.
DECODINGS: dict[str, Callable[[bytes, str, ShardConfig], np.ndarray]] = {"grey": decode_any}


def read_samples(rows: pd.DataFrame, root: Path | str | None, table: Path | str, cfg: ShardConfig, report: Report,
                 target_of: Callable[[str], np.ndarray], folder_key: str) -> Iterator[RawSample]:
    """(key, patient, split, target, bytes, origin) of ``rows`` (columns image, patient, split, _line;
    ``target_of(key)``), images read from ``root``; a file that cannot be read goes to ``report`` with
    its line and the reason. ``folder_key``: the setting that names ``root``, for the message without one."""
    if root is None:
        raise ShardError(f"{table}: no image folder given ({folder_key})")
    limit = images.million(cfg.max_member_mb)
    for image, patient, split, line in zip(rows["image"], rows["patient"], rows["split"], rows["_line"]):
        origin = f"{table}: line {line}"
        try:
            data = image_file(root, image, limit)
        except OSError as exc:
            report(image, f"{origin}: {exc.strerror or exc}")
            continue
        yield image, str(patient), split, target_of(image), data, f"{origin} ({Path(root) / image})"


# --------------------------------------------------------------------------- splits

def one_split_per_patient(table: pd.DataFrame, path: Path | str, image_column: str) -> None:
    """A patient on both sides of a split is a ``TableError`` naming two of their rows."""
    n = table.groupby("patient")["split"].nunique()
    shared = n[n > 1]
    if shared.empty:
        return
    rows = table[table["patient"] == shared.index[0]].drop_duplicates("split").head(2)
    seen = "; ".join(f"line {r['_line']} ({r[image_column]}) in {r['split']}" for _, r in rows.iterrows())
    raise TableError(f"{path}: patient {shared.index[0]!r} is in more than one split: {seen} "
                     f"({len(shared)} such patient(s)); a patient's images must all be in one split")


def carve(patients: Sequence[str], fraction: float, seed: int, stream: int | None = 0) -> set[str]:
    """The patients (sorted, permuted by ``numpy.random.default_rng([seed, stream])``; ``stream`` None:
    ``default_rng(seed)``, NIH's split) of the first ``round(fraction * n)`` places, at least one when
    ``fraction > 0`` and two or more patients."""
    pool = np.array(sorted(set(patients)), dtype=object)
    n = int(round(fraction * len(pool)))
    if fraction > 0 and n == 0 and len(pool) >= 2:
        n = 1
    order = np.random.default_rng(seed if stream is None else [seed, stream]).permutation(len(pool))
    return set(pool[order[:n]])


def part_of(patients: pd.Series, n_parts: int) -> pd.Series:
    """The shard job (1..n) of each row: its patient's crc32 modulo ``n_parts`` (all of a patient's
    images in one job; the same on every machine)."""
    return patients.map(lambda p: zlib.crc32(str(p).encode()) % n_parts + 1)


def part_names(prefix: str, n_parts: int) -> list[str]:
    return [f"{prefix}_{i:03d}" for i in range(1, n_parts + 1)]


def part_number(part: str, prefix: str, n_parts: int, dataset: str) -> int:
    names = part_names(prefix, n_parts)
    if part not in names:
        raise ShardError(f"{dataset}: no part {part!r}; its parts are {names}")
    return names.index(part) + 1


def split_frame(table: pd.DataFrame, image_column: str) -> pd.DataFrame:
    """The split table the shard stage writes: image, patient, split and the audits' fields."""
    return pd.DataFrame({"image": table[image_column].to_numpy(), "patient": table["patient"].to_numpy(),
                         "split": table["split"].to_numpy(), "sex": table["sex"].to_numpy(),
                         "age": table["age"].to_numpy(), "view": table["view"].to_numpy()})


def keep_views(table: pd.DataFrame, cfg: ShardConfig) -> pd.DataFrame:
    """``views: frontal``: the lateral rows left out; ``all``: every row."""
    return table[table["view"] != "lateral"] if cfg.views == "frontal" else table
