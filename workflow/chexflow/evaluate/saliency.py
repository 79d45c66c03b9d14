"""Grad-CAM heatmaps of the fine-tuned model (Captum's ``LayerGradCam``, not hand-written).

Grad-CAM weighs a convolutional layer's feature maps by the pooled gradient of one output and keeps
the positive part (Selvaraju et al. 2017); its resolution is that layer's. CheXNet's class activation
maps come from the last stage of a DenseNet-121 at 224 px: 7 x 7. At the demo's 32 px the last stage
of a ResNet-18 is 1 x 1 and points nowhere, so the layer is chosen by resolution: the deepest backbone
stage whose output is at least ``min_side`` px on a side at the evaluation crop (``choose_layer``).
The map is upsampled to the input bilinearly (Captum's ``LayerAttribution.interpolate``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from chexflow.settings import ConfigError
from chexflow.train.models import ModelError, backbone_stages, ieee_fp32


def stage_sides(model: torch.nn.Module, *, crop: int, in_channels: int, device) -> list[tuple[str, int]]:
    """(name, output side in px) of every backbone stage at a ``crop`` px input (one dummy forward)."""
    stages = backbone_stages(model)
    sides: dict[str, int] = {}

    def record(name: str):
        def hook(module, args, out) -> None:      # returns None: the output is left as it is
            sides.setdefault(name, int(out.shape[-1]))
        return hook

    hooks = [module.register_forward_hook(record(name)) for name, module in stages]
    try:
        with torch.no_grad():
            model(torch.zeros(1, in_channels, crop, crop, device=device))
    finally:
        for h in hooks:
            h.remove()
    return [(name, sides[name]) for name, _ in stages if name in sides]


def choose_layer(model: torch.nn.Module, *, crop: int, in_channels: int, min_side: int, device,
                 layer: str = "auto") -> tuple[str, torch.nn.Module, int]:
    """The Grad-CAM layer: ``layer`` by name, or (``auto``) the deepest backbone stage whose output is
    at least ``min_side`` px (the first stage if none is). Returns (name, module, output side)."""
    sides = stage_sides(model, crop=crop, in_channels=in_channels, device=device)
    if not sides:
        raise ModelError("the model has no backbone stage with a spatial output for Grad-CAM")
    if layer != "auto":
        found = dict(sides)
        if layer not in found:
            raise ConfigError(f"evaluate.saliency.layer: {layer!r} is not a backbone stage of this model "
                             f"(stages: {', '.join(n for n, _ in sides)})")
        name, side = layer, found[layer]
    else:
        fine = [(n, s) for n, s in sides if s >= min_side]
        name, side = fine[-1] if fine else sides[0]
    return name, model.get_submodule(name), side


def gradcam(model: torch.nn.Module, layer: torch.nn.Module, inputs: torch.Tensor, targets: Sequence[int], *,
            batch_size: int) -> np.ndarray:
    """Grad-CAM of output ``targets[i]`` on ``inputs[i]`` ([N, C, S, S], normalised as the model sees
    them), upsampled to S x S: float32 [N, S, S], >= 0 (zero where nothing speaks for the output)."""
    from captum.attr import LayerAttribution, LayerGradCam
    if len(targets) != inputs.shape[0]:
        raise ValueError(f"{inputs.shape[0]} inputs but {len(targets)} targets")
    model.eval()
    cam = LayerGradCam(model, layer)
    side = inputs.shape[-1]
    out = []
    device = next(model.parameters()).device
    for b0 in range(0, inputs.shape[0], batch_size):
        x = inputs[b0:b0 + batch_size].to(device)
        t = [int(v) for v in targets[b0:b0 + batch_size]]
        with ieee_fp32():
            attr = cam.attribute(x, target=t, relu_attributions=True)
        up = LayerAttribution.interpolate(attr, (side, side), interpolate_mode="bilinear")
        out.append(up[:, 0].detach().float().cpu().numpy())
    if not out:
        return np.zeros((0, side, side), np.float32)
    return np.clip(np.concatenate(out), 0.0, None).astype(np.float32)
