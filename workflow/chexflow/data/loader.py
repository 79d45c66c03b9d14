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


def stage_shards(shards: list[ShardRef], dest: Path) -> list[ShardRef]:
    """Copy shards to node-local disk (the PRACE guide's advice); skip ones already there, same size."""
    dest = Path(os.path.expandvars(str(dest)))
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for s in shards:
        src = Path(s.path)
        target = dest / f"{hashlib.sha1(str(src.parent).encode()).hexdigest()[:10]}-{src.name}"
        if not (target.exists() and target.stat().st_size == src.stat().st_size):
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


def _decode(sample: dict) -> tuple[torch.Tensor, torch.Tensor, str]:
    if "img.npy" in sample:
        img = np.load(io.BytesIO(sample["img.npy"]), allow_pickle=False)
    else:
        from PIL import Image
        img = np.asarray(Image.open(io.BytesIO(sample["img.png"])).convert("L"))
    target = np.load(io.BytesIO(sample["target.npy"]), allow_pickle=False)
    meta = json.loads(sample["meta.json"])
    return torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.asarray(target)), meta["patient"] + "\t" + meta["image"]


def iter_shard(path: str) -> Iterator[dict]:
    with open(path, "rb") as fh:
        files = ({**f, "__url__": path} for f in wds.tariterators.tar_file_iterator(fh))
        yield from wds.tariterators.group_by_keys(files)


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
