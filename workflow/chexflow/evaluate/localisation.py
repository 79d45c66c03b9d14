"""Where a heatmap points, scored against reference boxes: the pointing game and IoBB.

Reference boxes are in pixels of the release's images (NIH's ``BBox_List_2017.csv``: 1,024 px PNGs;
the demo's phantom release writes where it drew each finding in the same format). A heatmap is in
pixels of the evaluation input. ``to_eval_frame`` maps a box through exactly the geometry of the
preprocessing: the central square of the original (``images.resize_square``), resized to the stored
side (shards), resized to the evaluation crop (``augment.gpu_augment`` with ``train=False``). Each
step is a crop or a uniform scale of the whole image, so a box maps by one offset and one factor.

Scores (Zhang et al. 2016; Wang et al. 2017, as CheXNet reports them):
  pointing game   a hit when the heatmap's maximum lies in a box of that finding on that image. Ties
                  are common (a map upsampled from 8 x 8 repeats its border values exactly): the point
                  is the tied maximum (every pixel within TIE_RTOL of the maximum ties) nearest the
                  centroid of them all, the first in row-major order among equally near ones, whatever
                  the scan order. The point is always a maximum, so a hit always has one in a box and
                  the hits lie within the range any tie-breaking could give. A flat map (constant,
                  e.g. all zero: nothing speaks for the output) points nowhere: "no saliency",
                  neither a hit nor a miss, counted apart;
  IoBB            area(reference box & detected box) / area(detected box), the detected box bounding
                  the largest connected region of the heatmap at or above HEATMAP_LEVEL x its maximum.
Chance baselines, on the same maps: a random point (on a map, it hits with the share of the image its
boxes cover) and the image centre (a pointing rule of its own). The verdict per finding is one test at
level alpha, two-sided, split alpha / 2 per direction (:func:`pointing_verdict`):
  above chance    the maps beat both baselines: the exact Poisson-binomial test against the random
                  point (each map its own probability, scipy's ``poisson_binom``) and the exact
                  McNemar test against the centre (the maps where exactly one of the two rules hits:
                  scipy's ``binomtest`` at 1/2), each one-sided below alpha / 2. Both must hold (an
                  intersection-union test), so the pair keeps level alpha / 2;
  below chance    the maps hit less often than a random point (the Poisson-binomial's lower tail
                  below alpha / 2): they avoid the finding. Hitting less often than the centre is no
                  such sign (the centre rule knows where findings tend to lie) and is not tested.
numpy and scipy only, no torch.
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
    """Where a non-flat ``heatmap`` points: the tied maximum nearest the centroid of all tied maxima
    (``(x, y)`` of its centre; pixel i spans [i, i + 1)), how many pixels tie, how many of them lie in
    ``boxes`` (by their centres), and the hit (the point's pixel in a box)."""
    top = float(heatmap.max())
    rows, cols = np.nonzero(heatmap >= top - TIE_RTOL * abs(top))        # row-major order
    far = (rows - rows.mean()) ** 2 + (cols - cols.mean()) ** 2
    k = int(np.argmin(far))                          # the first of the nearest, in row-major order
    inside = box_mask(boxes, heatmap.shape[0])
    return {"point": [float(cols[k]) + 0.5, float(rows[k]) + 0.5], "n_tied": int(rows.size),
            "n_tied_inside": int(inside[rows, cols].sum()), "hit": bool(inside[rows[k], cols[k]])}


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
    hits any tie-breaking could give, mean IoBB, and the verdict (:func:`pointing_verdict`). ``elsewhere``:
    the test AUROC's CI (``auroc_ci``) lies above 0.5 while the maps point at the finding significantly
    less often than a random point: the AUROC rests on other cues."""
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
           **pointing_verdict([bool(r["hit"]) for r in pointed], [bool(r["centre_hit"]) for r in pointed],
                              [float(r["random_point"]) for r in pointed], alpha=alpha)}
    out["elsewhere"] = bool(out["verdict"] == "below chance" and auroc_ci is not None and auroc_ci[0] > 0.5)
    return out


def pointing_verdict(hit: Sequence[bool], centre_hit: Sequence[bool], share: Sequence[float], *,
                     alpha: float = 0.05) -> dict:
    """The verdict on the maps with saliency of one finding: ``hit[i]`` (the heatmap's point),
    ``centre_hit[i]`` (the image centre's) and ``share[i]`` (the share of map i its boxes cover: a random
    point's chance) per map. One test at level ``alpha``, two-sided, ``alpha / 2`` per direction:

    - ``p_above_random``: exact Poisson-binomial P(hits >= observed) of independent maps hit with
      probability ``share[i]`` (scipy's ``poisson_binom``); ``p_below``: P(hits <= observed);
    - ``p_above_centre``: the exact one-sided McNemar test against the centre rule on the same maps:
      of the maps where exactly one of the two hits (``discordant``: heatmap only, centre only), the
      heatmap's count against Binomial(n discordant, 1/2) (scipy's ``binomtest``); 1 without one;
    - ``p_above`` = max(p_above_random, p_above_centre): above chance means above both (an
      intersection-union test: level alpha / 2 without correction).

    "above chance" when p_above < alpha / 2; "below chance" when p_below < alpha / 2; else "too few to
    tell" when even all maps hit could not reach alpha / 2, else "not distinguishable". ``verdict_text``
    says it with the numbers."""
    from scipy.stats import binomtest, poisson_binom
    hit, centre_hit = np.asarray(hit, bool), np.asarray(centre_hit, bool)
    share = np.asarray(share, float)
    n, hits, side = int(hit.size), int(hit.sum()), alpha / 2.0
    if n == 0:
        return {"p_above": None, "p_below": None, "p_above_random": None, "p_above_centre": None,
                "discordant": None, "alpha": alpha, "verdict": "no saliency",
                "verdict_text": "no map with saliency: nothing to test"}
    chance = poisson_binom(share)
    p_random, p_below = float(chance.sf(hits - 1)), float(chance.cdf(hits))
    only_map, only_centre = int((hit & ~centre_hit).sum()), int((~hit & centre_hit).sum())
    p_centre = (float(binomtest(only_map, only_map + only_centre, 0.5, alternative="greater").pvalue)
                if only_map + only_centre else 1.0)
    p_above = max(p_random, p_centre)
    centre_hits = int(centre_hit.sum())
    versus = (f"{hits}/{n} hits; a random point: {share.sum():.1f} expected, Poisson-binomial p = {p_random:.3g}; "
              f"the centre: {centre_hits}/{n} on the same maps ({only_map} hit by the map only, {only_centre} by "
              f"the centre only), McNemar p = {p_centre:.3g}")
    best = max(float(np.prod(share)), 0.5 ** (n - centre_hits) if n > centre_hits else 1.0)   # all n maps hit
    if p_above < side:
        verdict, text = "above chance", f"points at the finding more often than chance ({versus}; each < {side:g})"
    elif p_below < side:
        verdict, text = "below chance", (f"points at the finding less often than a random point ({hits}/{n} hits, "
                                         f"{share.sum():.1f} expected; Poisson-binomial p = {p_below:.3g} < {side:g})")
    elif best >= side:
        verdict, text = "too few to tell", (f"too few maps to tell: even {n}/{n} hits would not beat both the random "
                                            f"point and the centre at p < {side:g} (smallest p {best:.3g})")
    else:
        verdict, text = "not distinguishable", f"not distinguishable from chance at n = {n} ({versus})"
    return {"p_above": p_above, "p_below": p_below, "p_above_random": p_random, "p_above_centre": p_centre,
            "discordant": [only_map, only_centre], "alpha": alpha, "verdict": verdict, "verdict_text": text}
