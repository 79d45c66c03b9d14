"""The studies' settings (config.yaml ``scaling:``, ``sweep:``, ``ablation:``), each off unless enabled.

Imported at DAG time (the Snakefile expands the sweep's trials and the scaling's world sizes), so
it imports nothing heavy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from chexflow.data.config import MAX_SIDE, MIN_SIDE
from chexflow.settings import setting


@dataclass(frozen=True)
class ScalingConfig:
    """Weak scaling of pretraining: the same per-rank workload at every world size."""
    enabled: bool = False
    world_sizes: tuple[int, ...] = setting((1, 2), ge=1, unique=True)   # ranks per job (SLURM: GPUs)
    steps_per_rank: int = setting(40, ge=1)   # optimizer steps per rank and epoch
    # throughput is taken from the last epoch, the first warms up (worker start, allocator, caches)
    epochs: int = setting(2, ge=2)
    batch_size: int = setting(64, ge=1)   # per rank
    arch: str = "resnet18"
    crop: int = setting(32, ge=MIN_SIDE, le=MAX_SIDE)


@dataclass(frozen=True)
class SweepOptimSpace:
    lr: tuple[float, ...] = setting((), gt=0.0, unique=True)   # finetune.optim.lr
    weight_decay: tuple[float, ...] = setting((), ge=0.0, unique=True)   # finetune.optim.weight_decay


@dataclass(frozen=True)
class SweepModelSpace:
    dropout: tuple[float, ...] = setting((), ge=0.0, lt=1.0, unique=True)   # finetune.model.dropout


@dataclass(frozen=True)
class SweepSpace:
    """Values per fine-tuning key; an empty list keeps the finetune section's value."""
    batch_size: tuple[int, ...] = setting((), ge=1, unique=True)   # finetune.batch_size
    freeze: tuple[int, ...] = setting((), ge=0, unique=True)   # finetune.freeze
    optim: SweepOptimSpace = field(default_factory=SweepOptimSpace)
    model: SweepModelSpace = field(default_factory=SweepModelSpace)


@dataclass(frozen=True)
class SweepConfig:
    enabled: bool = False
    method: Literal["grid", "random"] = "grid"
    n_trials: int = setting(8, ge=1)   # random: number of trials
    seed: int = setting(0, ge=0)      # random: sampling seed
    space: SweepSpace = field(default_factory=SweepSpace)


@dataclass(frozen=True)
class AblationConfig:
    enabled: bool = False             # also fine-tune from the other init, same budget
    # training seeds per arm (finetune.seed replaced); None: the finetune section's one seed (one run per
    # arm). Several: one fine-tuning and evaluation per arm and seed, and a verdict over the seeds
    seeds: tuple[int, ...] | None = setting(None, ge=0, unique=True)
