"""Where a heatmap points, scored against reference boxes: the pointing game and IoBB.

Reference boxes are in pixels of the release's images (NIH's ``BBox_List_2017.csv``: 1,024 px PNGs;
the demo's phantom release writes where it drew each finding in the same format). A heatmap is in
pixels of the evaluation input. ``to_eval_frame`` maps a box through exactly the geometry of the
preprocessing: the central square of the original (``images.resize_square``), resized to the stored
side (shards), resized to the evaluation crop (``loader.gpu_augment`` with ``train=False``). Each
step is a crop or a uniform scale of the whole image, so a box maps by one offset and one factor.

Scores (Zhang et al. 2016; Wang et al. 2017, as CheXNet reports them):
  pointing game   a hit when the heatmap's maximum lies in a box of that finding on that image. Ties
                  are common (a map upsampled from 8 x 8 repeats its border values exactly): the point
                  is the centroid of every pixel within TIE_RTOL of the maximum, whatever the scan order.
                  A flat map (constant, e.g. all zero: nothing speaks for the output) points nowhere:
                  "no saliency", neither a hit nor a miss, counted apart;
  IoBB            area(reference box & detected box) / area(detected box), the detected box bounding
                  the largest connected region of the heatmap at or above HEATMAP_LEVEL x its maximum.
Chance baselines: a random point (hit rate = the share of the image the boxes cover) and the image
centre. The verdict per finding is a one-sided exact binomial test (scipy's ``binomtest``) of the hits
among the maps with saliency against the stronger of the two baselines. numpy and scipy only, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chexflow.evaluate.metrics import proportion_ci

# the detected box: the heatmap at or above half its maximum (Wang et al. tried 60/255 to 180/255)
HEATMAP_LEVEL = 0.5
# pixels this close to the maximum (relative) tie with it: float32 resolves about 7 digits
TIE_RTOL = 1e-6


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


def pointing(heatmap: np.ndarray, boxes: Sequence[tuple[float, float, float, float]]) -> dict:
    """Where a non-flat ``heatmap`` points: the centroid ``(x, y)`` of its tied maxima (pixel i spans
    [i, i + 1)), how many pixels tie, how many of them lie in ``boxes`` (by their centres), and the hit."""
    top = float(heatmap.max())
    rows, cols = np.nonzero(heatmap >= top - TIE_RTOL * abs(top))
    x, y = float(cols.mean()) + 0.5, float(rows.mean()) + 0.5
    inside = int(box_mask(boxes, heatmap.shape[0])[rows, cols].sum())
    return {"point": [x, y], "n_tied": int(rows.size), "n_tied_inside": inside, "hit": _inside(x, y, boxes)}


def score(heatmap: np.ndarray, boxes: Sequence[tuple[float, float, float, float]]) -> dict:
    """Pointing game, IoBB and the chance baselines of one heatmap against one finding's boxes on one
    image (boxes in the heatmap's pixels). A flat heatmap points nowhere: ``no_saliency`` True, ``hit``
    None (neither hit nor miss), IoBB 0."""
    side = heatmap.shape[0]
    if heatmap.shape != (side, side) or not boxes:
        raise ValueError(f"score needs a square heatmap and at least one box, got {heatmap.shape}, {len(boxes)} boxes")
    flat = not np.isfinite(heatmap).all() or float(heatmap.max()) <= float(heatmap.min())
    where = {"point": [None, None], "n_tied": 0, "n_tied_inside": 0, "hit": None} if flat else pointing(heatmap, boxes)
    det = None if flat else detected_box(heatmap)
    return {**where, "no_saliency": bool(flat),
            "iobb": 0.0 if det is None else max(iobb(b, det) for b in boxes),
            "random_point": float(box_mask(boxes, side).mean()),
            "centre_hit": bool(_inside(side / 2.0, side / 2.0, boxes))}


def summarise(rows: Sequence[dict], *, alpha: float = 0.05, auroc_ci: Sequence[float] | None = None) -> dict:
    """One finding's scores. Maps without saliency are counted apart (``n_no_saliency``); over the
    others (``n_pointed``): hits, the hit rate with its Wilson CI, the chance baselines, the range of
    hits any tie-breaking could give, mean IoBB, and the verdict (``binomial_verdict``). ``elsewhere``:
    the test AUROC's CI (``auroc_ci``) lies above 0.5 while the maps point at the finding significantly
    less often than chance: the AUROC rests on other cues."""
    pointed = [r for r in rows if not r["no_saliency"]]
    k = len(pointed)
    hits = int(sum(bool(r["hit"]) for r in pointed))
    random_point = float(np.mean([r["random_point"] for r in pointed])) if k else None
    centre = float(np.mean([r["centre_hit"] for r in pointed])) if k else None
    out = {"n": len(rows), "n_no_saliency": len(rows) - k, "n_pointed": k, "hits": hits,
           "hit_rate": hits / k if k else None, "ci": proportion_ci(hits, k, alpha=alpha),
           "random_point": random_point, "centre_point": centre,
           "n_tied": sum(r["n_tied"] > 1 for r in pointed),
           "hits_range": [sum(r["n_tied_inside"] == r["n_tied"] for r in pointed),
                          sum(r["n_tied_inside"] > 0 for r in pointed)],
           "mean_iobb": float(np.mean([r["iobb"] for r in pointed])) if k else None,
           **binomial_verdict(hits, k, random_point, centre, alpha=alpha)}
    out["elsewhere"] = bool(out["verdict"] == "below chance" and auroc_ci is not None and auroc_ci[0] > 0.5)
    return out


def binomial_verdict(hits: int, n: int, random_point: float | None, centre: float | None, *,
                     alpha: float = 0.05) -> dict:
    """The verdict on ``hits`` of ``n`` pointed maps: one-sided exact binomial tests (scipy) against the
    stronger baseline ``chance`` = max(random point, centre point), taken as a fixed probability. "above
    chance" when P(X >= hits) < alpha, "below chance" when P(X <= hits) < alpha; else "too few to tell"
    when even n of n hits could not reach alpha (chance ** n >= alpha), else "not distinguishable from
    chance". ``verdict_text`` says it with the numbers."""
    from scipy.stats import binomtest
    if n == 0:
        return {"chance": None, "baseline": None, "p_above": None, "p_below": None, "verdict": "no saliency",
                "verdict_text": "no map with saliency: nothing to test"}
    baseline = "centre point" if centre >= random_point else "random point"
    chance = max(random_point, centre)
    p_above = float(binomtest(hits, n, chance, alternative="greater").pvalue)
    p_below = float(binomtest(hits, n, chance, alternative="less").pvalue)
    against = f"{hits}/{n} hits vs the {baseline}'s {chance:.3f}"
    if p_above < alpha:
        verdict, text = "above chance", f"points at the finding more often than chance ({against}, one-sided p = {p_above:.3g})"
    elif p_below < alpha:
        verdict, text = "below chance", f"points at the finding less often than chance ({against}, one-sided p = {p_below:.3g})"
    elif chance ** n >= alpha:
        verdict, text = "too few to tell", (f"too few maps to tell: even {n}/{n} hits would not beat the {baseline}'s "
                                            f"{chance:.3f} at p < {alpha:g}")
    else:
        verdict, text = "not distinguishable", (f"not distinguishable from chance at n = {n} ({against}, one-sided "
                                                f"p = {p_above:.3g})")
    return {"chance": chance, "baseline": baseline, "p_above": p_above, "p_below": p_below, "verdict": verdict,
            "verdict_text": text}
