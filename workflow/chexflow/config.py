"""Typed, frozen configuration per stage.

``config.yaml`` is validated by JSON schema in the Snakefile; each rule then hands its stage's
resolved section to the CLI, which builds one of these dataclasses. The same loader is used when a
stage is rerun by hand from the ``config.yaml`` it wrote next to its outputs, so a typo is caught
either way, with the dotted key in the message.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from chexflow.fsutil import write_text_atomic


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type; the message names the key."""


# --------------------------------------------------------------------------- training

@dataclass(frozen=True)
class ModelConfig:
    arch: str = "resnet18"            # any torchvision classification model name
    in_channels: int = 1              # radiographs are grey; conv1 is adapted to this
    dropout: float = 0.0              # dropout before the classification head


@dataclass(frozen=True)
class AugmentConfig:
    flip: bool = True                 # random horizontal flip (GPU side)
    scale_min: float = 0.7            # RandomResizedCrop area range [scale_min, 1]
    rotate_deg: float = 0.0           # random rotation, degrees


@dataclass(frozen=True)
class DataConfig:
    crop: int = 32                    # training/eval image side in px (centre crop at eval)
    samples_per_epoch: int | None = None  # cap per epoch (None: the whole train split)
    workers: int = 1                  # CPU loader workers per rank
    shuffle_buffer: int = 1000        # streaming shuffle buffer per worker (samples)
    stage_to: str | None = None       # copy shards to node-local disk first (e.g. "$TMPDIR")
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = 0.1                   # LR for `reference_batch` images; scaled linearly (Goyal et al.)
    reference_batch: int = 256
    momentum: float = 0.9
    weight_decay: float = 1e-4
    nesterov: bool = True
    backbone_lr_mult: float = 1.0     # init pretrained: backbone LR = this x the head's (ignored for random init)
    # the optimizer's kernels (torchtitan's names): fused = one kernel over all parameters (CUDA and
    # CPU); foreach = multi-tensor ops; for-loop = one tensor at a time (torch's default on CPU)
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_epochs: float = 1.0        # gradual warmup from lr/world_size... to the scaled LR
    decay: Literal["cosine", "step", "none"] = "cosine"
    step_epochs: tuple[int, ...] = ()  # for decay=step: epochs at which LR is divided by 10


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 200            # periodic checkpoint (also on SIGTERM/SIGUSR1)
    keep: int = 3                     # newest checkpoints kept (per run: other runs' files are never pruned)
    # a resume finds a checkpoint written by another number of ranks: the data order and the LR
    # schedule depend on the world size. refuse: stop with a message naming both sizes; remap:
    # resume weights/optimizer/epoch, map the position in the epoch by samples seen and recompute
    # the LR schedule for the new world (logged; that epoch's data order is no longer exact)
    on_world_change: Literal["refuse", "remap"] = "refuse"


@dataclass(frozen=True)
class HorovodConfig:
    fp16_compression: bool = False    # hvd.Compression.fp16 for the allreduce
    fusion_threshold_mb: int = 64     # HOROVOD_FUSION_THRESHOLD
    backward_passes_per_step: int = 1  # gradient accumulation inside DistributedOptimizer
    # reduce and broadcast GPU tensors through host copies: for a Horovod built without GPU
    # operations, or several ranks sharing one GPU (NCCL refuses that); slower, never the default
    stage_through_cpu: bool = False


@dataclass(frozen=True)
class DDPConfig:
    # torch.distributed process group. auto: "cpu:gloo,cuda:nccl" on GPU (NCCL for CUDA tensors, gloo
    # for CPU ones: flags, objects, broadcasts of CPU state), "gloo" on CPU. "cpu:gloo,cuda:gloo"
    # runs the same per-device routing on a machine without GPUs (NCCL needs a GPU): the tests use it.
    process_group: Literal["auto", "gloo", "nccl", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"] = "auto"
    timeout_s: int = 1800             # collective timeout: longer than a node-local staging copy or a checkpoint write


@dataclass(frozen=True)
class TrainConfig:
    stage: Literal["pretrain", "finetune"] = "pretrain"
    dataset: str = "fashion_mnist"
    backend: Literal["horovod", "ddp", "single"] = "horovod"
    init: Literal["random", "pretrained"] = "random"   # finetune: start from the pretrain model
    epochs: int = 3
    batch_size: int = 64              # per rank; global batch = batch_size x world size
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"   # auto: bf16 autocast on GPU, fp32 on CPU
    # channels_last memory format for model and inputs. auto: on GPU only; always: on CPU too (tests
    # of the GPU path); never
    channels_last: Literal["auto", "always", "never"] = "auto"
    compile: bool = False             # torch.compile the model (honoured on CPU too)
    deterministic: bool = True        # torch.use_deterministic_algorithms (CPU: bit-identical resume)
    max_steps: int | None = None      # stop after this many optimizer steps (tests, benchmarks)
    # optimizer steps between host-side checks of the stop conditions (signal received, non-finite
    # loss): each check waits for the device and runs one small allreduce, so all ranks stop together
    # at the same step. Periodic checkpoints and epoch ends are always checked.
    check_every_steps: int = 20
    freeze: int = 0                   # leading backbone modules kept frozen (models.backbone_stages)
    transfer_stages: int | None = None  # init pretrained: load only the leading N backbone stages (None: all)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)


# --------------------------------------------------------------------------- data stages

@dataclass(frozen=True)
class DemoReleaseConfig:
    n_images: int = 3000
    image_size: int = 128
    images_per_archive: int = 1000
    test_fraction: float = 0.2
    seed: int = 2017

    @property
    def n_archives(self) -> int:
        """images_001.tar.gz ... images_<n>.tar.gz: the last archive may hold fewer images."""
        return -(-self.n_images // self.images_per_archive)


@dataclass(frozen=True)
class ShardConfig:
    dataset: str = "nih_demo"
    image_size: int = 64              # stored side in px (store e.g. 256 for 224 crops)
    samples_per_shard: int = 1000
    encoding: Literal["raw", "png"] = "raw"   # raw uint8 needs no decode when training
    val_fraction: float = 0.1         # share of train(_val) patients carved out for validation
    split_seed: int = 0
    max_reject_fraction: float = 0.001
    max_missing_fraction: float = 0.001   # full release: listed images found in no archive (else an error)
    train_parts: int = 16             # imagenet only: shard jobs for the train archive (class ranges)
    archives: tuple[int, ...] | None = None   # nih: the declared pilot subset (datasets.nih.archives)


@dataclass(frozen=True)
class EvaluateConfig:
    batch_size: int = 256
    bootstrap_resamples: int = 1000
    seed: int = 0
    crop: int = 64


# --------------------------------------------------------------------------- using the trained model

@dataclass(frozen=True)
class PredictConfig:
    """``chexflow predict``: the fine-tuned model on images it has not seen (rules/predict.smk)."""
    enabled: bool = False             # the workflow runs predict_images (rule all) when true
    # folders (searched recursively for .png/.jpg/.jpeg/.dcm/.dicom and extension-less DICOM files)
    # and/or list files (.txt: one image path per line, relative to the list's folder)
    inputs: tuple[str, ...] = ()
    batch_size: int = 32
    workers: int = 1                  # decoding processes beside the model (0: decode in the main process)
    device: Literal["auto", "cpu", "cuda"] = "auto"   # auto: cuda when available
    heatmaps: bool = False            # a Grad-CAM PNG per image, for its most likely finding
    # DICOM: what counts as a radiograph (0008,0060 Modality); other modalities are refused
    modalities: tuple[str, ...] = ("CR", "DX", "DR")
    max_file_mb: int = 512            # larger files are refused unread (a CR image is ~10-30 MB)

    def __post_init__(self) -> None:
        _at_least(self, "predict", batch_size=1, workers=0, max_file_mb=1)
        if not self.modalities:
            raise ConfigError("predict.modalities: name at least one DICOM modality (e.g. [CR, DX, DR])")


@dataclass(frozen=True)
class ExportConfig:
    """``chexflow export``: TorchScript and ONNX of the fine-tuned model, checked against torch."""
    enabled: bool = False             # the workflow runs export_model (rule all) when true
    formats: tuple[Literal["torchscript", "onnx"], ...] = ("torchscript", "onnx")
    check_images: int = 64            # test images the exports are compared on against the torch model
    tolerance: float = 1e-4           # largest allowed |export - torch| of a probability (fp32)
    opset: int = 18                   # ONNX opset (torch's exporter writes 18 or newer)

    def __post_init__(self) -> None:
        # two check batches at least: one of a single image and one of several (dynamic batch size)
        _at_least(self, "export", check_images=2, opset=18)
        if not self.formats or len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"export.formats: a non-empty list without repeats, got {list(self.formats)}")
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"export.tolerance: must lie in (0, 1), got {self.tolerance}")


def _at_least(obj: Any, section: str, **minimum: int) -> None:
    """Range check of integer settings (``ConfigError`` naming the dotted key)."""
    for name, low in minimum.items():
        value = getattr(obj, name)
        if value < low:
            raise ConfigError(f"{section}.{name}: must be >= {low}, got {value}")


# --------------------------------------------------------------------------- studies around the main run

@dataclass(frozen=True)
class ScalingConfig:
    """Weak scaling of pretraining: the same per-rank workload at every world size."""
    enabled: bool = False
    world_sizes: tuple[int, ...] = (1, 2)   # ranks per job (SLURM: GPUs, see profiles/slurm)
    steps_per_rank: int = 40          # optimizer steps per rank and epoch
    epochs: int = 2                   # throughput is taken from the last epoch (the first warms up)
    batch_size: int = 64              # per rank
    arch: str = "resnet18"
    crop: int = 32


@dataclass(frozen=True)
class SweepOptimSpace:
    lr: tuple[float, ...] = ()        # finetune.optim.lr
    weight_decay: tuple[float, ...] = ()  # finetune.optim.weight_decay


@dataclass(frozen=True)
class SweepModelSpace:
    dropout: tuple[float, ...] = ()   # finetune.model.dropout


@dataclass(frozen=True)
class SweepSpace:
    """Values per fine-tuning key; an empty list keeps the finetune section's value."""
    batch_size: tuple[int, ...] = ()  # finetune.batch_size
    freeze: tuple[int, ...] = ()      # finetune.freeze
    optim: SweepOptimSpace = field(default_factory=SweepOptimSpace)
    model: SweepModelSpace = field(default_factory=SweepModelSpace)


@dataclass(frozen=True)
class SweepConfig:
    enabled: bool = False
    method: Literal["grid", "random"] = "grid"
    n_trials: int = 8                 # random: number of trials
    seed: int = 0                     # random: sampling seed
    space: SweepSpace = field(default_factory=SweepSpace)


@dataclass(frozen=True)
class AblationConfig:
    enabled: bool = False             # also fine-tune from the other init, same budget


T = TypeVar("T")


def _check_type(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: unexpected value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: expected one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner, _ellipsis) = typing.get_args(tp)
        return tuple(_check_type(v, inner, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: Any, key: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types by name."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{key}." if key else ""
        raise ConfigError(f"unknown key(s) {', '.join(where + u for u in unknown)}; "
                          f"known: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _check_type(value, hints[name], f"{key}.{name}" if key else name)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(obj)))


def load_stage_config(cls: type[T], *, path: Path | None = None, text: str | None = None) -> T:
    """Load a stage config from a YAML/JSON file or string (exactly one of them)."""
    if (path is None) == (text is None):
        raise ConfigError("give exactly one of a config file or a config string")
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from exc
    try:
        data = json.loads(text)          # what the rules pass (YAML 1.1 misreads e.g. 5e-05)
    except json.JSONDecodeError:
        data = None
    try:
        data = yaml.safe_load(text) if data is None else data
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path or 'config string'}: not valid YAML/JSON: {exc}") from exc
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from exc


def write_yaml_atomic(obj: Any, path: Path) -> None:
    """Write ``obj`` (dataclass or mapping) as YAML, atomically."""
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else obj
    write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))


# --------------------------------------------------------------------------- JSON schema of config.yaml

def _schema_of(tp: Any) -> dict:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _schema_of(args[0])
        t = inner.get("type")
        return {**inner, "type": [t, "null"]} if isinstance(t, str) else {"anyOf": [inner, {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is tuple:
        return {"type": "array", "items": _schema_of(typing.get_args(tp)[0])}
    if dataclasses.is_dataclass(tp):
        return dataclass_schema(tp)
    return {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"},
            str: {"type": "string"}}.get(tp, {})


def dataclass_schema(cls: type, exclude: tuple[str, ...] = ()) -> dict:
    hints = typing.get_type_hints(cls)
    props = {f.name: _schema_of(hints[f.name]) for f in dataclasses.fields(cls) if f.name not in exclude}
    return {"type": "object", "additionalProperties": False, "properties": props}


# ShardConfig fields that only some datasets have (``Dataset.shard_options``); ``archives`` is set
# through datasets.<name>.archives, never under shards:
_DATASET_SHARD_KEYS = ("dataset", "train_parts", "archives")


def study_schema() -> dict:
    """The JSON schema of config.yaml (kept in sync with the dataclasses by a test); the datasets,
    their stages and their own keys come from ``chexflow.data.registry``."""
    from chexflow.data.registry import DATASETS   # imports the dataset modules, which import this one
    train = dataclass_schema(TrainConfig, exclude=("stage", "dataset"))
    datasets = {name: {"type": "object", "additionalProperties": False,
                       "properties": {"mirror": {"type": ["string", "null"]}, **d.source_options()}}
                for name, d in DATASETS.items()}
    shards = {name: dataclass_schema(ShardConfig, exclude=tuple(k for k in _DATASET_SHARD_KEYS
                                                                if k not in d.shard_options))
              for name, d in DATASETS.items()}
    stage_enum = {stage: {"enum": [n for n, d in DATASETS.items() if d.stage == stage]}
                  for stage in ("pretrain", "finetune")}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": "chexflow config.yaml (generated from chexflow.config: `python -m chexflow.config`)",
        "type": "object", "additionalProperties": False,
        "required": ["study", "datasets", "shards", "pretrain", "finetune", "evaluate"],
        "properties": {
            "study": {"type": "object", "additionalProperties": False,
                      "required": ["pretrain_dataset", "finetune_dataset"],
                      "properties": {"name": {"type": "string"},
                                     "pretrain_dataset": stage_enum["pretrain"],
                                     "finetune_dataset": stage_enum["finetune"]}},
            "datasets": {"type": "object", "additionalProperties": False, "properties": datasets},
            **{d.release_config: dataclass_schema(DemoReleaseConfig)
               for d in DATASETS.values() if d.release_config},
            "shards": {"type": "object", "additionalProperties": False, "properties": shards},
            "pretrain": train,
            "finetune": train,
            "evaluate": dataclass_schema(EvaluateConfig),
            "scaling": dataclass_schema(ScalingConfig),
            "sweep": dataclass_schema(SweepConfig),
            "ablation": dataclass_schema(AblationConfig),
            "predict": dataclass_schema(PredictConfig),
            "export": dataclass_schema(ExportConfig),
        },
    }


if __name__ == "__main__":
    print(yaml.safe_dump(study_schema(), sort_keys=False), end="")
