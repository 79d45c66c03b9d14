"""Pack decoded, resized images + labels into WebDataset tar shards, with manifests.

One job per source archive ("part") writes ``data/shards/<dataset>/parts/<part>/<split>-NNNNN.tar``
and ``parts/<part>/manifest.json``; a gather step writes ``data/shards/<dataset>/manifest.json``
with the per-split totals and shard lists. Few large files instead of many small PNGs (the PRACE
guide's advice for parallel file systems), and images stored as raw uint8 so training does not
decode PNGs again.

A part that crashes half-way resumes: every finished shard is recorded in ``progress.json``; a
rerun skips decoding the samples already in finished shards and writes only the missing ones.
Progress is keyed by the settings that shape the shards and the identity of the part's input
files (``part_key``): shards written with other settings or from another copy of the archive are
discarded (and logged), never resumed.

The gather checks coverage: every image named in the split table must have been found in some
archive (within ``max_missing_fraction``) unless a pilot subset of the archives was declared,
in which case the shortfall is expected and recorded.

Every archive member and image is untrusted. A part rejects (listing each in its manifest's
``rejects`` with the reason) members that are unsafe to read, larger than ``max_member_mb`` (never
read), or not in the split table, and images that are not a complete PNG or JPEG or declare more
than ``max_image_megapixels`` (``chexflow.data.images``). An image name found twice, within a
part or across parts, is an error naming both copies. A resumed part counts each reject once.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tarfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pandas as pd
from tqdm import tqdm

from chexflow import watchdog
from chexflow.data.config import ShardConfig
from chexflow.settings import to_dict
from chexflow.data import images, nih, registry
from chexflow.data.dataset import SPLITS, DatasetInfo, ShardError
from chexflow.data.part_progress import own_shard, resumable
from chexflow.fsutil import atomic_path, read_regular, sha256_file, write_text_atomic

# ShardConfig fields that do not change what a part's shards hold (thresholds checked afterwards,
# the pilot subset, which only decides which parts exist)
_KEY_EXCLUDED = ("max_reject_fraction", "max_missing_fraction", "archives")
MISSING_EXAMPLES = 10


def dataset_info(name: str, raw_dir: Path | None = None) -> DatasetInfo:
    """What a dataset is (its adapter's ``info``)."""
    return registry.get(name).info(raw_dir)


# --------------------------------------------------------------------------- splits

def split_dataset(name: str, raw_dir: Path, cfg: ShardConfig, out_csv: Path, *,
                  expected: nih.ReleaseCounts | None = None) -> pd.DataFrame:
    """Write ``splits.csv`` (image, patient, split) of the dataset's ``split``: patient-wise,
    seeded, never by image. ``expected``: for ``nih``, the published content the tables are
    checked against (default ``nih.PUBLISHED``)."""
    df = registry.get(name).split(Path(raw_dir), cfg, expected=expected)
    shared = df.groupby("patient")["split"].nunique()
    if (shared > 1).any():
        raise ShardError(f"{name}: patients in more than one split: {list(shared[shared > 1].index[:5])}")
    with atomic_path(out_csv) as tmp:
        df.to_csv(tmp, index=False)
    return df


def parts_of(name: str, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
    """The shard jobs of a dataset (its adapter's ``parts``)."""
    return registry.get(name).parts(cfg, n_archives)


# --------------------------------------------------------------------------- samples of a part

@dataclass
class Sample:
    key: str
    patient: str
    split: str
    target: np.ndarray            # float32[L] (NaN unknown) or int64 scalar
    image: np.ndarray | None      # uint8 HxW, None when the sample is skipped (already sharded)


@dataclass
class PartLog:
    """What reading a part found besides the samples it yields.

    ``rejects``: in stream order, each ``{"image", "part", "stage", "reason"}``: stage ``read`` for
    archive members that were not read as samples (unsafe, oversize, not in the split table;
    "image" is the member name), ``decode`` for samples whose image did not decode completely
    (also their "origin"). ``members``: image key -> origin (archive and member) of every sample,
    written or rejected at decode. ``duplicates``: (key, first origin, later origin) of keys that
    came again (the later copy is not used). ``earlier``: decode rejects of an earlier attempt of
    the part by key, counted again (once) when their sample is skipped instead of decoded again."""
    part: str
    rejects: list[dict] = field(default_factory=list)
    members: dict[str, str] = field(default_factory=dict)
    duplicates: list[tuple[str, str, str]] = field(default_factory=list)
    earlier: dict[str, dict] = field(default_factory=dict)

    def reject_member(self, member: str, reason: str) -> None:
        self.reject({"image": member, "part": self.part, "stage": "read", "reason": reason})

    def reject(self, record: dict, again: bool = False) -> None:
        """Keep a reject for the manifest and name it in the job's log at once (a part that then
        fails for too many rejects has named each); ``again``: one an earlier attempt found."""
        self.rejects.append(record)
        origin = f" ({record['origin']})" if record.get("origin") else ""
        tqdm.write(f"{self.part}: rejected {record['image']}{origin} at {record['stage']}"
                   f"{' by an earlier attempt' if again else ''}: {' '.join(str(record['reason']).split())}",
                   file=sys.stderr)


def _iter_part(name: str, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
               skip: dict[str, str | None], log: PartLog) -> Iterator[Sample]:
    """Yield the samples of one part in a deterministic order; decode lazily (skipped: image=None)."""
    skipping = {s: k is not None for s, k in skip.items()}

    def wanted(split: str, key: str) -> bool:
        # samples up to and including the last key of a finished shard are not decoded again
        if skipping.get(split):
            if key == skip[split]:
                skipping[split] = False
            return False
        return True

    dataset = registry.get(name)
    yield from _decoded(dataset.samples(raw_dir, part, splits, cfg, log.reject_member), log, wanted,
                        lambda data, key: dataset.decode(data, key, cfg))


def _decoded(items, log: PartLog, wanted, decode) -> Iterator[Sample]:
    """Samples from ``(key, patient, split, target, encoded bytes, origin)``: decoded unless already
    sharded (``wanted`` is False: image None); a key seen before goes to ``log.duplicates``,
    undecodable ones to ``log.rejects`` with the reason."""
    for key, patient, split, target, data, origin in items:
        if key in log.members:
            log.duplicates.append((key, log.members[key], origin))
            continue
        log.members[key] = origin
        if not wanted(split, key):
            if key in log.earlier:    # rejected by the attempt that wrote the skipped shards
                log.reject(log.earlier[key], again=True)
                continue
            yield Sample(key, patient, split, target, None)
            continue
        try:
            img = decode(data, key)
        except images.DecodeError as exc:
            log.reject({"image": key, "part": log.part, "stage": "decode", "origin": origin, "reason": str(exc)})
            continue
        yield Sample(key, patient, split, target, img)


def duplicates_error(where: str, duplicates: list[tuple[str, str, str]]) -> ShardError:
    """The error for image keys that came more than once (each would be a sample twice)."""
    shown = "; ".join(f"{key!r} in {first} and in {again}" for key, first, again in duplicates[:MISSING_EXAMPLES])
    more = f" (and {len(duplicates) - MISSING_EXAMPLES} more)" if len(duplicates) > MISSING_EXAMPLES else ""
    return ShardError(f"{where}: {len(duplicates)} image name(s) found more than once, which would put the same "
                      f"image in the split twice: {shown}{more}. Remove the extra copies from the archives.")


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def tar_key(key: str) -> str:
    """The WebDataset key of an image in a shard: its file name without the suffix where that is plain
    (the archive datasets' names); otherwise (a path with folders, spaces or more dots, as label-table
    datasets have) the path made plain plus a hash of it, so that two paths never share a key."""
    stem = Path(key).stem
    if "/" not in key and _PLAIN_KEY.fullmatch(stem):
        return stem
    plain = re.sub(r"[^A-Za-z0-9_-]+", "_", str(Path(key).with_suffix("")))[-80:]
    return f"{plain}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _encode(sample: Sample, encoding: str) -> dict:
    out = {"__key__": tar_key(sample.key)}
    if encoding == "raw":
        buf = io.BytesIO()
        np.save(buf, sample.image, allow_pickle=False)
        out["img.npy"] = buf.getvalue()
    else:
        from PIL import Image
        buf = io.BytesIO()
        Image.fromarray(sample.image).save(buf, format="PNG")
        out["img.png"] = buf.getvalue()
    buf = io.BytesIO()
    np.save(buf, np.asarray(sample.target), allow_pickle=False)
    out["target.npy"] = buf.getvalue()
    out["meta.json"] = json.dumps({"image": sample.key, "patient": sample.patient}).encode()
    return out


def write_tar(path: Path, samples: Iterable[dict]) -> None:
    """A shard: each sample's files (``{"__key__": key, ext: bytes, ...}``) as tar members ``<key>.<ext>``, in the
    order of the extensions, with fixed metadata (mode 0444, owner ``bigdata``, mtime 0, an integer: a float one
    makes tarfile add a pax header per member): reproducible bytes, the bytes webdataset's
    ``TarWriter(encoder=False, mtime=0)`` writes (tests/test_shards_loader.py compares them). Not that class:
    its module imports torch, 2 CPU s of each shard job's 3.7."""
    with open(path, "wb") as fh, tarfile.open(fileobj=fh, mode="w|") as tar:
        for sample in samples:
            watchdog.beat("sharding")
            key = sample["__key__"]
            for ext in sorted(k for k in sample if not k.startswith("_")):
                data = sample[ext]
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "bigdata", "bigdata"
                tar.addfile(info, io.BytesIO(data))


def _label_counts(targets: list[np.ndarray], info: DatasetInfo) -> dict[str, int]:
    if not targets:
        return {label: 0 for label in info.labels}
    arr = np.stack(targets)
    if info.task == "multiclass":
        c = Counter(int(t) for t in arr)
        return {label: c.get(i, 0) for i, label in enumerate(info.labels)}
    return {label: int(np.nansum(arr[:, i] == 1)) for i, label in enumerate(info.labels)}


def _unknown_counts(targets: list[np.ndarray], info: DatasetInfo) -> dict[str, dict[str, int]]:
    """``{"unknown_counts": {label: images whose label is unknown (NaN)}}`` when any is, else nothing (a
    release without unknown labels records no such key)."""
    if info.task != "multilabel" or not targets:
        return {}
    unknown = np.isnan(np.stack(targets).astype(np.float64)).sum(axis=0)
    return {"unknown_counts": dict(zip(info.labels, map(int, unknown)))} if unknown.any() else {}


def part_key(name: str, part: str, raw_dir: Path, splits_csv: Path, cfg: ShardConfig,
             n_archives: int | None = None) -> str:
    """Identity of what a part's shards hold: the shard settings (not the thresholds checked after
    writing), the split table's bytes, and each input file's name, size and mtime (a new download
    of an archive is a new input). ``n_archives``: a generated release's archive count (as the
    workflow configures it, never as many as happen to be in ``raw_dir``)."""
    settings = {k: v for k, v in to_dict(cfg).items() if k not in _KEY_EXCLUDED}
    inputs = []
    dataset = registry.get(name)
    for file in dataset.part_files(dataset.source(n_archives), part):
        st = (Path(raw_dir) / file.name).stat()
        inputs.append([file.name, st.st_size, st.st_mtime_ns])
    ident = {"dataset": name, "part": part, "settings": settings, "inputs": inputs,
             "splits_sha256": sha256_file(splits_csv)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def write_part(name: str, part: str, raw_dir: Path, splits_csv: Path, out_dir: Path,
               cfg: ShardConfig, *, n_archives: int | None = None, progress: bool = False) -> dict:
    """Write the shards of one source archive and its manifest; returns the manifest.

    The manifest lists, besides the shards, the listed images found in this part (``listed_found``:
    names in the split table that were written or rejected), which ``gather`` uses to check that
    every listed image was found in some archive, and the origin of every sample (``members``),
    which ``gather`` uses to find an image name in two parts. ``n_archives``: a generated release's
    archive count (required for one). An image name found twice in the part is a ``ShardError``
    naming both copies. ``progress``: a tqdm bar (images) on stderr."""
    if registry.get(name).generated and n_archives is None:
        raise ShardError(f"{name}/{part}: a generated release's shard job needs its archive count as configured "
                         "(write_part(n_archives=...), chexflow shards --n-archives), not the archives on disk")
    if part not in (parts := parts_of(name, cfg, n_archives)):
        raise ShardError(f"{name}: no part {part!r}; its parts are {parts}")
    key = part_key(name, part, Path(raw_dir), Path(splits_csv), cfg, n_archives)
    info = dataset_info(name, Path(raw_dir))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = pd.read_csv(io.BytesIO(read_regular(splits_csv, what="split table")), dtype=str)
    listed = set(splits["image"])
    progress_path = out_dir / "progress.json"
    done, earlier = resumable(out_dir, key)
    log = PartLog(part, earlier=earlier)
    rejects = log.rejects
    skip = {s: None for s in SPLITS}
    for s in done:
        skip[s["split"]] = s["last_key"]
    n_done = Counter(s["split"] for s in done)
    if done:
        print(f"{name}/{part}: resuming, {len(done)} shard(s) already written with the same settings and "
              "input, skipping their samples")

    buffers: dict[str, list[Sample]] = defaultdict(list)
    shard_records = list(done)

    def flush(split: str) -> None:
        batch = buffers.pop(split, [])
        if not batch:
            return
        fname = f"{split}-{n_done[split]:05d}.tar"
        n_done[split] += 1
        with atomic_path(out_dir / fname) as tmp:
            write_tar(tmp, (_encode(smp, cfg.encoding) for smp in batch))
        rec = {"file": fname, "split": split, "count": len(batch), "sha256": sha256_file(out_dir / fname),
               "last_key": batch[-1].key,
               "label_counts": _label_counts([b.target for b in batch], info),
               **_unknown_counts([b.target for b in batch], info),
               "patients": sorted({b.patient for b in batch}),
               "images": [b.key for b in batch if b.key in listed]}
        shard_records.append(rec)
        write_text_atomic(progress_path, json.dumps({"key": key, "shards": shard_records, "rejects": rejects}))

    bar = tqdm(desc=f"{name}/{part}", unit="img", file=sys.stderr, mininterval=5.0, disable=not progress)
    with bar:
        for smp in _iter_part(name, Path(raw_dir), part, splits, cfg, skip, log):
            bar.update()
            if smp.image is None:
                continue
            buffers[smp.split].append(smp)
            if len(buffers[smp.split]) >= cfg.samples_per_shard:
                flush(smp.split)
        for split in list(buffers):
            flush(split)

    if log.duplicates:
        raise duplicates_error(f"{name}/{part}", log.duplicates)
    n_total = sum(r["count"] for r in shard_records) + len(rejects)
    reject_fraction = len(rejects) / max(n_total, 1)
    if reject_fraction > cfg.max_reject_fraction:
        raise ShardError(
            f"{name}/{part}: {len(rejects)} of {n_total} images rejected ({reject_fraction:.2%} > "
            f"max_reject_fraction {cfg.max_reject_fraction:.2%}); first: {rejects[:3]}")
    found = sorted({i for r in shard_records for i in r["images"]} | ({r["image"] for r in rejects} & listed))
    manifest = {
        "dataset": name, "part": part, "image_size": cfg.image_size, "encoding": cfg.encoding,
        "task": info.task, "labels": list(info.labels), "key": key,
        "shards": [{k: r[k] for k in ("file", "split", "count", "sha256", "label_counts", "unknown_counts", "patients")
                    if k in r} for r in sorted(shard_records, key=lambda r: r["file"])],
        "rejects": rejects,
        "listed_found": found,
        "members": log.members,
    }
    write_text_atomic(out_dir / "manifest.json", json.dumps(manifest, indent=1))
    progress_path.unlink(missing_ok=True)
    return manifest


def build_dataset(name: str, raw_dir: Path, out_dir: Path, cfg: ShardConfig, *,
                  n_archives: int | None = None, expected: nih.ReleaseCounts | None = None) -> Path:
    """The whole shard stage in one process (split, every part, gather; the workflow runs these as
    separate jobs); returns the dataset manifest ``out_dir/manifest.json``."""
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    split_dataset(name, raw_dir, cfg, out_dir / "splits.csv", expected=expected)
    part_manifests = []
    for part in parts_of(name, cfg, n_archives):
        write_part(name, part, raw_dir, out_dir / "splits.csv", out_dir / "parts" / part, cfg, n_archives=n_archives)
        part_manifests.append(out_dir / "parts" / part / "manifest.json")
    gather(name, part_manifests, out_dir / "manifest.json", cfg, splits_csv=out_dir / "splits.csv")
    return out_dir / "manifest.json"


# --------------------------------------------------------------------------- gather

def coverage(name: str, splits_csv: Path, found: set[str], parts: list[str], cfg: ShardConfig,
             rejected: set[str] = frozenset()) -> dict:
    """How many of the images named in the split table were found in the gathered parts, and how many of
    those were used (``n_used``: found less the ``rejected`` ones: unreadable, too large, not an image).

    Full release (``cfg.archives`` None): more than ``max_missing_fraction`` of the listed images
    found in no archive is a ``ShardError`` naming the count and examples. A declared pilot subset
    (``cfg.archives``) expects the shortfall; it is reported (stderr and the returned record)."""
    table = pd.read_csv(io.BytesIO(read_regular(splits_csv, what="split table")), dtype=str)
    missing = ~table["image"].isin(found)
    n_listed, n_missing = len(table), int(missing.sum())
    n_rejected = int(table["image"].isin(rejected).sum())
    examples = table.loc[missing, "image"].head(MISSING_EXAMPLES).tolist()
    pilot = cfg.archives is not None
    per_split = {split: {"n_listed": int(len(g)), "n_found": int((~missing[g.index]).sum())}
                 for split, g in table.groupby("split", sort=False)}
    fraction = n_missing / max(n_listed, 1)
    if n_missing and not pilot and fraction > cfg.max_missing_fraction:
        raise ShardError(
            f"{name}: {n_missing:,} of the {n_listed:,} images named in the split lists ({fraction:.2%}) were found "
            f"in none of the {len(parts)} archives ({parts[0]} ... {parts[-1]}), more than max_missing_fraction "
            f"{cfg.max_missing_fraction:.2%}; e.g. {examples}. Are archives missing or truncated? For a pilot on "
            f"part of the release, declare it (datasets.{name}.archives).")
    if n_missing:
        what = f"pilot on {len(parts)} archive(s) {parts}: " if pilot else ""
        print(f"{name}: {what}{n_listed - n_missing:,} of {n_listed:,} listed images found, {n_missing:,} not "
              f"(e.g. {examples[:3]})", file=sys.stderr)
    if pilot:
        parts_of(name, cfg)   # a valid pilot subset of the release's parts
    release_parts = parts_of(name, replace(cfg, archives=None)) if pilot else parts
    return {"pilot": pilot, "archives": sorted(cfg.archives) if pilot else None,
            "parts": list(parts),
            "n_release_parts": len(release_parts),
            "n_listed": n_listed, "n_found": n_listed - n_missing, "n_missing": n_missing,
            "n_rejected": n_rejected, "n_used": n_listed - n_missing - n_rejected,
            "missing_examples": examples, "per_split": per_split}


def gather(name: str, part_manifests: list[Path], out_path: Path, cfg: ShardConfig, *,
           splits_csv: Path | None = None) -> dict:
    """Combine part manifests into the dataset manifest (per split: counts, patients, shards).

    With the split table (``splits_csv``, what the workflow passes) the manifest records per split
    how many listed images there are (``n_listed``) next to those used (``n_images``), and
    ``coverage`` (see ``coverage``: missing listed images are an error for a full release).
    An image name in two parts (two archives) is a ``ShardError`` naming both copies."""
    info = dataset_info(name)
    out_path = Path(out_path)
    root = out_path.parent
    splits: dict[str, dict] = {}
    n_rejects = 0
    n_images = 0
    patients: dict[str, set] = defaultdict(set)
    labels = list(info.labels)
    found: set[str] = set()
    rejected: set[str] = set()
    part_names: list[str] = []
    origin_of: dict[str, str] = {}
    duplicates: list[tuple[str, str, str]] = []
    for mpath in part_manifests:
        mpath = Path(mpath)
        try:
            m = json.loads(read_regular(mpath, what="part manifest"))
        except (OSError, ValueError) as exc:
            raise ShardError(f"{mpath}: unreadable part manifest ({exc})") from exc
        members = m.get("members") if isinstance(m, dict) else None
        if not isinstance(members, dict):
            raise ShardError(f"{mpath}: part manifest without its 'members' (written by an older chexflow?); "
                             "delete it and rerun the part")
        for key, origin in members.items():
            if key in origin_of:
                duplicates.append((key, origin_of[key], origin))
            else:
                origin_of[key] = origin
        if not labels:             # ImageNet: the classes of the devkit, recorded by every part
            labels = list(m["labels"])
        if list(m["labels"]) != labels:
            raise ShardError(f"{mpath}: its labels differ from the other parts' ({len(m['labels'])} vs {len(labels)})")
        n_rejects += len(m["rejects"])
        rejected.update(str(r.get("image")) for r in m["rejects"] if isinstance(r, dict))
        found.update(m.get("listed_found", []))
        part_names.append(m.get("part", mpath.parent.name))
        for sh in m["shards"]:
            if not own_shard(mpath.parent, sh["file"]):
                raise ShardError(f"{mpath}: lists shard {sh['file']!r}, which is not a regular file in its folder")
            rel = os.path.relpath(mpath.parent / sh["file"], root)
            s = splits.setdefault(sh["split"], {"n_images": 0, "label_counts": Counter(), "shards": []})
            s["n_images"] += sh["count"]
            n_images += sh["count"]
            s["label_counts"].update(sh["label_counts"])
            if sh.get("unknown_counts"):
                s.setdefault("unknown_counts", Counter()).update(sh["unknown_counts"])
            s["shards"].append({"path": rel, "count": sh["count"], "sha256": sh["sha256"]})
            patients[sh["split"]].update(sh["patients"])
    if duplicates:
        raise duplicates_error(f"{name}: the parts {part_names[0]} ... {part_names[-1]}", duplicates)
    overlap = {(a, b): len(patients[a] & patients[b]) for a in patients for b in patients if a < b}
    if any(overlap.values()):
        raise ShardError(f"{name}: patients shared between splits {overlap}")
    if n_rejects / max(n_images + n_rejects, 1) > cfg.max_reject_fraction:
        raise ShardError(f"{name}: {n_rejects} rejects exceed max_reject_fraction {cfg.max_reject_fraction}")
    cover = coverage(name, Path(splits_csv), found, part_names, cfg, rejected) if splits_csv is not None else None
    for split, s in splits.items():
        s["n_patients"] = len(patients[split])
        s["n_shards"] = len(s["shards"])
        s["label_counts"] = {label: int(s["label_counts"].get(label, 0)) for label in labels}
        if "unknown_counts" in s:
            s["unknown_counts"] = {label: int(s["unknown_counts"].get(label, 0)) for label in labels}
        if cover is not None and split in cover["per_split"]:
            s["n_listed"] = cover["per_split"][split]["n_listed"]
    manifest = {"dataset": name, "title": info.title, "synthetic": info.synthetic, "task": info.task,
                "labels": labels, "image_size": cfg.image_size, "encoding": cfg.encoding,
                "split_source": info.split_source,
                "splits": {k: splits[k] for k in SPLITS if k in splits}, "n_rejects": n_rejects,
                "coverage": cover}
    labelling = registry.get(name).labelling(cfg)
    if labelling is not None:      # how the label table's observations became targets
        manifest["labelling"] = labelling
    write_text_atomic(out_path, json.dumps(manifest, indent=1))
    return manifest
