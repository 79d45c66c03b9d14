"""Training settings: one :class:`TrainConfig` per stage (pretraining, fine-tuning).

config.yaml writes them in two parts. ``training:`` says HOW training runs, for both stages
(:data:`RUN_KEYS`: backend, precision, memory format, compile, determinism, checkpointing, collective
checks, Horovod/DDP, loader workers, staging, optimizer kernels); ``pretrain:`` and ``finetune:`` say
WHAT each stage trains (model, epochs, batch, optimiser, schedule, crop, augmentation) and may
override any ``training`` key for that stage. :func:`resolve` merges them; the result is the same
TrainConfig as before the split, so the settings part of a run's id (``chexflow.train.identity``)
does not change.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from chexflow.data.config import MAX_SIDE, MIN_SIDE, AugmentConfig
from chexflow.settings import ConfigError, setting


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "resnet18"            # any torchvision classification model name
    in_channels: int = setting(1, ge=1, le=4)   # radiographs are grey; conv1 is adapted to this
    dropout: float = setting(0.0, ge=0.0, lt=1.0)   # dropout before the classification head


@dataclass(frozen=True)
class DataConfig:
    crop: int = setting(32, ge=MIN_SIDE, le=MAX_SIDE)   # training/eval image side in px (centre crop at eval)
    samples_per_epoch: int | None = setting(None, ge=1)   # cap per epoch (None: the whole train split)
    workers: int = setting(1, ge=0)   # CPU loader workers per rank (0: in the training process)
    shuffle_buffer: int = setting(1000, ge=1)   # streaming shuffle buffer per worker (samples)
    stage_to: str | None = None       # copy shards to node-local disk first (e.g. "$TMPDIR")
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = setting(0.1, gt=0.0)  # LR for `reference_batch` images; scaled linearly (Goyal et al.)
    reference_batch: int = setting(256, ge=1)
    momentum: float = setting(0.9, ge=0.0, lt=1.0)
    weight_decay: float = setting(1e-4, ge=0.0)
    nesterov: bool = True
    # init pretrained: backbone LR = this x the head's (ignored for random init)
    backbone_lr_mult: float = setting(1.0, gt=0.0)
    # the optimizer's kernels (torchtitan's names): fused = one kernel over all parameters (CUDA and
    # CPU); foreach = multi-tensor ops; for-loop = one tensor at a time (torch's default on CPU)
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_epochs: float = setting(1.0, ge=0.0)   # gradual warmup from lr/world_size... to the scaled LR
    decay: Literal["cosine", "step", "none"] = "cosine"
    step_epochs: tuple[int, ...] = setting((), ge=1, unique=True)   # decay=step: epochs at which LR is divided by 10


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = setting(200, ge=0)   # periodic checkpoint, 0: none (also on SIGTERM/SIGUSR1, epoch ends)
    keep: int = setting(3, ge=1)      # newest checkpoints kept (per run: other runs' files are never pruned)
    # a resume finds a checkpoint written by another number of ranks: the data order and the LR
    # schedule depend on the world size. refuse: stop with a message naming both sizes; remap:
    # resume weights/optimizer/epoch, map the position in the epoch by samples seen and recompute
    # the LR schedule for the new world (logged; that epoch's data order is no longer exact)
    on_world_change: Literal["refuse", "remap"] = "refuse"
    # one trainer at a time per checkpoint directory (a lease file, chexflow.train.lease): a second one
    # waits this long for the holder to end, then stops naming it (a Snakemake retry tries again)
    lease_wait_s: int = setting(120, ge=0)
    # a holder on another host that neither its host's process table nor SLURM can vouch for is
    # presumed dead after this long without a heartbeat (it renews every lease_stale_s / 10)
    lease_stale_s: int = setting(600, ge=10)


@dataclass(frozen=True)
class HorovodConfig:
    fp16_compression: bool = False    # hvd.Compression.fp16 for the allreduce
    fusion_threshold_mb: int = setting(64, ge=0)   # HOROVOD_FUSION_THRESHOLD (0: no fusion)
    backward_passes_per_step: int = setting(1, ge=1)   # gradient accumulation inside DistributedOptimizer
    # reduce and broadcast GPU tensors through host copies: for a Horovod built without GPU
    # operations, or several ranks sharing one GPU (NCCL refuses that); slower, never the default
    stage_through_cpu: bool = False


@dataclass(frozen=True)
class DDPConfig:
    # torch.distributed process group. auto: "cpu:gloo,cuda:nccl" on GPU (NCCL for CUDA tensors, gloo
    # for CPU ones: flags, objects, broadcasts of CPU state), "gloo" on CPU. "cpu:gloo,cuda:gloo"
    # runs the same per-device routing on a machine without GPUs (NCCL needs a GPU): the tests use it.
    process_group: Literal["auto", "gloo", "nccl", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"] = "auto"
    # collective timeout: longer than a node-local staging copy or a checkpoint write
    timeout_s: int = setting(1800, ge=1)


@dataclass(frozen=True)
class TrainConfig:
    stage: Literal["pretrain", "finetune"] = "pretrain"
    dataset: str = "fashion_mnist"
    backend: Literal["horovod", "ddp", "single"] = "horovod"
    # random: train from scratch; pretrained (finetune only): the pretrain stage's model; file: the
    # torchvision-format state dict at init_file (e.g. torchvision's ImageNet weights, train.init_file)
    init: Literal["random", "pretrained", "file"] = "random"
    init_file: str | None = None      # init: file: the weights file (its sha256 is part of the run id)
    epochs: int = setting(3, ge=1)
    batch_size: int = setting(64, ge=1)   # per rank; global batch = batch_size x world size
    seed: int = setting(0, ge=0)
    precision: Literal["auto", "fp32", "bf16"] = "auto"   # auto: bf16 autocast on GPU, fp32 on CPU
    # channels_last memory format for model and inputs. auto: on GPU only; always: on CPU too (tests
    # of the GPU path); never
    channels_last: Literal["auto", "always", "never"] = "auto"
    compile: bool = False             # torch.compile the model (honoured on CPU too)
    deterministic: bool = True        # torch.use_deterministic_algorithms (CPU: bit-identical resume)
    max_steps: int | None = setting(None, ge=1)   # stop after this many optimizer steps (tests, benchmarks)
    # optimizer steps between host-side checks of the stop conditions (signal received, non-finite
    # loss): each check waits for the device and runs one small allreduce, so all ranks stop together
    # at the same step. Periodic checkpoints and epoch ends are always checked.
    check_every_steps: int = setting(20, ge=1)
    freeze: int = setting(0, ge=0)    # leading backbone modules kept frozen (models.backbone_stages)
    # init pretrained: load only the leading N backbone stages (None: all)
    transfer_stages: int | None = setting(None, ge=1)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)


STAGES = ("pretrain", "finetune")
# How training runs (the `training:` section, shared by both stages; a stage section may override
# any of them): dotted TrainConfig keys, a section name meaning all of its keys.
RUN_KEYS = ("backend", "precision", "channels_last", "compile", "deterministic", "max_steps", "check_every_steps",
            "data.workers", "data.shuffle_buffer", "data.stage_to", "optim.implementation", "checkpoint",
            "horovod", "ddp")
# Keys the workflow sets (from study.*), and keys only fine-tuning has (pretraining starts from random
# weights or a weights file: nothing to freeze or slow down)
WORKFLOW_KEYS = ("stage", "dataset")
FINETUNE_ONLY = ("freeze", "transfer_stages", "optim.backbone_lr_mult")
INITS: tuple[str, ...] = typing.get_args(typing.get_type_hints(TrainConfig)["init"])   # random, pretrained, file
ABLATION_INITS = ("random", "pretrained")   # the init ablation's two arms (a third, file, with init_file set)


def stage_keys_excluded(stage: str) -> tuple[str, ...]:
    """The TrainConfig keys a ``<stage>:`` section of config.yaml cannot hold."""
    return WORKFLOW_KEYS + (FINETUNE_ONLY if stage == "pretrain" else ())


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every setting of dataclass ``cls`` (nested sections opened)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def is_run_key(dotted: str) -> bool:
    return any(dotted == k or dotted.startswith(k + ".") for k in RUN_KEYS)


def training_keys_excluded() -> tuple[str, ...]:
    """The TrainConfig keys the shared ``training:`` section cannot hold: everything but RUN_KEYS."""
    return tuple(k for k in leaf_keys(TrainConfig) if not is_run_key(k))


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def resolve(training: Mapping[str, Any] | None, section: Mapping[str, Any] | None, *, stage: str,
            dataset: str, **overrides: Any) -> dict[str, Any]:
    """The settings of one stage as a mapping for :class:`TrainConfig`: the shared ``training``
    section, the stage's own section over it (key by key, nested sections merged), then the
    workflow's ``stage``/``dataset`` and ``overrides`` (e.g. the ablation's ``init``)."""
    return {**_merge(dict(training or {}), dict(section or {})), "stage": stage, "dataset": dataset, **overrides}


def main_init(config: Mapping[str, Any]) -> str:
    """``finetune.init`` of a whole config mapping (config.yaml), with the dataclass default."""
    init = str((config.get("finetune") or {}).get("init", TrainConfig.init))
    if init not in INITS:
        raise ConfigError(f"finetune.init: expected one of {list(INITS)}, got {init!r}")
    return init


def other_init(config: Mapping[str, Any]) -> str:
    """The init ablation's: the one of ``ABLATION_INITS`` that the main fine-tuning run does not use
    (random when the main run starts from a weights file)."""
    main = main_init(config)
    return next(init for init in ABLATION_INITS if init != main)


# --------------------------------------------------------------------------- relations

# the keys :func:`check` relates (a caller checks them only when none of them is out of range itself)
RELATED_KEYS = ("epochs", "batch_size", "init", "init_file", "freeze", "transfer_stages", "schedule", "optim",
                "data.samples_per_epoch", "horovod.backward_passes_per_step")


def check(cfg: TrainConfig, key: str) -> list[str]:
    """Relations between the settings of one stage (``key``: its section name in the messages)."""
    problems = []
    if cfg.schedule.warmup_epochs > cfg.epochs:
        problems.append(f"{key}.schedule.warmup_epochs: {cfg.schedule.warmup_epochs:g} is not <= {key}.epochs "
                        f"({cfg.epochs}): the LR would never reach its target")
    if cfg.schedule.step_epochs and cfg.schedule.decay != "step":
        problems.append(f"{key}.schedule.step_epochs: {list(cfg.schedule.step_epochs)} is set but decay is "
                        f"{cfg.schedule.decay!r}: it would be ignored (decay: step uses it)")
    late = [e for e in cfg.schedule.step_epochs if e >= cfg.epochs]
    if late:
        problems.append(f"{key}.schedule.step_epochs: {late} is not < {key}.epochs ({cfg.epochs}): never reached")
    if cfg.optim.name == "sgd" and cfg.optim.nesterov and cfg.optim.momentum == 0:
        problems.append(f"{key}.optim.nesterov: true needs optim.momentum > 0 (it is 0)")
    per_step = cfg.batch_size * cfg.horovod.backward_passes_per_step
    if per_step >= 1 and cfg.data.samples_per_epoch is not None and cfg.data.samples_per_epoch < per_step:
        problems.append(f"{key}.data.samples_per_epoch: {cfg.data.samples_per_epoch} is not >= {per_step} "
                        f"(batch_size x horovod.backward_passes_per_step): not one step per epoch")
    problems += init_file_problems(cfg, key)
    if cfg.init != "random" and cfg.transfer_stages is not None and cfg.freeze > cfg.transfer_stages:
        problems.append(f"{key}.freeze: {cfg.freeze} is not <= {key}.transfer_stages ({cfg.transfer_stages}): "
                        "frozen stages beyond the transferred ones would keep their random weights")
    return problems


def init_file_problems(cfg: TrainConfig, key: str) -> list[str]:
    """``init: file`` needs ``init_file``, a regular file that exists now; pretraining has no model to start from."""
    if cfg.stage == "pretrain" and cfg.init == "pretrained":
        return [f"{key}.init: pretrained is for fine-tuning (the pretraining model); pretraining starts from "
                "random or file"]
    if cfg.init != "file" and cfg.init_file is None:
        return []
    if cfg.init == "file" and cfg.init_file is None:
        return [f"{key}.init_file: missing: init: file loads the starting weights from it (a torchvision-format "
                "state dict, e.g. torchvision's ImageNet densenet121 weights)"]
    if not os.path.isfile(cfg.init_file):
        what = "is not a regular file" if os.path.exists(cfg.init_file) else "does not exist"
        return [f"{key}.init_file: {cfg.init_file} {what} (the starting weights' file; download it once, "
                "see docs/training.md)"]
    return []


def stage_names(arch: str) -> list[str]:
    """The backbone stages of ``arch`` (``models.backbone_stages``), built on the meta device (no memory,
    no weights). It imports torchvision: the workflow asks only when a setting names or counts stages,
    and the DAG of a config without one stays torch-free. ``ModelError`` for an unknown ``arch``."""
    import torch

    from chexflow.train.models import backbone_stages, build_model
    with torch.device("meta"):
        return [name for name, _ in backbone_stages(build_model(arch, in_channels=1, num_outputs=1))]


def check_stages_fit(arch: str, counts: Mapping[str, int]) -> list[str]:
    """Backbone stage counts (``{dotted key: value}``: freeze, transfer_stages) within ``arch``'s stages."""
    from chexflow.train.models import ModelError
    try:
        stages = stage_names(arch)
    except ModelError as exc:
        return [str(exc)]
    return [f"{key}: {value} is not in 0..{len(stages)}, the backbone stages of {arch} ({', '.join(stages)})"
            for key, value in counts.items() if not 0 <= value <= len(stages)]
