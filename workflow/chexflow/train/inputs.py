"""What a training run reads, built once: the splits' shards, the task, the epoch's length, the
loaders and the augmentation (torchvision's reference scripts build the same once, before the loop).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from chexflow.train.config import TrainConfig
from chexflow.data import loader as data


@dataclass(frozen=True)
class TrainData:
    task: str                       # multiclass (cross-entropy) | multilabel (masked BCE), from the manifest
    labels: list[str]
    train_shards: list[data.ShardRef]
    val_shards: list[data.ShardRef]
    steps_per_epoch: int            # the same on every rank and in every epoch (data.plan_epoch)
    cfg: TrainConfig
    rank: int
    world: int

    @classmethod
    def build(cls, cfg: TrainConfig, manifest: Path, *, rank: int, world: int) -> "TrainData":
        """Reads the manifest only: no collective, no copy."""
        meta = data.read_manifest(manifest)
        train = data.split_shards(manifest, "train")
        steps = data.epoch_steps(train, world=world, batch_size=cfg.batch_size,
                                 backward_passes=cfg.horovod.backward_passes_per_step,
                                 samples_per_epoch=cfg.data.samples_per_epoch)
        return cls(task=meta["task"], labels=list(meta["labels"]), train_shards=train,
                   val_shards=data.split_shards(manifest, "val"), steps_per_epoch=steps, cfg=cfg,
                   rank=rank, world=world)

    def staged(self, dest: Path, *, copy: bool) -> "TrainData":
        """The same data read from node-local copies under ``dest`` (``copy``: this rank copies;
        the node's other ranks only map the paths and must wait for it)."""
        return replace(self, train_shards=data.stage_shards(self.train_shards, dest, copy=copy),
                       val_shards=data.stage_shards(self.val_shards, dest, copy=copy))

    def train_stream(self) -> data.ShardStream:
        """This rank's training samples; ``set_epoch(epoch, skip_batches)`` selects the epoch."""
        cfg = self.cfg
        return data.ShardStream(self.train_shards, rank=self.rank, world=self.world, seed=cfg.seed,
                                batch_size=cfg.batch_size, backward_passes=cfg.horovod.backward_passes_per_step,
                                samples_per_epoch=cfg.data.samples_per_epoch, shuffle=True,
                                shuffle_buffer=cfg.data.shuffle_buffer)

    def loader(self, stream: data.ShardStream, *, pin_memory: bool):
        return data.make_loader(stream, batch_size=self.cfg.batch_size, workers=self.cfg.data.workers,
                                pin_memory=pin_memory)

    def val_loader(self, *, pin_memory: bool):
        """Every validation sample once across the ranks, in stored order."""
        stream = data.ShardStream(self.val_shards, rank=self.rank, world=self.world, seed=self.cfg.seed,
                                  batch_size=self.cfg.batch_size, shuffle=False)
        return self.loader(stream, pin_memory=pin_memory)

    def augment(self, images: torch.Tensor, *, train: bool, generator: torch.Generator | None,
                channels_last: bool) -> torch.Tensor:
        """uint8 images on the training device -> the network's normalised input at the crop size."""
        x = data.gpu_augment(images, out_size=self.cfg.data.crop, train=train, cfg=self.cfg.data.augment,
                             generator=generator)
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def stage_on_node(inputs: TrainData, *, dest: str, local_rank: int, barrier: Callable[[], None]) -> TrainData:
    """Node-local copies of the shards: every rank reads other shards each epoch, so a node needs
    them all; its local rank 0 copies them once, the node's other ranks wait and read the copies."""
    local = Path(dest) / "chexflow-shards"
    out = inputs.staged(local, copy=local_rank == 0)
    barrier()
    return out
