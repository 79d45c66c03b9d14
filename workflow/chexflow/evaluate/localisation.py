"""Where a heatmap points, scored against reference boxes: the pointing game and IoBB.

Reference boxes are in pixels of the release's images (NIH's ``BBox_List_2017.csv``: 1,024 px PNGs;
the demo's phantom release writes where it drew each finding in the same format). A heatmap is in
pixels of the evaluation input. ``to_eval_frame`` maps a box through exactly the geometry of the
preprocessing: the central square of the original (``images.resize_square``), resized to the stored
side (shards), resized to the evaluation crop (``loader.gpu_augment`` with ``train=False``). Each
step is a crop or a uniform scale of the whole image, so a box maps by one offset and one factor.

Scores (Zhang et al. 2016; Wang et al. 2017, as CheXNet reports them):
  pointing game   a hit when the heatmap's maximum lies in a box of that finding on that image;
  IoBB            area(reference box & detected box) / area(detected box), the detected box bounding
                  the largest connected region of the heatmap at or above HEATMAP_LEVEL x its maximum.
Chance baselines: a random point (hit rate = the share of the image the boxes cover) and the image
centre. numpy and scipy only, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chexflow.evaluate.metrics import proportion_ci

# the detected box: the heatmap at or above half its maximum (Wang et al. tried 60/255 to 180/255)
HEATMAP_LEVEL = 0.5


@dataclass(frozen=True)
class Frame:
    """The preprocessing a box goes through: original ``width`` x ``height`` -> central square ->
    ``stored`` px (shards) -> ``crop`` px (evaluation input)."""
    width: int
    height: int
    stored: int
    crop: int

    def __post_init__(self) -> None:
        for name in ("width", "height", "stored", "crop"):
            if getattr(self, name) < 1:
                raise ValueError(f"Frame.{name} must be positive, got {getattr(self, name)}")


def to_eval_frame(box: Sequence[float], frame: Frame) -> tuple[float, float, float, float] | None:
    """Box ``(x, y, w, h)`` in original pixels -> ``(x0, y0, x1, y1)`` in evaluation-input pixels
    (continuous coordinates, pixel i spans [i, i + 1)), clipped to the input; None when the box lies
    outside the central square that was kept."""
    x, y, w, h = (float(v) for v in box)
    side = min(frame.width, frame.height)
    left, top = (frame.width - side) // 2, (frame.height - side) // 2      # as images.resize_square
    scale = (frame.stored / side) * (frame.crop / frame.stored)            # square -> stored -> crop
    x0, x1 = np.clip([(x - left) * scale, (x + w - left) * scale], 0.0, frame.crop)
    y0, y1 = np.clip([(y - top) * scale, (y + h - top) * scale], 0.0, frame.crop)
    if x1 <= x0 or y1 <= y0:
        return None
    return float(x0), float(y0), float(x1), float(y1)


def _inside(px: float, py: float, boxes: Sequence[tuple[float, float, float, float]]) -> bool:
    return any(x0 <= px <= x1 and y0 <= py <= y1 for x0, y0, x1, y1 in boxes)


def box_mask(boxes: Sequence[tuple[float, float, float, float]], side: int) -> np.ndarray:
    """Pixels (by their centres) inside any of ``boxes``, on a ``side`` x ``side`` grid."""
    centres = np.arange(side) + 0.5
    mask = np.zeros((side, side), bool)
    for x0, y0, x1, y1 in boxes:
        rows = (centres >= y0) & (centres <= y1)
        cols = (centres >= x0) & (centres <= x1)
        mask |= rows[:, None] & cols[None, :]
    return mask


def detected_box(heatmap: np.ndarray, level: float = HEATMAP_LEVEL) -> tuple[float, float, float, float] | None:
    """The box bounding the largest connected region of ``heatmap >= level x max`` (None: a flat map)."""
    from scipy import ndimage
    top, bottom = float(heatmap.max()), float(heatmap.min())
    if not np.isfinite(top) or top <= bottom or top <= 0:
        return None
    regions, n = ndimage.label(heatmap >= level * top)
    sizes = np.bincount(regions.ravel())[1:]
    rows, cols = ndimage.find_objects(regions)[int(np.argmax(sizes))]
    return float(cols.start), float(rows.start), float(cols.stop), float(rows.stop)


def iobb(reference: tuple[float, float, float, float], detected: tuple[float, float, float, float]) -> float:
    """Intersection of the two boxes over the detected box's area (Wang et al. 2017)."""
    ix = max(0.0, min(reference[2], detected[2]) - max(reference[0], detected[0]))
    iy = max(0.0, min(reference[3], detected[3]) - max(reference[1], detected[1]))
    area = (detected[2] - detected[0]) * (detected[3] - detected[1])
    return ix * iy / area if area > 0 else 0.0


def score(heatmap: np.ndarray, boxes: Sequence[tuple[float, float, float, float]]) -> dict:
    """Pointing game, IoBB and the chance baselines of one heatmap against one finding's boxes on one
    image (boxes in the heatmap's pixels). A flat heatmap points nowhere: a miss, ``flat`` True."""
    side = heatmap.shape[0]
    if heatmap.shape != (side, side) or not boxes:
        raise ValueError(f"score needs a square heatmap and at least one box, got {heatmap.shape}, {len(boxes)} boxes")
    flat = not np.isfinite(heatmap).all() or float(heatmap.max()) <= float(heatmap.min())
    row, col = np.unravel_index(int(np.argmax(heatmap)), heatmap.shape)
    hit = (not flat) and _inside(col + 0.5, row + 0.5, boxes)
    det = None if flat else detected_box(heatmap)
    return {"hit": bool(hit), "flat": bool(flat), "point": [int(col), int(row)],
            "iobb": 0.0 if det is None else max(iobb(b, det) for b in boxes),
            "random_point": float(box_mask(boxes, side).mean()),
            "centre_hit": bool(_inside(side / 2.0, side / 2.0, boxes))}


def summarise(rows: Sequence[dict], *, alpha: float = 0.05) -> dict:
    """One finding's scores: hit rate with its Wilson CI, the chance baselines, mean IoBB, and whether
    the hit rate is above chance (its CI's low end above the better of a random point and the centre)."""
    n = len(rows)
    if n == 0:
        return {"n": 0, "hits": 0, "hit_rate": None, "ci": None, "random_point": None, "centre_point": None,
                "chance": None, "mean_iobb": None, "n_flat": 0, "above_chance": None}
    hits = sum(r["hit"] for r in rows)
    ci = proportion_ci(hits, n, alpha=alpha)
    random_point = float(np.mean([r["random_point"] for r in rows]))
    centre = float(np.mean([r["centre_hit"] for r in rows]))
    chance = max(random_point, centre)
    return {"n": n, "hits": int(hits), "hit_rate": hits / n, "ci": ci, "random_point": random_point,
            "centre_point": centre, "chance": chance, "mean_iobb": float(np.mean([r["iobb"] for r in rows])),
            "n_flat": int(sum(r["flat"] for r in rows)), "above_chance": bool(ci[0] > chance)}
