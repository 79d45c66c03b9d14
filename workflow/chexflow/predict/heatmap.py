"""``chexflow predict``'s heatmaps: the report's Grad-CAM (``chexflow.evaluate.saliency``) of each
image's most likely finding, laid over the image as a PNG.

Same method, layer and look as the report's gallery: Captum's Grad-CAM at the layer the evaluation
used (its metrics.json), else at the deepest backbone stage whose output is at least
``evaluate.saliency.min_side`` px a side (its default) at the model's crop (at the demo's 32 px a
ResNet-18's last stage is 1 x 1 and points nowhere), each map divided by its maximum, the "jet"
colour map at 0.4 opacity.
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chexflow.evaluate import saliency
from chexflow.evaluate.config import SaliencyConfig
from chexflow.fsutil import write_bytes_atomic
from chexflow.predict.model import Predictor


def target(predictor: Predictor, probs: np.ndarray) -> int:
    """The label a heatmap shows: the most likely finding, else the most likely label."""
    found = set(predictor.findings(probs))
    candidates = [j for j, label in enumerate(predictor.labels) if label in found] or range(len(probs))
    return max(candidates, key=lambda j: probs[j])


def layer(predictor: Predictor) -> torch.nn.Module:
    """The Grad-CAM layer of the predictor's model: the evaluation's, else the report's rule
    (``saliency.choose_layer`` with the default ``evaluate.saliency.min_side``)."""
    if predictor.cam_layer is not None:
        return predictor.model.get_submodule(predictor.cam_layer)
    return saliency.choose_layer(predictor.model, crop=predictor.preprocess.crop, in_channels=1,
                                 min_side=SaliencyConfig().min_side, device=predictor.device)[1]


def maps(predictor: Predictor, cam_layer: torch.nn.Module, images: torch.Tensor, targets: list[int]) -> np.ndarray:
    """Grad-CAM ``float32 [B, crop, crop]`` (>= 0, not scaled) of ``targets[i]`` on uint8 ``images[i]``."""
    x = predictor.preprocess.network_input(images.to(predictor.device))
    return saliency.gradcam(predictor.model, cam_layer, x, targets, batch_size=len(targets))


def overlay_png(grey: np.ndarray, heat: np.ndarray, *, alpha: float = 0.4, cmap: str = "jet") -> bytes:
    """PNG bytes: the uint8 grey image with ``heat`` (>= 0, any size: divided by its maximum and resized
    bilinearly to the image) laid over it in colour map ``cmap`` at opacity ``alpha``."""
    from matplotlib import colormaps
    from PIL import Image

    h, w = grey.shape
    top = float(heat.max())
    heat = heat / top if top > 0 else np.zeros_like(heat)
    heat = np.asarray(Image.fromarray(heat.astype(np.float32)).resize((w, h), Image.Resampling.BILINEAR))
    colour = colormaps[cmap](np.clip(heat, 0.0, 1.0))[..., :3]
    base = np.repeat(grey[..., None].astype(np.float64) / 255.0, 3, axis=-1)
    rgb = np.rint(((1 - alpha) * base + alpha * colour) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Writer:
    """Writes the heatmaps of the readable files of a batch to ``folder`` (``<index>-<file stem>.png``:
    files of the same name in different folders stay apart) and names them relative to ``csv_dir``."""
    predictor: Predictor
    folder: Path
    csv_dir: Path

    def __post_init__(self) -> None:
        self.layer = layer(self.predictor)

    def write(self, items: list[tuple[int, np.ndarray, Path]], probs: np.ndarray) -> dict[int, dict]:
        """``{index: {"heatmap_label", "heatmap"}}`` for ``items`` ``(index, stored pixels, file)``."""
        targets = [target(self.predictor, p) for p in probs]
        cams = maps(self.predictor, self.layer, torch.from_numpy(np.stack([px for _, px, _ in items])), targets)
        out = {}
        for (i, pixels, file), j, cam in zip(items, targets, cams):
            path = self.folder / f"{i:06d}-{_safe(file.stem)}.png"
            write_bytes_atomic(path, overlay_png(pixels, cam))
            out[i] = {"heatmap_label": self.predictor.labels[j], "heatmap": os.path.relpath(path, self.csv_dir)}
        return out


def _safe(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:80] or "image"
