"""Where a heatmap points, scored against reference boxes: the pointing game and IoBB.

Reference boxes are in pixels of the release's images (NIH's ``BBox_List_2017.csv``: 1,024 px PNGs;
the demo's phantom release writes where it drew each finding in the same format). A heatmap is in
pixels of the evaluation input. ``to_eval_frame`` maps a box through exactly the geometry of the
preprocessing: the central square of the original (``images.resize_square``), resized to the stored
side (shards), resized to the evaluation crop (``augment.gpu_augment`` with ``train=False``). Each
step is a crop or a uniform scale of the whole image, so a box maps by one offset and one factor.

Scores (Zhang et al. 2016; Wang et al. 2017, as CheXNet reports them):
  pointing game   a hit when the heatmap's maximum lies in a box of that finding on that image (which of
                  tied maxima is the point, and a flat map's "no saliency": :func:`pointing`, :func:`score`);
  IoBB            area(reference box & detected box) / area(detected box), the detected box bounding
                  the largest connected region of the heatmap at or above HEATMAP_LEVEL x its maximum.
The chance baselines (a random point, the image centre) and the verdict, patients as the unit:
:func:`pointing_verdict`, and docs/evaluation.md, "Where the model looks".
numpy and scipy only, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chexflow.evaluate import intervals

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


class SaliencyError(ValueError):
    """A heatmap that cannot be scored (a NaN or infinite pixel: the model's gradients are not finite)."""


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


def score(heatmap: np.ndarray, boxes: Sequence[tuple[float, float, float, float]], *, where: str = "a heatmap") -> dict:
    """Pointing game, IoBB and the chance baselines of one heatmap against one finding's boxes on one
    image (boxes in the heatmap's pixels). A flat heatmap points nowhere: ``no_saliency`` True, ``hit``
    None (neither hit nor miss), IoBB 0. A non-finite pixel is refused (``SaliencyError`` naming ``where``):
    it is a failure of the model, not a map without saliency."""
    side = heatmap.shape[0]
    if heatmap.shape != (side, side) or not boxes:
        raise ValueError(f"score needs a square heatmap and at least one box, got {heatmap.shape}, {len(boxes)} boxes")
    bad = int((~np.isfinite(heatmap)).sum())
    if bad:
        raise SaliencyError(f"{where}: {bad} of {heatmap.size} Grad-CAM pixels are NaN or infinite (the model's "
                            "scores or gradients are not finite)")
    flat = float(heatmap.max()) <= float(heatmap.min())
    where_ = {"point": [None, None], "n_tied": 0, "n_tied_inside": 0, "hit": None} if flat else pointing(heatmap, boxes)
    det = None if flat else detected_box(heatmap)
    inside = box_mask(boxes, side)
    return {**where_, "no_saliency": bool(flat),
            "iobb": 0.0 if det is None else max(iobb(b, det) for b in boxes),
            "random_point": float(inside.mean()),
            "centre_hit": bool(inside[side // 2, side // 2])}      # the centre's pixel, by its centre, as hits


def summarise(rows: Sequence[dict], *, min_patients: int = 1, n_resamples: int = 1000, seed: int = 0,
              alpha: float = 0.05, auroc_ci: Sequence[float] | None = None) -> dict:
    """One finding's scores (``rows``: :func:`score`'s, each with its ``patient``). Maps without saliency
    are counted apart (``n_no_saliency``); over the others (``n_pointed``, of ``n_patients``): hits, the hit
    rate and mean IoBB each with its interval by patients (``intervals``), the chance baselines, the range
    of hits any tie-breaking could give, and the verdict (:func:`pointing_verdict`). ``elsewhere``: the
    test AUROC's CI (``auroc_ci``) lies above 0.5 while the peak falls in the boxes less often than a
    random point's: both measured, neither explains the other."""
    pointed = [r for r in rows if not r["no_saliency"]]
    k = len(pointed)
    patients = np.asarray([r["patient"] for r in pointed], dtype=object)
    hit = np.asarray([bool(r["hit"]) for r in pointed], bool)
    boot = {"minimum": min_patients, "n_resamples": n_resamples, "seed": seed, "alpha": alpha}
    rate = intervals.rate(hit, np.ones(k, bool), patients, **boot) if k else None
    iobb_ = intervals.mean(np.asarray([r["iobb"] for r in pointed], float), patients, **boot) if k else None
    out = {"n": len(rows), "n_no_saliency": len(rows) - k, "n_pointed": k, "hits": int(hit.sum()),
           "n_patients": int(np.unique(patients).size) if k else 0,
           "hit_rate": rate["rate"] if k else None, "ci": rate["ci"] if k else None,
           "ci_interval": rate["interval"] if k else None, "too_few": rate["too_few"] if k else None,
           "random_point": float(np.mean([r["random_point"] for r in pointed])) if k else None,
           "centre_point": float(np.mean([r["centre_hit"] for r in pointed])) if k else None,
           "n_tied": sum(r["n_tied"] > 1 for r in pointed),
           "hits_range": [sum(r["n_tied_inside"] == r["n_tied"] for r in pointed),
                          sum(r["n_tied_inside"] > 0 for r in pointed)],
           "mean_iobb": iobb_["value"] if k else None, "mean_iobb_ci": iobb_["ci"] if k else None,
           **pointing_verdict(patients, hit, [bool(r["centre_hit"]) for r in pointed],
                              [float(r["random_point"]) for r in pointed], alpha=alpha, min_patients=min_patients,
                              seed=seed)}
    out["elsewhere"] = bool(out["verdict"] == "below chance" and auroc_ci is not None and auroc_ci[0] > 0.5)
    return out


def _kl(a: float, b: float) -> float:
    """Kullback-Leibler divergence of Bernoulli(a) from Bernoulli(b) (inf where b cannot give a)."""
    from scipy.special import rel_entr
    return float(rel_entr(a, b) + rel_entr(1.0 - a, 1.0 - b))


def _against_random(h: np.ndarray, c: np.ndarray, single: bool, hits: int, share: np.ndarray) -> tuple[float, float, str]:
    """(p above, p below, the test's name) of the patients' hit shares ``h`` against a random point's ``c``."""
    from scipy.stats import poisson_binom
    if single:                                        # one map per patient: the maps are the patients
        chance = poisson_binom(share)
        return float(chance.sf(hits - 1)), float(chance.cdf(hits)), "exact Poisson-binomial, one map per patient"
    n, mean_h, mean_c = h.size, float(h.mean()), float(c.mean())
    bound = float(np.exp(-n * _kl(mean_h, mean_c)))
    return (bound if mean_h > mean_c else 1.0, bound if mean_h < mean_c else 1.0,
            "Hoeffding's bound on the mean of the patients' hit shares")


def _sign_flip(d: np.ndarray, seed: int) -> float:
    """One-sided p (greater) of the exact sign-flip test of the patients' differences ``d`` (scipy's
    ``permutation_test``: exact up to 2 ** 16 sign patterns, else as many random ones)."""
    from scipy.stats import permutation_test
    d = d[d != 0]
    if d.size < 2:                  # one patient's difference: its sign is + or - with 1/2 each
        return 1.0 if d.size == 0 or d[0] < 0 else 0.5
    res = permutation_test((d,), lambda x, axis: np.sum(x, axis=axis), permutation_type="samples",
                           alternative="greater", n_resamples=2 ** 16, random_state=seed)
    return float(res.pvalue)


def pointing_verdict(patients: Sequence, hit: Sequence[bool], centre_hit: Sequence[bool], share: Sequence[float], *,
                     alpha: float = 0.05, min_patients: int = 1, seed: int = 0) -> dict:
    """The verdict on the maps with saliency of one finding, patients as the unit: per map its
    ``patient``, ``hit`` (the heatmap's peak in a box), ``centre_hit`` (the centre's pixel in a box) and
    ``share`` (the share of the map its boxes cover: a random point's chance). Per patient: its share of
    hits ``h``, the centre's ``e``, the random point's ``c`` (means over its maps). One test at level
    ``alpha``, two-sided, ``alpha / 2`` per direction (docs/evaluation.md):

    - ``p_above_random`` / ``p_below``: ``exp(-P KL(mean h || mean c))`` on the side the mean lies
      (Hoeffding 1963: independent patients, each share in [0, 1], any dependence within a patient), 1 on
      the other; the exact Poisson-binomial where every patient has one map;
    - ``p_above_centre``: the exact sign-flip test over patients of ``h - e`` (McNemar's exact test
      where every patient has one map); ``discordant``: patients with ``h > e``, with ``h < e``;
    - ``p_above`` = max of the two: above chance means above both.

    Fewer than ``min_patients`` patients: "too few", no p. Else "above chance", "below chance", "too few
    to tell" (even every map hit could not reach alpha / 2), or "not distinguishable". ``verdict_text``
    names the unit, the level and the patients and maps it rests on."""
    hit, centre_hit = np.asarray(hit, bool), np.asarray(centre_hit, bool)
    share, patients = np.asarray(share, float), np.asarray(patients, dtype=object)
    side = alpha / 2.0
    keys, pidx = np.unique(patients.astype(str), return_inverse=True) if hit.size else (np.empty(0), np.empty(0, int))
    n_pat, n_maps, hits = int(keys.size), int(hit.size), int(hit.sum())
    base = {"unit": "patient", "n_patients": n_pat, "level": side, "alpha": alpha, "p_above": None, "p_below": None,
            "p_above_random": None, "p_above_centre": None, "discordant": None, "test_random": None,
            "test_centre": "exact sign-flip over patients"}
    if n_maps == 0:
        return {**base, "verdict": "no saliency", "verdict_text": "no map with saliency: nothing to test"}
    few = intervals.too_few(n_pat, None, min_patients)
    if few:
        return {**base, "verdict": "too few", "verdict_text": f"{few}, {n_maps} maps: no verdict"}
    per = np.bincount(pidx, minlength=n_pat).astype(float)
    h, e, c = (np.bincount(pidx, weights=v.astype(float), minlength=n_pat) / per for v in (hit, centre_hit, share))
    single = bool((per == 1).all())
    p_random, p_below, test = _against_random(h, c, single, hits, share)
    p_centre = _sign_flip(h - e, seed)
    p_above = max(p_random, p_centre)
    on = f"unit: patients; {n_pat} patients, {n_maps} maps; one-sided, each at {side:g}"
    versus = (f"{hits}/{n_maps} maps hit; a random point: {share.sum():.1f} expected, p = {p_random:.3g} ({test}); "
              f"the centre: {int(centre_hit.sum())}/{n_maps} on the same maps, p = {p_centre:.3g} (sign-flip over patients)")
    best_random = float(np.prod(share)) if single else float(c.mean()) ** n_pat
    best = max(best_random, 0.5 ** int((e < 1).sum()))              # every map of every patient a hit
    if p_above < side:
        verdict, text = "above chance", (f"the heatmap's peak falls in the box more often than a random point and than "
                                         f"the image centre ({on}: {versus})")
    elif p_below < side:
        verdict, text = "below chance", (f"the heatmap's peak falls in the box less often than a random point ({on}: "
                                         f"{hits}/{n_maps} maps hit, {share.sum():.1f} expected; p = {p_below:.3g}, {test})")
    elif best >= side:
        verdict, text = "too few to tell", (f"too few patients to tell: even every map a hit would not beat both the "
                                            f"random point and the centre at p < {side:g} ({on}; smallest p {best:.3g})")
    else:
        verdict, text = "not distinguishable", f"not distinguishable from chance ({on}: {versus})"
    return {**base, "p_above": p_above, "p_below": p_below, "p_above_random": p_random, "p_above_centre": p_centre,
            "discordant": [int((h > e).sum()), int((h < e).sum())], "test_random": test,
            "verdict": verdict, "verdict_text": text}
