"""Streaming shards per rank and per worker, without overlap, plus GPU-side augmentation.

Each epoch the shard list is shuffled with ``(seed, epoch)`` (the same on every rank), rank ``r``
takes shards ``r::world`` and its loader worker ``w`` takes ``w::workers`` of those, so every sample
is read exactly once per epoch across all ranks and workers. Inside a worker a shuffle buffer
seeded with ``(seed, epoch, rank, worker)`` mixes samples. Workers only unpack raw uint8 arrays
(or decode PNG); cropping, flipping and normalising run batched on the training device.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from chexflow.config import AugmentConfig


@dataclass(frozen=True)
class ShardRef:
    path: str
    count: int


class ManifestError(ValueError):
    """A dataset manifest is missing or lacks the split asked for."""


def read_manifest(path: Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read dataset manifest ({exc})") from exc


def split_shards(manifest_path: Path, split: str) -> list[ShardRef]:
    manifest_path = Path(manifest_path)
    m = read_manifest(manifest_path)
    if split not in m.get("splits", {}):
        raise ManifestError(f"{manifest_path}: no split {split!r} (has {sorted(m.get('splits', {}))})")
    root = manifest_path.parent
    return [ShardRef(str(root / s["path"]), int(s["count"])) for s in m["splits"][split]["shards"]]


def stage_shards(shards: list[ShardRef], dest: Path, *, copy: bool = True) -> list[ShardRef]:
    """Copy shards to node-local disk (the PRACE guide's advice); skip ones already there, same size.

    ``copy=False`` only maps the paths: the other ranks of a node wait for the one that copies.
    """
    dest = Path(os.path.expandvars(str(dest)))
    if copy:
        dest.mkdir(parents=True, exist_ok=True)
    out = []
    for s in shards:
        src = Path(s.path)
        target = dest / f"{hashlib.sha1(str(src.parent).encode()).hexdigest()[:10]}-{src.name}"
        if copy and not (target.exists() and target.stat().st_size == src.stat().st_size):
            tmp = target.with_name(target.name + ".part")
            shutil.copyfile(src, tmp)
            os.replace(tmp, target)
        out.append(ShardRef(str(target), s.count))
    return out


def assign_shards(shards: list[ShardRef], *, rank: int, world: int, epoch: int, seed: int,
                  shuffle: bool, worker: int = 0, workers: int = 1) -> list[ShardRef]:
    order = np.arange(len(shards))
    if shuffle:
        np.random.default_rng([seed, epoch]).shuffle(order)
    mine = order[rank::world][worker::max(workers, 1)]
    return [shards[i] for i in mine]


def samples_per_rank(shards: list[ShardRef], *, world: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    return [sum(s.count for s in assign_shards(shards, rank=r, world=world, epoch=epoch, seed=seed,
                                               shuffle=shuffle)) for r in range(world)]


def steps_per_epoch(shards: list[ShardRef], *, world: int, batch_size: int, seed: int, epoch: int,
                    samples_per_epoch: int | None = None) -> int:
    """Optimizer steps every rank can take this epoch (the same number on every rank)."""
    counts = samples_per_rank(shards, world=world, epoch=epoch, seed=seed, shuffle=True)
    per_rank = min(counts)
    if samples_per_epoch is not None:
        per_rank = min(per_rank, samples_per_epoch // world)
    steps = per_rank // batch_size
    if steps == 0:
        raise ManifestError(f"too little data for one step: {counts} samples per rank, batch {batch_size}, "
                            f"world {world} (use fewer ranks, a smaller batch or smaller shards)")
    return steps


_NPY_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int, int]] = {}


def _load_npy(buf: bytes) -> np.ndarray:
    """``np.load`` of one ``.npy`` payload, with the header parse cached.

    ``np.load`` parses every header with ``ast.literal_eval`` (a ``compile`` per sample, the
    largest single cost of reading raw shards); all images of a dataset share one header.
    """
    if buf[:6] == b"\x93NUMPY" and buf[6:7] in (b"\x01", b"\x02"):   # 3.0 (utf-8 header): np.load
        major = buf[6]
        start = 10 + int.from_bytes(buf[8:10], "little") if major == 1 else 12 + int.from_bytes(buf[8:12], "little")
        header = buf[:start]
        parsed = _NPY_HEADERS.get(header)
        if parsed is None:
            fp = io.BytesIO(header)
            version = np.lib.format.read_magic(fp)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(fp)
            if dtype.hasobject or fp.tell() != start:
                return np.load(io.BytesIO(buf), allow_pickle=False)
            if len(_NPY_HEADERS) > 256:
                _NPY_HEADERS.clear()
            parsed = _NPY_HEADERS[header] = (shape, fortran, dtype, start, int(np.prod(shape, dtype=np.int64)))
        shape, fortran, dtype, start, count = parsed
        if len(buf) - start < count * dtype.itemsize:
            raise ValueError(f"truncated .npy payload: {len(buf) - start} bytes for shape {shape} {dtype}")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
        return arr.reshape(shape, order="F" if fortran else "C").copy()
    return np.load(io.BytesIO(buf), allow_pickle=False)


def _decode(sample: dict) -> tuple[torch.Tensor, torch.Tensor, str]:
    if "img.npy" in sample:
        img = _load_npy(sample["img.npy"])
    else:
        from PIL import Image
        img = np.asarray(Image.open(io.BytesIO(sample["img.png"])).convert("L"))
    target = _load_npy(sample["target.npy"])
    meta = json.loads(sample["meta.json"])
    return torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.asarray(target)), meta["patient"] + "\t" + meta["image"]


class ShardReadError(ValueError):
    """A shard is not a readable tar; the message names the file and the offset."""


_ZERO_BLOCK = bytes(512)


def _tar_number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:                       # GNU base-256
        return int.from_bytes(field[1:], "big")
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _pax_records(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8")
        pos += length
    return out


def _iter_tar_files(fh, path: str) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of the regular files of an uncompressed tar (ustar, pax, GNU long names),
    read sequentially with one ``read`` per header and per member: several times faster than
    ``tarfile``'s streaming mode for shards of many small members. Header checksums are verified."""
    pending: dict[str, str] = {}
    offset = 0
    while True:
        hdr = fh.read(512)
        if not hdr or hdr == _ZERO_BLOCK:
            return
        if len(hdr) < 512:
            raise ShardReadError(f"{path}: truncated tar header at byte {offset}")
        try:
            stored = _tar_number(hdr[148:156])
            size = _tar_number(hdr[124:136])
        except ValueError:
            raise ShardReadError(f"{path}: not a tar header at byte {offset}") from None
        if stored != sum(hdr) - sum(hdr[148:156]) + 8 * 32:
            raise ShardReadError(f"{path}: tar header checksum mismatch at byte {offset}")
        kind = hdr[156:157]
        name = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if hdr[257:263] == b"ustar\0" and hdr[345:346] != b"\0":   # POSIX prefix (GNU keeps atime there)
            name = hdr[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape") + "/" + name
        if "size" in pending:
            size = int(pending["size"])
        padded = size + (-size) % 512
        data = fh.read(padded)
        if len(data) < padded:
            raise ShardReadError(f"{path}: truncated tar member {name!r} at byte {offset}")
        offset += 512 + padded
        data = data[:size] if padded != size else data
        if kind == b"x":                                    # pax header of the next member
            pending = _pax_records(data)
            continue
        if kind == b"g":
            continue
        if kind == b"L":                                    # GNU long name of the next member
            pending = {**pending, "path": data.rstrip(b"\0").decode("utf-8", "surrogateescape")}
            continue
        name = pending.get("path", name)
        pending = {}
        if kind in (b"0", b"\0", b"7"):
            yield name, data


def iter_shard(path: str) -> Iterator[dict]:
    """The samples of one shard: dicts ``{"__key__", "__url__", "<ext>": bytes, ...}`` grouped by
    key (the file name up to its first dot), as ``webdataset``'s ``group_by_keys`` does.
    Compressed shards (not written by chexflow) are read through ``webdataset``."""
    with open(path, "rb") as fh:
        magic = fh.read(6)
        fh.seek(0)
        if magic[:2] == b"\x1f\x8b" or magic[:3] == b"BZh" or magic == b"\xfd7zXZ\x00":
            files = ({**f, "__url__": path} for f in wds.tariterators.tar_file_iterator(fh))
            yield from wds.tariterators.group_by_keys(files)
            return
        current: dict | None = None
        for name, data in _iter_tar_files(fh, path):
            base = name.rsplit("/", 1)[-1]
            if base.startswith("__"):
                continue
            stem, dot, ext = base.partition(".")
            if not dot:
                continue
            key = name[:len(name) - len(base)] + stem
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key, "__url__": path}
            if ext in current:
                raise ShardReadError(f"{path}: duplicate file {name!r} in sample {key!r}")
            current[ext] = data
        if current is not None:
            yield current


class ShardStream(IterableDataset):
    """Samples ``(uint8 image HxW, target, "patient\\timage")`` of this rank's shards for one epoch."""

    def __init__(self, shards: list[ShardRef], *, rank: int, world: int, seed: int, epoch: int = 0,
                 shuffle: bool = True, shuffle_buffer: int = 1000):
        self.shards, self.rank, self.world, self.seed = shards, rank, world, seed
        self.epoch, self.shuffle, self.shuffle_buffer = epoch, shuffle, shuffle_buffer

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = assign_shards(self.shards, rank=self.rank, world=self.world, epoch=self.epoch,
                             seed=self.seed, shuffle=self.shuffle, worker=worker, workers=workers)
        stream = (_decode(s) for ref in mine for s in iter_shard(ref.path))
        if not self.shuffle or self.shuffle_buffer <= 1:
            yield from stream
            return
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker])
        buf = []
        for item in stream:
            if len(buf) < self.shuffle_buffer:
                buf.append(item)
                continue
            i = int(rng.integers(len(buf)))
            buf[i], item = item, buf[i]
            yield item
        rng.shuffle(buf)
        yield from buf


def _collate(batch):
    images = torch.stack([b[0] for b in batch])
    targets = torch.stack([b[1] for b in batch])
    return images, targets, [b[2] for b in batch]


def make_loader(stream: ShardStream, *, batch_size: int, workers: int, pin_memory: bool) -> DataLoader:
    return DataLoader(stream, batch_size=batch_size, num_workers=workers, collate_fn=_collate,
                      pin_memory=pin_memory, drop_last=False, persistent_workers=False,
                      prefetch_factor=4 if workers > 0 else None)


# --------------------------------------------------------------------------- GPU-side augmentation

def gpu_augment(images: torch.Tensor, *, out_size: int, train: bool, cfg: AugmentConfig,
                generator: torch.Generator | None, mean: float = 0.5, std: float = 0.25) -> torch.Tensor:
    """uint8 [B,H,W] on the device -> normalised float [B,1,S,S].

    Training: a random resized crop (area in [scale_min, 1], aspect 3/4..4/3), optional flip and
    rotation, all per sample in one batched ``affine_grid``/``grid_sample``. Evaluation: a resize
    to ``out_size`` (shards are stored square at the evaluation resolution's scale).
    """
    x = images.unsqueeze(1).float().div_(255.0)
    b = x.shape[0]
    if not train:
        if x.shape[-1] != out_size:
            x = torch.nn.functional.interpolate(x, size=(out_size, out_size), mode="bilinear",
                                                antialias=True, align_corners=False)
        return (x - mean) / std
    dev = x.device
    g = generator

    def rand(n):
        return torch.rand(n, generator=g, device=g.device if g is not None else "cpu").to(dev)

    area = cfg.scale_min + (1.0 - cfg.scale_min) * rand(b)
    log_ratio = math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * rand(b)
    ratio = torch.exp(log_ratio)
    sw = torch.sqrt(area * ratio).clamp(max=1.0)
    sh = torch.sqrt(area / ratio).clamp(max=1.0)
    tx = (1 - sw) * (2 * rand(b) - 1)
    ty = (1 - sh) * (2 * rand(b) - 1)
    flip = torch.where(rand(b) < 0.5, -1.0, 1.0) if cfg.flip else torch.ones(b, device=dev)
    angle = (2 * rand(b) - 1) * math.radians(cfg.rotate_deg)
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([
        torch.stack([sw * cos * flip, -sh * sin, tx], dim=1),
        torch.stack([sw * sin * flip, sh * cos, ty], dim=1),
    ], dim=1)
    grid = torch.nn.functional.affine_grid(theta, [b, 1, out_size, out_size], align_corners=False)
    x = torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return (x - mean) / std
