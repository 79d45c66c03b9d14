"""Starting weights from a file: a torchvision-format state dict (``init: file``).

The file holds what a torchvision model's ``state_dict()`` holds, e.g. torchvision's ImageNet
weights a user downloaded once (``densenet121-a639ec97.pth``, ``resnet50-11ad3fa6.pth``). It is read
like every ``.pt`` file chexflow reads (``checkpoint.load_pt``: a regular file, weights only) and
goes through the one fits-the-model check (``models.load_backbone``): every backbone tensor present,
none the architecture lacks, the same shapes. Two things may differ, and only these:

- the classifier head (``fc.*``, ``classifier.*``): ImageNet's 1000 classes are replaced by the
  task's head, never loaded;
- the stem: the file's 3-channel (RGB) first convolution saw an image normalised per channel as
  torchvision's weights were trained (ImageNet's mean ``m_c`` and std ``s_c``, the weights' own
  ``transforms()``); chexflow feeds one grey channel normalised as ``(x - 0.5) / 0.25``
  (``data.augment.MEAN``/``STD``). For a grey pixel ``x`` the original's channel ``c`` is
  ``(x - m_c) / s_c = (0.25 / s_c) g + (0.5 - m_c) / s_c`` with ``g`` chexflow's input, so the
  exact fold (:func:`fold_stem`) scales each channel's kernel by ``0.25 / s_c`` and sums over the
  channels, and moves the constant the second term adds to every output channel,
  ``b_o = sum_c (0.5 - m_c) / s_c * sum(W[o, c])``, into the stem: its bias if it has one, else
  the following BatchNorm's running mean (``running_mean - b``; torchvision's stems have no bias).
  A grey image through the folded stem then gives what ``(x, x, x)`` ImageNet-normalised gives
  through the original, exactly wherever the stem's window lies inside the image. Where it reaches
  into the zero padding it is not: the original pads each channel with 0 in its own normalised
  units (a pixel of ``m_c``), the folded stem pads chexflow's input with 0 (a pixel of 0.5) and its
  offset assumes every tap sees the image. With BatchNorm in eval mode (``freeze``, evaluation) the
  running mean matters; in training mode the batch mean absorbs a constant offset anyway, the
  scaling is what counts (summing unscaled kernels, as if the weights had seen chexflow's
  normalisation, fed each channel ``(x - 0.5) / 0.25`` for ``(x - m_c) / s_c``: off by up to 0.64
  in the channel's normalised units, the blue channel at a white pixel).

torchvision's own DenseNet checkpoints carry old-style keys (``denselayer1.norm.1.weight`` for
``denselayer1.norm1.weight``), which torchvision renames while loading; :func:`torchvision_keys`
does the same renaming here. Files written before BatchNorm counted its batches (torchvision's
published ImageNet weights among them) lack ``num_batches_tracked``: like torch's BatchNorm loading
such a file, the count starts at 0 (it is used only with ``momentum=None``, which no torchvision
model sets).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from chexflow.data.augment import MEAN, STD
from chexflow.train import checkpoint as ckpt
from chexflow.train.config import TrainConfig
from chexflow.train.models import load_backbone

# torchvision.models.densenet._load_state_dict's pattern: '...denselayerN.norm.1.weight' -> '...norm1.weight'
_OLD_DENSENET_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|"
                               r"running_var))$")


class InitFileError(ValueError):
    """A starting-weights file that is not a torchvision-format state dict of this model."""


def torchvision_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with torchvision's old-style DenseNet keys renamed as torchvision renames them."""
    out = {}
    for key, value in state_dict.items():
        m = _OLD_DENSENET_KEY.match(key)
        out[m.group(1) + m.group(2) if m else key] = value
    return out


def read_init_file(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path`` (weights only), keys as torchvision's models name them today."""
    path = Path(path)
    try:
        obj = ckpt.load_pt(path)
    except OSError as exc:
        raise InitFileError(f"{path}: the starting weights' file (init_file) cannot be read: "
                            f"{exc.strerror or exc}") from exc
    except ckpt.RefusedFile as exc:
        raise InitFileError(str(exc)) from exc
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in obj.items()):
        raise InitFileError(f"{path}: refused: not a torchvision-format state dict (a mapping of tensor names "
                            f"to tensors, as a torchvision model's state_dict() is); it holds a {type(obj).__name__}")
    return torchvision_keys(obj)


def published_normalisation(arch: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std torchvision's published weights of ``arch`` were trained with (the
    weights' own ``transforms()``: ImageNet's for every classification model)."""
    import torchvision
    try:
        preset = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
    except (ValueError, KeyError, AttributeError) as exc:
        raise InitFileError(f"model.arch {arch!r}: torchvision publishes no weights for it, so the normalisation "
                            "its init_file was trained with is unknown") from exc
    return tuple(float(v) for v in preset.mean), tuple(float(v) for v in preset.std)


def _stem(model: torch.nn.Module) -> tuple[str, torch.nn.Conv2d, str | None]:
    """The stem convolution (the first Conv2d), its name, and the name of the BatchNorm right after it
    (None when the next module is not one of its width)."""
    modules = list(model.named_modules())
    k, (name, conv) = next((k, m) for k, m in enumerate(modules) if isinstance(m[1], torch.nn.Conv2d))
    after = modules[k + 1] if k + 1 < len(modules) else (None, None)
    norm = after[0] if isinstance(after[1], torch.nn.BatchNorm2d) and after[1].num_features == conv.out_channels \
        else None
    return name, conv, norm


def fold_stem(model: torch.nn.Module, state: dict[str, torch.Tensor], *, mean: tuple[float, ...],
              std: tuple[float, ...], source: str) -> dict[str, torch.Tensor]:
    """``state`` (a torchvision-format state dict whose stem saw each channel ``c`` normalised by
    ``mean[c]``, ``std[c]``) with its stem folded exactly for ``model``'s input, normalised as chexflow
    does (see the module docstring): the kernels scaled and summed (spread over the model's input
    channels), the constant offset in the stem's bias or the following BatchNorm's running mean."""
    name, conv, norm = _stem(model)
    key = f"{name}.weight"
    w = state.get(key)
    if w is None:
        raise InitFileError(f"{source}: refused: it holds no {key}, the stem torchvision's weights of this "
                            "architecture have (a file of another architecture?)")
    if w.dim() != 4 or w.shape[1] != len(mean):
        raise InitFileError(f"{source}: refused: its stem {key} is {tuple(w.shape)}, not the {len(mean)}-channel "
                            "(RGB) stem torchvision's weights of this architecture have")
    w64 = w.double()
    scale = torch.tensor([STD / s for s in std], dtype=torch.float64).view(1, -1, 1, 1)
    offset = torch.tensor([(MEAN - m) / s for m, s in zip(mean, std)], dtype=torch.float64)
    own = conv.in_channels
    scaled = w64 * scale
    folded = scaled if own == w.shape[1] else scaled.sum(dim=1, keepdim=True).repeat(1, own, 1, 1) / own
    b = (w64.sum(dim=(2, 3)) * offset).sum(dim=1)             # [out]: what the offset adds, away from padding
    if conv.bias is None and norm is None:
        raise InitFileError(f"{source}: refused: the stem {name} has no bias and no BatchNorm after it: the "
                            "normalisation's offset cannot be folded into the weights")
    out = {**state, key: folded.to(w.dtype)}
    # (a tensor the file lacks is left to load_backbone, which refuses naming it)
    target, sign = (f"{name}.bias", 1.0) if conv.bias is not None else (f"{norm}.running_mean", -1.0)
    if isinstance(state.get(target), torch.Tensor) and state[target].shape == b.shape:
        out[target] = (state[target].double() + sign * b).to(state[target].dtype)
    return out


def load_init_file(model: torch.nn.Module, path: Path, *, arch: str,
                   stages: int | None = None) -> tuple[list[str], int]:
    """Initialise ``model``'s backbone (a chexflow ``arch``) from the file at ``path`` (head new, RGB stem
    folded exactly for chexflow's grey input); returns the names of the tensors taken and how many the
    file holds. A file that does not fit is an :class:`InitFileError` naming it."""
    state = read_init_file(path)
    for key, value in model.state_dict().items():
        if key.endswith(".num_batches_tracked") and key not in state:
            state[key] = torch.zeros_like(value)
    mean, std = published_normalisation(arch)
    state = fold_stem(model, state, mean=mean, std=std, source=str(path))
    try:
        return load_backbone(model, state, stages=stages, source=str(path)), len(state)
    except ValueError as exc:
        raise InitFileError(str(exc)) from exc


def start_from(model: torch.nn.Module, cfg: TrainConfig, pretrained: Path | None) -> str:
    """Initialise ``model``'s backbone as ``cfg.init`` says (pretrained: the pretraining model file
    ``pretrained``; file: ``cfg.init_file``); returns what was loaded, for the log."""
    if cfg.init == "pretrained":
        pre = ckpt.load_model_file(pretrained, expect={"arch": cfg.model.arch})
        loaded = load_backbone(model, pre["state_dict"], stages=cfg.transfer_stages, source=str(pretrained))
        return (f"initialised {len(loaded)} backbone tensors from {pretrained} (of its {len(pre['state_dict'])}; "
                "model weights only; new head)")
    loaded, held = load_init_file(model, Path(cfg.init_file), arch=cfg.model.arch, stages=cfg.transfer_stages)
    return (f"initialised {len(loaded)} backbone tensors from {cfg.init_file} (of its {held}; weights only; "
            f"stem folded from ImageNet's per-channel normalisation to chexflow's {cfg.model.in_channels} input "
            "channel(s); new head)")
