"""GPU-side augmentation: cropping, flipping, rotating and normalising a batch on the training device
(loader workers only unpack raw uint8 arrays)."""
from __future__ import annotations

import math

import torch

from chexflow.data.config import AugmentConfig


# The network's input normalisation, (pixel / 255 - MEAN) / STD: here once, read by gpu_augment and by
# the exports' metadata (chexflow.predict), which must tell a serving stack the same numbers.
MEAN, STD = 0.5, 0.25


def gpu_augment(images: torch.Tensor, *, out_size: int, train: bool, cfg: AugmentConfig,
                generator: torch.Generator | None, mean: float = MEAN, std: float = STD) -> torch.Tensor:
    """uint8 [B,H,W] on the device -> normalised float [B,1,S,S].

    Training: a random resized crop (area in [scale_min, 1], aspect 3/4..4/3), optional flip and
    rotation, all per sample in one batched ``affine_grid``/``grid_sample``. Evaluation: a resize
    to ``out_size`` (shards are stored square at the evaluation resolution's scale).
    """
    x = images.unsqueeze(1).float().div_(255.0)
    b = x.shape[0]
    if not train:
        if x.shape[-1] != out_size:
            x = torch.nn.functional.interpolate(x, size=(out_size, out_size), mode="bilinear",
                                                antialias=True, align_corners=False)
        return (x - mean) / std
    dev = x.device
    g = generator

    def rand(n):
        return torch.rand(n, generator=g, device=g.device if g is not None else "cpu").to(dev)

    area = cfg.scale_min + (1.0 - cfg.scale_min) * rand(b)
    log_ratio = math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * rand(b)
    ratio = torch.exp(log_ratio)
    sw = torch.sqrt(area * ratio).clamp(max=1.0)
    sh = torch.sqrt(area / ratio).clamp(max=1.0)
    tx = (1 - sw) * (2 * rand(b) - 1)
    ty = (1 - sh) * (2 * rand(b) - 1)
    flip = torch.where(rand(b) < 0.5, -1.0, 1.0) if cfg.flip else torch.ones(b, device=dev)
    angle = (2 * rand(b) - 1) * math.radians(cfg.rotate_deg)
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([
        torch.stack([sw * cos * flip, -sh * sin, tx], dim=1),
        torch.stack([sw * sin * flip, sh * cos, ty], dim=1),
    ], dim=1)
    grid = torch.nn.functional.affine_grid(theta, [b, 1, out_size, out_size], align_corners=False)
    x = torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return (x - mean) / std
