"""Saliency: where in an image the network found a finding (Grad-CAM, Selvaraju et al. 2017, via Captum).

``gradcam`` is the one saliency method; ``chexflow predict`` draws its heatmaps with it (and so
should the report). The layer is the backbone's last stage (``models.backbone_stages``: resnet's
layer4, densenet's final norm), the usual Grad-CAM choice: its maps are coarse (7 x 7 at 224 px for a
resnet) but reflect what the classifier reads.
"""
from __future__ import annotations

import io
from typing import Sequence

import numpy as np
import torch

from chexflow.train.models import backbone_stages


def target_layer(model: torch.nn.Module) -> torch.nn.Module:
    return backbone_stages(model)[-1][1]


def gradcam(model: torch.nn.Module, x: torch.Tensor, targets: Sequence[int]) -> np.ndarray:
    """Grad-CAM maps ``float32 [B, H, W]`` in [0, 1] of output ``targets[i]`` for input ``x[i]``
    (``x``: the network's normalised input ``[B, C, H, W]``), upsampled bilinearly to ``H x W``
    and divided by each map's maximum (a map without positive evidence stays 0)."""
    from captum.attr import LayerAttribution, LayerGradCam

    model.eval()
    cam = LayerGradCam(model, target_layer(model))
    with torch.enable_grad():
        attr = cam.attribute(x, target=[int(t) for t in targets], relu_attributions=True)
    maps = LayerAttribution.interpolate(attr, tuple(x.shape[-2:]), interpolate_mode="bilinear")[:, 0]
    maps = maps.detach().float().clamp_min(0)
    peak = maps.flatten(1).amax(dim=1).view(-1, 1, 1)
    return torch.where(peak > 0, maps / peak.clamp_min(1e-12), torch.zeros_like(maps)).cpu().numpy()


def overlay_png(grey: np.ndarray, heat: np.ndarray, *, alpha: float = 0.4, cmap: str = "jet") -> bytes:
    """PNG bytes: the uint8 grey image with ``heat`` (in [0, 1], any size: resized bilinearly to the
    image) laid over it in colour map ``cmap`` at opacity ``alpha``."""
    from matplotlib import colormaps
    from PIL import Image

    h, w = grey.shape
    heat = np.asarray(Image.fromarray(heat.astype(np.float32)).resize((w, h), Image.Resampling.BILINEAR))
    colour = colormaps[cmap](np.clip(heat, 0.0, 1.0))[..., :3]
    base = np.repeat(grey[..., None].astype(np.float64) / 255.0, 3, axis=-1)
    rgb = np.rint(((1 - alpha) * base + alpha * colour) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()
