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
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
from tqdm import tqdm

from chexflow.data.config import ShardConfig
from chexflow.settings import to_dict
from chexflow.data import images, nih, registry
from chexflow.data.dataset import DatasetInfo, ShardError
from chexflow.fsutil import atomic_path, sha256_file, write_text_atomic

SPLITS = ("train", "val", "test")
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


def _iter_part(name: str, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
               skip: dict[str, str | None], rejects: list[dict]) -> Iterator[Sample]:
    """Yield the samples of one part in a deterministic order; decode lazily (skipped: image=None)."""
    skipping = {s: k is not None for s, k in skip.items()}

    def wanted(split: str, key: str) -> bool:
        # samples up to and including the last key of a finished shard are not decoded again
        if skipping.get(split):
            if key == skip[split]:
                skipping[split] = False
            return False
        return True

    def skipped(member: str, reason: str) -> None:
        rejects.append({"image": member, "part": part, "reason": reason})

    dataset = registry.get(name)
    yield from _decoded(dataset.samples(raw_dir, part, splits, cfg, skipped), part, wanted, rejects,
                        lambda data, key: dataset.decode(data, key, cfg.image_size))


def _decoded(items, part: str, wanted, rejects: list[dict], decode) -> Iterator[Sample]:
    """Samples from ``(key, patient, split, target, encoded bytes)``: decoded unless already
    sharded (``wanted`` is False: image None); undecodable ones go to ``rejects`` with the reason."""
    for key, patient, split, target, data in items:
        if not wanted(split, key):
            yield Sample(key, patient, split, target, None)
            continue
        try:
            img = decode(data, key)
        except images.DecodeError as exc:
            rejects.append({"image": key, "part": part, "reason": str(exc)})
            continue
        yield Sample(key, patient, split, target, img)


def _encode(sample: Sample, encoding: str) -> dict:
    out = {"__key__": Path(sample.key).stem}
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


def _label_counts(targets: list[np.ndarray], info: DatasetInfo) -> dict[str, int]:
    if not targets:
        return {label: 0 for label in info.labels}
    arr = np.stack(targets)
    if info.task == "multiclass":
        c = Counter(int(t) for t in arr)
        return {label: c.get(i, 0) for i, label in enumerate(info.labels)}
    return {label: int(np.nansum(arr[:, i] == 1)) for i, label in enumerate(info.labels)}


def part_key(name: str, part: str, raw_dir: Path, splits_csv: Path, cfg: ShardConfig) -> str:
    """Identity of what a part's shards hold: the shard settings (not the thresholds checked after
    writing), the split table's bytes, and each input file's name, size and mtime (a new download
    of an archive is a new input)."""
    settings = {k: v for k, v in to_dict(cfg).items() if k not in _KEY_EXCLUDED}
    inputs = []
    dataset = registry.get(name)
    for file in dataset.part_files(dataset.source_in(Path(raw_dir)), part):
        st = (Path(raw_dir) / file.name).stat()
        inputs.append([file.name, st.st_size, st.st_mtime_ns])
    ident = {"dataset": name, "part": part, "settings": settings, "inputs": inputs,
             "splits_sha256": sha256_file(splits_csv)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _resumable(out_dir: Path, key: str) -> tuple[list[dict], list[dict]]:
    """(finished shard records, rejects) of an earlier attempt with the same ``key``; the shards
    of an attempt with another key are deleted and logged."""
    progress_path = out_dir / "progress.json"
    progress: dict = {}
    if progress_path.exists():
        try:
            progress = json.loads(progress_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"{progress_path}: unreadable ({exc}); starting the part afresh", file=sys.stderr)
        progress = progress if isinstance(progress, dict) else {}
    records = progress.get("shards", [])
    if progress.get("key") != key:
        stale = sorted(p.name for split in SPLITS for p in out_dir.glob(f"{split}-*.tar"))
        for fname in stale:
            (out_dir / fname).unlink()
        progress_path.unlink(missing_ok=True)
        if stale:
            was = "an attempt without a resume record" if "key" not in progress else f"key {progress['key'][:12]}"
            print(f"{out_dir}: discarded {len(stale)} shard(s) of an earlier attempt written with other settings "
                  f"or another copy of the input ({was}, now {key[:12]}): {stale[:5]}", file=sys.stderr)
        return [], []
    done = [r for r in records if (out_dir / r["file"]).exists()]
    return done, (list(progress.get("rejects", [])) if done else [])


def write_part(name: str, part: str, raw_dir: Path, splits_csv: Path, out_dir: Path,
               cfg: ShardConfig, *, progress: bool = False) -> dict:
    """Write the shards of one source archive and its manifest; returns the manifest.

    The manifest lists, besides the shards, the listed images found in this part (``listed_found``:
    names in the split table that were written or rejected), which ``gather`` uses to check that
    every listed image was found in some archive. ``progress``: a tqdm bar (images) on stderr."""
    import webdataset as wds     # imported here: split and gather need no torch (4 s -> 0.7 s per job)
    info = dataset_info(name, Path(raw_dir))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = pd.read_csv(splits_csv, dtype=str)
    listed = set(splits["image"])
    key = part_key(name, part, Path(raw_dir), Path(splits_csv), cfg)
    progress_path = out_dir / "progress.json"
    done, rejects = _resumable(out_dir, key)
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
            # reproducible bytes; an integer mtime (a float one makes tarfile add a pax header per member)
            with wds.TarWriter(str(tmp), encoder=False, mtime=0) as sink:
                for smp in batch:
                    sink.write(_encode(smp, cfg.encoding))
        rec = {"file": fname, "split": split, "count": len(batch), "sha256": sha256_file(out_dir / fname),
               "last_key": batch[-1].key,
               "label_counts": _label_counts([b.target for b in batch], info),
               "patients": sorted({b.patient for b in batch}),
               "images": [b.key for b in batch if b.key in listed]}
        shard_records.append(rec)
        write_text_atomic(progress_path, json.dumps({"key": key, "shards": shard_records, "rejects": rejects}))

    bar = tqdm(desc=f"{name}/{part}", unit="img", file=sys.stderr, mininterval=5.0, disable=not progress)
    with bar:
        for smp in _iter_part(name, Path(raw_dir), part, splits, cfg, skip, rejects):
            bar.update()
            if smp.image is None:
                continue
            buffers[smp.split].append(smp)
            if len(buffers[smp.split]) >= cfg.samples_per_shard:
                flush(smp.split)
        for split in list(buffers):
            flush(split)

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
        "shards": [{k: r[k] for k in ("file", "split", "count", "sha256", "label_counts", "patients")}
                   for r in sorted(shard_records, key=lambda r: r["file"])],
        "rejects": rejects,
        "listed_found": found,
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
        write_part(name, part, raw_dir, out_dir / "splits.csv", out_dir / "parts" / part, cfg)
        part_manifests.append(out_dir / "parts" / part / "manifest.json")
    gather(name, part_manifests, out_dir / "manifest.json", cfg, splits_csv=out_dir / "splits.csv")
    return out_dir / "manifest.json"


# --------------------------------------------------------------------------- gather

def coverage(name: str, splits_csv: Path, found: set[str], parts: list[str], cfg: ShardConfig) -> dict:
    """How many of the images named in the split table were found in the gathered parts.

    Full release (``cfg.archives`` None): more than ``max_missing_fraction`` of the listed images
    found in no archive is a ``ShardError`` naming the count and examples. A declared pilot subset
    (``cfg.archives``) expects the shortfall; it is reported (stderr and the returned record)."""
    table = pd.read_csv(splits_csv, dtype=str)
    missing = ~table["image"].isin(found)
    n_listed, n_missing = len(table), int(missing.sum())
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
            "missing_examples": examples, "per_split": per_split}


def gather(name: str, part_manifests: list[Path], out_path: Path, cfg: ShardConfig, *,
           splits_csv: Path | None = None) -> dict:
    """Combine part manifests into the dataset manifest (per split: counts, patients, shards).

    With the split table (``splits_csv``, what the workflow passes) the manifest records per split
    how many listed images there are (``n_listed``) next to those used (``n_images``), and
    ``coverage`` (see ``coverage``: missing listed images are an error for a full release)."""
    info = dataset_info(name)
    out_path = Path(out_path)
    root = out_path.parent
    splits: dict[str, dict] = {}
    n_rejects = 0
    n_images = 0
    patients: dict[str, set] = defaultdict(set)
    labels = list(info.labels)
    found: set[str] = set()
    part_names: list[str] = []
    for mpath in part_manifests:
        mpath = Path(mpath)
        try:
            m = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ShardError(f"{mpath}: unreadable part manifest ({exc})") from exc
        if not labels:             # ImageNet: the classes of the devkit, recorded by every part
            labels = list(m["labels"])
        if list(m["labels"]) != labels:
            raise ShardError(f"{mpath}: its labels differ from the other parts' ({len(m['labels'])} vs {len(labels)})")
        n_rejects += len(m["rejects"])
        found.update(m.get("listed_found", []))
        part_names.append(m.get("part", mpath.parent.name))
        for sh in m["shards"]:
            rel = os.path.relpath(mpath.parent / sh["file"], root)
            if not (root / rel).exists():
                raise ShardError(f"{mpath}: lists shard {sh['file']} which does not exist")
            s = splits.setdefault(sh["split"], {"n_images": 0, "label_counts": Counter(), "shards": []})
            s["n_images"] += sh["count"]
            n_images += sh["count"]
            s["label_counts"].update(sh["label_counts"])
            s["shards"].append({"path": rel, "count": sh["count"], "sha256": sh["sha256"]})
            patients[sh["split"]].update(sh["patients"])
    overlap = {(a, b): len(patients[a] & patients[b]) for a in patients for b in patients if a < b}
    if any(overlap.values()):
        raise ShardError(f"{name}: patients shared between splits {overlap}")
    if n_rejects / max(n_images + n_rejects, 1) > cfg.max_reject_fraction:
        raise ShardError(f"{name}: {n_rejects} rejects exceed max_reject_fraction {cfg.max_reject_fraction}")
    cover = coverage(name, Path(splits_csv), found, part_names, cfg) if splits_csv is not None else None
    for split, s in splits.items():
        s["n_patients"] = len(patients[split])
        s["n_shards"] = len(s["shards"])
        s["label_counts"] = {label: int(s["label_counts"].get(label, 0)) for label in labels}
        if cover is not None and split in cover["per_split"]:
            s["n_listed"] = cover["per_split"][split]["n_listed"]
    manifest = {"dataset": name, "title": info.title, "synthetic": info.synthetic, "task": info.task,
                "labels": labels, "image_size": cfg.image_size, "encoding": cfg.encoding,
                "split_source": info.split_source,
                "splits": {k: splits[k] for k in SPLITS if k in splits}, "n_rejects": n_rejects,
                "coverage": cover}
    write_text_atomic(out_path, json.dumps(manifest, indent=1))
    return manifest
