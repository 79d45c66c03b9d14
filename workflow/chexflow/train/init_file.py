"""Starting weights from a file: a torchvision-format state dict (``init: file``).

The file holds what a torchvision model's ``state_dict()`` holds, e.g. torchvision's ImageNet
weights a user downloaded once (``densenet121-a639ec97.pth``, ``resnet50-11ad3fa6.pth``). It is read
like every ``.pt`` file chexflow reads (``checkpoint.load_pt``: a regular file, weights only) and
goes through the one fits-the-model check (``models.load_backbone``): every backbone tensor present,
none the architecture lacks, the same shapes. Two things may differ, and only these:

- the classifier head (``fc.*``, ``classifier.*``): ImageNet's 1000 classes are replaced by the
  task's head, never loaded;
- the stem: a 3-channel (RGB) first convolution is folded into chexflow's grey one by summing its
  weights over the input-channel axis. chexflow normalises every channel alike
  (``data.loader.MEAN``/``STD``), so a grey image ``x`` through the folded stem equals the RGB image
  ``(x, x, x)`` through the original one (a mean instead of the sum would scale the stem's output,
  and everything the backbone learnt after it, by 1/3).

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


def load_init_file(model: torch.nn.Module, path: Path, *, stages: int | None = None) -> tuple[list[str], int]:
    """Initialise ``model``'s backbone from the file at ``path`` (head new, RGB stem folded to grey);
    returns the names of the tensors taken and how many the file holds. A file that does not fit is
    an :class:`InitFileError` naming it."""
    state = read_init_file(path)
    for key, value in model.state_dict().items():
        if key.endswith(".num_batches_tracked") and key not in state:
            state[key] = torch.zeros_like(value)
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
    loaded, held = load_init_file(model, Path(cfg.init_file), stages=cfg.transfer_stages)
    return (f"initialised {len(loaded)} backbone tensors from {cfg.init_file} (of its {held}; weights only; "
            f"stem folded to {cfg.model.in_channels} input channel(s); new head)")
