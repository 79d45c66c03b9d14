"""What a training run reads, built once: the splits' shards, the task, the epoch's length, the
loaders and the augmentation (torchvision's reference scripts build the same once, before the loop).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from chexflow.train.config import TrainConfig
from chexflow.data.augment import gpu_augment
from chexflow.data.epoch_plan import epoch_steps, first_readers
from chexflow.data.loader import ShardStream, make_loader
from chexflow.data.manifest import (ManifestError, ShardRef, ShardVerifyError, World, read_manifest, split_shards,
                                    verify_on_world)
from chexflow.data.staging import stage_shards, verify_staged
from chexflow.data.stamps import StampStore


@dataclass(frozen=True)
class TrainData:
    task: str                       # multiclass (cross-entropy) | multilabel (masked BCE), from the manifest
    labels: list[str]
    train_shards: list[ShardRef]
    val_shards: list[ShardRef]
    steps_per_epoch: int            # the same on every rank and in every epoch (plan_epoch)
    cfg: TrainConfig
    rank: int
    world: int

    @classmethod
    def build(cls, cfg: TrainConfig, manifest: Path, *, rank: int, world: int) -> "TrainData":
        """Reads the manifest only: no collective, no copy."""
        meta = read_manifest(manifest)
        train = split_shards(manifest, "train")
        steps = epoch_steps(train, world=world, batch_size=cfg.batch_size,
                                 backward_passes=cfg.horovod.backward_passes_per_step,
                                 samples_per_epoch=cfg.data.samples_per_epoch)
        return cls(task=meta["task"], labels=list(meta["labels"]), train_shards=train,
                   val_shards=split_shards(manifest, "val"), steps_per_epoch=steps, cfg=cfg,
                   rank=rank, world=world)

    def staged(self, dest: Path, *, copy: bool, start: str = "", log: Callable[[str], None] = print) -> "TrainData":
        """The same data read from node-local copies under ``dest`` (``copy``: this rank copies;
        the node's other ranks only map the paths and must wait for it)."""
        shards = stage_shards(self.train_shards + self.val_shards, dest, copy=copy, start=start, log=log)
        n = len(self.train_shards)
        return replace(self, train_shards=shards[:n], val_shards=shards[n:])

    def first_readers(self) -> list[int]:
        """The rank that checks each shard of ``train_shards + val_shards``: the one that reads it first
        (first_readers: training's first epoch, then validation's slices)."""
        cfg = self.cfg
        train = first_readers(self.train_shards, world=self.world, seed=cfg.seed, batch_size=cfg.batch_size,
                                   backward_passes=cfg.horovod.backward_passes_per_step,
                                   samples_per_epoch=cfg.data.samples_per_epoch)
        val = first_readers(self.val_shards, world=self.world, seed=cfg.seed, batch_size=cfg.batch_size,
                                 shuffle=False)
        return train + val

    def train_stream(self) -> ShardStream:
        """This rank's training samples; ``set_epoch(epoch, skip_batches)`` selects the epoch."""
        cfg = self.cfg
        return ShardStream(self.train_shards, rank=self.rank, world=self.world, seed=cfg.seed,
                                batch_size=cfg.batch_size, backward_passes=cfg.horovod.backward_passes_per_step,
                                samples_per_epoch=cfg.data.samples_per_epoch, shuffle=True,
                                shuffle_buffer=cfg.data.shuffle_buffer)

    def loader(self, stream: ShardStream, *, pin_memory: bool):
        """A loader whose workers serve every epoch of the run (``close_loader`` stops them)."""
        return make_loader(stream, batch_size=self.cfg.batch_size, workers=self.cfg.data.workers,
                                pin_memory=pin_memory, persistent=True)

    def val_loader(self, *, pin_memory: bool):
        """Every validation sample once across the ranks, in stored order."""
        stream = ShardStream(self.val_shards, rank=self.rank, world=self.world, seed=self.cfg.seed,
                                  batch_size=self.cfg.batch_size, shuffle=False)
        return self.loader(stream, pin_memory=pin_memory)

    def augment(self, images: torch.Tensor, *, train: bool, generator: torch.Generator | None,
                channels_last: bool) -> torch.Tensor:
        """uint8 images on the training device -> the network's normalised input at the crop size."""
        x = gpu_augment(images, out_size=self.cfg.data.crop, train=train, cfg=self.cfg.data.augment,
                             generator=generator)
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def check_inputs(inputs: TrainData, world: World, *, local_rank: int, store: StampStore | None,
                 log: Callable[[str], None]) -> TrainData:
    """The shards checked against the manifest's sha256 before the first step (a collective), at a cost
    that does not grow with the world: without staging each shard is checked by one rank, the one
    that reads it first (``verify_on_world``; a shard ``store``'s stamp vouches for is not read);
    with ``data.stage_to`` each node's copying rank checks the bytes as it copies them
    (:func:`stage_on_node`). Returns the inputs to read (the node-local copies when staged)."""
    if inputs.cfg.data.stage_to:
        return stage_on_node(inputs, dest=inputs.cfg.data.stage_to, local_rank=local_rank, world=world, log=log)
    log(str(verify_on_world(inputs.train_shards + inputs.val_shards, inputs.first_readers(), world, store)))
    return inputs


def stage_on_node(inputs: TrainData, *, dest: str, local_rank: int, world: World,
                  log: Callable[[str], None]) -> TrainData:
    """Node-local copies of the shards: every rank reads other shards each epoch, so a node needs
    them all; its local rank 0 copies them once, checking the bytes as they pass, while the node's
    other ranks wait; they then use the copies by the stamps it wrote for this start, reading
    nothing. A refusal on any node stops every rank (no rank waits in a later collective)."""
    local = Path(dest) / "chexflow-shards"
    start = world.broadcast_object(secrets.token_hex(8) if world.rank == 0 else None)
    failure = None
    if local_rank == 0:
        try:
            inputs.staged(local, copy=True, start=start, log=log)
        except Exception as exc:            # noqa: BLE001  (re-raised below, on this rank as it was)
            failure = exc
    said = None if failure is None else (isinstance(failure, ManifestError), str(failure))
    failures = [f for f in world.allgather_object(said) if f]
    if failure is not None:
        raise failure
    if failures:
        refused, message = failures[0]
        raise (ShardVerifyError if refused else RuntimeError)(f"staging failed on another rank: {message}")
    out = inputs.staged(local, copy=False)
    verify_staged(out.train_shards + out.val_shards, local, start=start, log=log)
    return out
