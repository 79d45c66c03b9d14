"""Package phantoms as a release in the NIH ChestX-ray14 layout: which rows, which patients are
test, the images' archives, the label file and split lists, ``release.json`` and ``SHA256SUMS``.

Every random choice comes from its own stream of ``seed`` (numpy SeedSequence entropy
``[seed, stream, ...]``), and every image and every patient's anatomy from a stream keyed by its
name, so the same arguments give byte-identical files whatever the number of workers.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from chexflow.data import nih
from chexflow.data.phantoms.anatomy import Anatomy, sample_anatomy
from chexflow.data.phantoms.draw import Region, render
from chexflow.fsutil import atomic_path, sha256_file, write_bytes_atomic

GENERATOR = "chexflow.data.phantoms"
GENERATOR_VERSION = "2"      # 2: BBox_List_2017.csv (where each finding was drawn)
_STREAM_PATIENTS, _STREAM_ANATOMY, _STREAM_IMAGE, _STREAM_SPLIT = 0, 1, 2, 3
_RENDER_BATCH = 64        # images rendered per task (a worker's unit of work)


class ReleaseError(ValueError):
    """make_release was given impossible arguments; the message says which."""


@dataclass(frozen=True)
class ReleaseInfo:
    out_dir: Path
    n_images: int
    n_patients: int
    n_train_val: int
    n_test: int
    archives: tuple[str, ...]
    files: tuple[str, ...]        # every file listed in SHA256SUMS
    label_counts: dict[str, int]
    seed: int
    image_size: int


# --------------------------------------------------------------------------- one image

def image_rng(seed: int, name: str) -> np.random.Generator:
    """The RNG that renders image ``name`` of a release with ``seed``."""
    return np.random.default_rng([seed, _STREAM_IMAGE, _name_key(name)])


def patient_anatomy(seed: int, patient: str) -> Anatomy:
    """The anatomy of ``patient`` in a release with ``seed`` (shared by the patient's images)."""
    return sample_anatomy(np.random.default_rng([seed, _STREAM_ANATOMY, _name_key(patient)]))


def _name_key(name: str) -> int:
    """A stable 64-bit integer for a name (seed material, not a checksum)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def encode_png(img: np.ndarray) -> bytes:
    """8-bit grey PNG with fixed settings (no timestamps or text chunks: deterministic bytes)."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(img, mode="L").save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def _render_batch(args: tuple[int, int, bool, list[tuple[str, str, np.ndarray]]]) -> list[tuple[bytes, list[Region]]]:
    """PNGs and finding regions (when asked) of (image, patient, findings) rows (a worker's task:
    arguments in one picklable tuple)."""
    seed, size, regions, rows = args
    out, anatomy = [], {}
    for image, patient, findings in rows:
        if patient not in anatomy:
            anatomy[patient] = patient_anatomy(seed, patient)
        rendered = render(findings, size=size, rng=image_rng(seed, image), anatomy=anatomy[patient], regions=regions)
        out.append((encode_png(rendered.image), rendered.regions))
    return out


# --------------------------------------------------------------------------- rows and split

def _patient_findings(table: pd.DataFrame) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for pid, findings in zip(table["Patient ID"].astype(str), table["Finding Labels"].astype(str)):
        out.setdefault(pid, set()).update(f for f in findings.split("|") if f in nih.LABELS)
    return out


# The label file's patients are split once, by a hash of the Patient ID (independent of any seed),
# into two disjoint pools: the demo release (fine-tuning data) draws from "finetune", the demo's
# pretraining corpus from "pretrain", so no patient is in both whatever their seeds and sizes.
PATIENT_POOLS = ("finetune", "pretrain")


def patient_pool(patient: str) -> str:
    """The pool ("finetune" or "pretrain") that NIH patient ``patient`` belongs to (about half each)."""
    return PATIENT_POOLS[_name_key(f"pool/{patient}") % 2]


def pool_rows(table: pd.DataFrame, pool: str) -> pd.DataFrame:
    """The rows of ``table`` whose patient is in ``pool`` (one of PATIENT_POOLS)."""
    if pool not in PATIENT_POOLS:
        raise ReleaseError(f"patient pool must be one of {PATIENT_POOLS}, got {pool!r}")
    pid = table["Patient ID"].astype(str)
    return table[pid.map(patient_pool) == pool]


def sample_rows(table: pd.DataFrame, n_images: int, seed: int, *, min_patients_per_label: int = 12,
                max_images_per_patient: int = 8) -> pd.DataFrame:
    """Whole patients, seeded, until ``n_images`` rows (the last patient's later rows dropped if
    needed); rows keep the label file's order.

    Rare findings are guaranteed: first, for every finding from the rarest up, seeded-random
    patients (with at most ``max_images_per_patient`` images) who have it are taken until
    ``min_patients_per_label`` such patients are in; then the other patients in random order.
    The rows stay real NIH rows; only which patients are sampled is stratified, so that every
    finding has positives on both sides of the split (Hernia is 0.2% of NIH images).
    """
    if n_images > len(table):
        raise ReleaseError(f"n_images={n_images} exceeds the {len(table)} rows of the label file")
    rng = np.random.default_rng([seed, _STREAM_PATIENTS])
    patients = pd.unique(table["Patient ID"].astype(str))
    sizes = table.groupby(table["Patient ID"].astype(str), sort=False).size()
    findings = _patient_findings(table)
    order_all = [patients[i] for i in rng.permutation(len(patients))]
    prevalence = {label: sum(label in f for f in findings.values()) for label in nih.LABELS}
    first: list[str] = []
    taken: set[str] = set()
    budget = n_images // 2                      # stratification uses at most half the images
    used = 0
    for label in sorted(nih.LABELS, key=lambda lab: prevalence[lab]):
        have = sum(1 for p in first if label in findings[p])
        for p in order_all:
            if have >= min_patients_per_label or used >= budget:
                break
            if p in taken or label not in findings[p] or sizes[p] > max_images_per_patient:
                continue
            first.append(p)
            taken.add(p)
            used += int(sizes[p])
            have += 1
    order = first + [p for p in order_all if p not in taken]
    counts = sizes.loc[order].to_numpy()
    n_take = int(np.searchsorted(np.cumsum(counts), n_images) + 1)
    chosen = order[:n_take]
    pid = table["Patient ID"].astype(str)
    rows = table[pid.isin(set(chosen))]
    excess = len(rows) - n_images
    if excess > 0:
        last = rows.index[pid.loc[rows.index] == chosen[-1]]
        rows = rows.drop(last[len(last) - excess:])
    return rows


def split_patients(patients: list[str], test_fraction: float, seed: int,
                   findings: dict[str, set[str]] | None = None) -> set[str]:
    """Seeded patient-wise choice of the test patients (at least one, never all, when 2+ patients).

    With ``findings`` (patient -> findings) the choice is stratified: for every finding from the
    rarest up, about ``test_fraction`` of its not yet assigned patients go to test (at least one
    when it has two or more), so every finding is present in both train_val and test.
    """
    uniq = sorted(set(patients))
    n_test = int(round(test_fraction * len(uniq)))
    if len(uniq) >= 2:
        n_test = min(max(n_test, 1 if test_fraction > 0 else 0), len(uniq) - 1)
    rng = np.random.default_rng([seed, _STREAM_SPLIT])
    order = [uniq[i] for i in rng.permutation(len(uniq))]
    test: set[str] = set()
    assigned: set[str] = set()
    if findings and test_fraction > 0:
        prevalence = {lab: sum(lab in findings.get(p, ()) for p in uniq) for lab in nih.LABELS}
        for label in sorted(nih.LABELS, key=lambda lab: prevalence[lab]):
            group = [p for p in order if label in findings.get(p, ()) and p not in assigned]
            k = int(round(test_fraction * len(group)))
            if len(group) >= 2:
                k = min(max(k, 1), len(group) - 1)
            test.update(group[:k])
            assigned.update(group)
            if len(test) >= n_test:
                break
    for p in order:
        if len(test) >= n_test:
            break
        if p not in assigned:
            test.add(p)
            assigned.add(p)
    return test


# --------------------------------------------------------------------------- files

def write_archive(path: Path, members: list[tuple[str, bytes]]) -> None:
    """NIH-layout archive: ``images/`` then ``images/<name>``; fixed mtimes/owners: same bytes each run.

    The release's packaging, also used by tests that build a mirror in the exact NIH layout."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0,
                                                   compresslevel=6) as gz:
            with tarfile.open(fileobj=gz, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                folder = tarfile.TarInfo("images")
                folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, 0
                tar.addfile(folder)
                for name, data in members:
                    member = tarfile.TarInfo(f"images/{name}")
                    member.size, member.mode, member.mtime = len(data), 0o644, 0
                    member.uid = member.gid = 0
                    member.uname = member.gname = ""
                    tar.addfile(member, io.BytesIO(data))


def write_tables(out_dir: Path, rows: pd.DataFrame, train_val: list[str], test: list[str]) -> None:
    """The release's label file (the rows, all columns, verbatim) and its two split lists."""
    buf = io.StringIO()
    rows.to_csv(buf, index=False, lineterminator="\n")
    write_bytes_atomic(out_dir / nih.LABEL_CSV_NAME, buf.getvalue().encode())
    write_bytes_atomic(out_dir / "train_val_list.txt", "".join(n + "\n" for n in train_val).encode())
    write_bytes_atomic(out_dir / "test_list.txt", "".join(n + "\n" for n in test).encode())


def _write_archives(out_dir: Path, names: list[str], patients: list[str], labels: np.ndarray, *,
                    seed: int, image_size: int, images_per_archive: int, workers: int,
                    progress: bool, regions: bool) -> tuple[list[str], list[tuple]]:
    """Render every image and write ``images_NNN.tar.gz`` (``images_per_archive`` each, in row
    order); stale archives beyond these are removed. Returns the archive names and the finding
    regions as (image, label, x, y, w, h) rows in pixels of the rendered images."""
    n_images = len(names)
    chunks = [list(range(i, min(i + images_per_archive, n_images))) for i in range(0, n_images, images_per_archive)]
    batches = [(seed, image_size, regions, [(names[j], patients[j], labels[j]) for j in idx[k:k + _RENDER_BATCH]])
               for idx in chunks for k in range(0, len(idx), _RENDER_BATCH)]
    from tqdm import tqdm
    bar = tqdm(total=n_images, unit="img", desc="phantoms", disable=not progress)
    pool = None
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor
        pool = ProcessPoolExecutor(workers)
        rendered = pool.map(_render_batch, batches)
    else:
        rendered = map(_render_batch, batches)
    archives: list[str] = []
    boxes: list[tuple] = []
    try:
        for number, idx in enumerate(chunks, start=1):
            done: list[tuple[bytes, list[Region]]] = []
            while len(done) < len(idx):
                got = next(rendered)
                done.extend(got)
                bar.update(len(got))
            name = f"images_{number:03d}.tar.gz"
            write_archive(out_dir / name, [(names[j], png) for j, (png, _) in zip(idx, done)])
            archives.append(name)
            boxes += [(names[j], *r) for j, (_, drawn) in zip(idx, done) for r in drawn]
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()
    for stale in out_dir.glob("images_*.tar.gz"):
        if stale.name not in archives:
            stale.unlink()
    return archives, boxes


def _check_arguments(n_images: int, image_size: int, images_per_archive: int, test_fraction: float) -> None:
    if n_images < 1:
        raise ReleaseError(f"n_images must be positive, got {n_images}")
    if image_size < 8:
        raise ReleaseError(f"image_size must be at least 8, got {image_size}")
    if images_per_archive < 1:
        raise ReleaseError(f"images_per_archive must be positive, got {images_per_archive}")
    if not 0.0 <= test_fraction < 1.0:
        raise ReleaseError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n_archives = -(-n_images // images_per_archive)
    if n_archives > 999:
        raise ReleaseError(f"{n_archives} archives exceed the images_NNN naming (max 999); "
                           "raise images_per_archive")


# --------------------------------------------------------------------------- the release

def make_release(out_dir: Path | str, *, n_images: int, image_size: int, images_per_archive: int,
                 test_fraction: float, seed: int, pool: str = "finetune",
                 labels_csv: Path | str | None = None, workers: int = 1,
                 progress: bool = False, boxes: bool = True) -> ReleaseInfo:
    """Write a synthetic release in the NIH ChestX-ray14 layout to ``out_dir``; see the package doc.

    A stale ``SHA256SUMS`` is removed first and written last, so an interrupted run never looks
    complete; stale ``images_NNN.tar.gz`` beyond this release's archives are removed.
    ``workers`` > 1 renders in that many processes (same bytes as ``workers=1``). Patients are
    drawn only from ``pool`` (see ``patient_pool``): releases of different pools share no patient.
    ``boxes``: also write ``BBox_List_2017.csv``, where each finding shows (one more render per finding
    present: 1.3-1.6x the CPU; a pretraining corpus, never evaluated, goes without).
    """
    _check_arguments(n_images, image_size, images_per_archive, test_fraction)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "SHA256SUMS").unlink(missing_ok=True)

    src = Path(labels_csv) if labels_csv is not None else nih.find_label_csv()
    table = pool_rows(nih.read_label_table(src), pool)
    rows = sample_rows(table, n_images, seed)
    labels = nih.labels_from_findings(rows["Finding Labels"], source=str(src)).to_numpy(np.float32)
    names = rows["Image Index"].tolist()
    patients = rows["Patient ID"].astype(str).tolist()
    archives, found = _write_archives(out_dir, names, patients, labels, seed=seed, image_size=image_size,
                                      images_per_archive=images_per_archive, workers=workers, progress=progress,
                                      regions=boxes)

    # patient-wise official-style split
    test_patients = split_patients(patients, test_fraction, seed, findings=_patient_findings(rows))
    test = [n for n, p in zip(names, patients) if p in test_patients]
    train_val = [n for n, p in zip(names, patients) if p not in test_patients]
    write_tables(out_dir, rows, train_val, test)
    (out_dir / nih.BOX_LIST_NAME).unlink(missing_ok=True)
    if boxes:
        nih.write_box_list(out_dir / nih.BOX_LIST_NAME, found)   # where each finding shows, NIH's format

    label_counts = {label: int(labels[:, i].sum()) for i, label in enumerate(nih.LABELS)}
    meta = {
        "synthetic": True,
        "description": "Synthetic phantom chest radiographs in the NIH ChestX-ray14 layout; label rows "
                       "are real rows of the NIH label file, images are rendered phantoms.",
        "generator": GENERATOR, "generator_version": GENERATOR_VERSION,
        "seed": seed, "patient_pool": pool, "image_size": image_size, "images_per_archive": images_per_archive,
        "test_fraction": test_fraction,
        "n_images": n_images, "n_patients": len(set(patients)),
        "n_train_val_images": len(train_val), "n_test_images": len(test),
        "n_test_patients": len(test_patients), "archives": archives,
        "label_counts": label_counts,
        "n_boxes": len(found) if boxes else None, "box_frame": image_size if boxes else None,
        "labels_source": {"name": src.name, "sha256": sha256_file(src)},
    }
    write_bytes_atomic(out_dir / "release.json", (json.dumps(meta, indent=1) + "\n").encode())

    files = sorted([*archives, nih.LABEL_CSV_NAME, "train_val_list.txt", "test_list.txt", "release.json",
                    *([nih.BOX_LIST_NAME] if boxes else [])])
    sums = "".join(f"{sha256_file(out_dir / f)}  {f}\n" for f in files)
    write_bytes_atomic(out_dir / "SHA256SUMS", sums.encode())
    return ReleaseInfo(out_dir=out_dir, n_images=n_images, n_patients=len(set(patients)),
                       n_train_val=len(train_val), n_test=len(test), archives=tuple(archives),
                       files=tuple(files), label_counts=label_counts, seed=seed, image_size=image_size)
