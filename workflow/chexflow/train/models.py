"""Backbones from torchvision with a grey-image stem and a task head."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torchvision

from chexflow.train.weights import weights_problem


class ModelError(ValueError):
    pass


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """float32 computed as float32 on CUDA while inside: no TF32 in cuDNN convolutions (PyTorch lets
    them use it by default) nor in matmuls; the flags are restored on exit. Inference runs in it
    (evaluation's scores, predict, Grad-CAM): with TF32 a ResNet's probabilities on an H200 moved by
    up to 8e-4 from the CPU's, without it they agree to float32 rounding. Training does not (bf16)."""
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul


def _head_name(model: torch.nn.Module) -> str:
    """Name of the final classification Linear (fc, classifier, classifier.3, heads.head, ...)."""
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not names:
        raise ModelError(f"{type(model).__name__}: no Linear classification layer")
    return names[-1]


def _adapt_stem(model: torch.nn.Module, in_channels: int) -> None:
    """Replace the first conv by one taking ``in_channels`` (weights summed/averaged over channels)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            if module.in_channels == in_channels:
                return
            new = torch.nn.Conv2d(in_channels, module.out_channels, module.kernel_size, module.stride,
                                  module.padding, module.dilation, module.groups, module.bias is not None)
            with torch.no_grad():
                w = module.weight.sum(dim=1, keepdim=True) / in_channels
                new.weight.copy_(w.repeat(1, in_channels, 1, 1))
                if module.bias is not None:
                    new.bias.copy_(module.bias)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], new)
            return
    raise ModelError("model has no Conv2d stem")


def build_model(arch: str, *, in_channels: int, num_outputs: int, dropout: float = 0.0) -> torch.nn.Module:
    """A torchvision ``arch`` (random init) with an ``in_channels`` stem and ``num_outputs`` logits."""
    try:
        model = torchvision.models.get_model(arch, weights=None)
    except ValueError as exc:
        raise ModelError(f"model.arch: unknown torchvision model {arch!r}") from exc
    _adapt_stem(model, in_channels)
    name = _head_name(model)
    lin = model.get_submodule(name)
    new_head = torch.nn.Sequential(torch.nn.Dropout(dropout), torch.nn.Linear(lin.in_features, num_outputs))
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    setattr(parent, name.rsplit(".", 1)[-1], new_head)
    return model


def head_prefix(model: torch.nn.Module) -> str:
    """State-dict prefix of the task head (replaced at fine-tuning, never loaded from pretraining)."""
    name = _head_name(model)
    return name.rsplit(".", 1)[0] + "." if name.endswith(".1") else name + "."


def load_backbone(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *,
                  stages: int | None = None, source: str = "the pretrained model") -> list[str]:
    """Copy backbone weights (everything but the head) from a pretrained state dict.

    The file's backbone must fit this model's (``weights.weights_problem``: every backbone tensor
    present, none the architecture does not have, the same shapes), except that the stem is adapted
    when the pretrained model saw a different number of channels; anything else is a ModelError
    naming ``source`` and the first mismatching keys. ``stages``: only the first ``stages`` backbone
    stages (:func:`backbone_stages`) are taken, the later ones keep their random init (None: the
    whole backbone). Returns the names of the tensors taken.
    """
    prefix = head_prefix(model)
    own = model.state_dict()
    keep = None
    if stages is not None:
        all_stages = backbone_stages(model)
        if stages < 1 or stages > len(all_stages):
            raise ModelError(f"transfer_stages: {stages} is outside 1..{len(all_stages)} "
                             f"(stages: {', '.join(s for s, _ in all_stages)})")
        keep = tuple(f"{name}." for name, _ in all_stages[:stages])
    theirs = {k: _adapt_channels(v, own.get(k)) for k, v in state_dict.items() if not k.startswith(prefix)}
    problem = weights_problem({k: v for k, v in own.items() if not k.startswith(prefix)}, theirs)
    if problem:
        raise ModelError(f"{source}: refused: its backbone does not fit this model's: {problem}")
    loaded = [k for k in theirs if keep is None or k.startswith(keep)]
    own.update({k: theirs[k] for k in loaded})
    model.load_state_dict(own)
    return loaded


def _adapt_channels(value, own: torch.Tensor | None):
    """A stem convolution's weights summed over its input channels and spread over ``own``'s."""
    if (isinstance(value, torch.Tensor) and own is not None and value.dim() == 4 and own.dim() == 4
            and value.shape[1] != own.shape[1] and value.shape[0] == own.shape[0]
            and value.shape[2:] == own.shape[2:]):
        return value.sum(dim=1, keepdim=True).repeat(1, own.shape[1], 1, 1) / own.shape[1]
    return value


def param_groups(model: torch.nn.Module, *, backbone_lr_mult: float = 1.0) -> list[dict]:
    """The trainable parameters as optimizer groups: the backbone, then the task head (the last group).

    Each group carries ``lr_mult``, its factor on the schedule's LR (:func:`schedule.make_scheduler`):
    ``backbone_lr_mult`` for the backbone (a pretrained backbone is adapted more gently than the
    new head learns), 1.0 for the head. Frozen parameters are left out; an empty group is dropped.
    """
    if backbone_lr_mult <= 0:
        raise ModelError(f"optim.backbone_lr_mult must be > 0, got {backbone_lr_mult}")
    prefix = head_prefix(model)
    backbone, head = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (head if name.startswith(prefix) else backbone).append(p)
    groups = [{"params": backbone, "lr_mult": float(backbone_lr_mult)}, {"params": head, "lr_mult": 1.0}]
    return [g for g in groups if g["params"]]


def backbone_stages(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The backbone's leading modules in order, the unit of ``freeze``.

    The top-level children holding parameters, without the head; a single container child
    (densenet's ``features``) is opened. resnet18: conv1, bn1, layer1, layer2, layer3, layer4.
    """
    head = head_prefix(model).rstrip(".")
    children = [(n, m) for n, m in model.named_children()
                if n != head.split(".")[0] and any(True for _ in m.parameters())]
    if len(children) == 1 and len(list(children[0][1].named_children())) > 1:
        name, box = children[0]
        children = [(f"{name}.{n}", m) for n, m in box.named_children() if any(True for _ in m.parameters())]
    return children


def freeze_backbone(model: torch.nn.Module, n: int) -> list[str]:
    """Stop gradients through the first ``n`` backbone stages; returns their names."""
    stages = backbone_stages(model)
    if n < 0 or n > len(stages):
        raise ModelError(f"freeze: {n} is outside 0..{len(stages)} (stages: {', '.join(s for s, _ in stages)})")
    for _, module in stages[:n]:
        for p in module.parameters():
            p.requires_grad_(False)
    return [s for s, _ in stages[:n]]
