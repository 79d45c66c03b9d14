"""The init ablation's comparisons beyond pretraining vs random: the published-weights arm.

With ``finetune.init_file`` set the ablation has a third arm, fine-tuning from that file (e.g.
ImageNet weights), with the same budget. Its two questions, each a paired patient-bootstrap CI of
the test mean-AUROC difference on the same images, per training seed and over seeds, with the same
verdicts as pretrained vs random: do published weights beat random init, and does chexflow's own
pretraining beat the published weights?
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from chexflow.evaluate.metrics import paired_bootstrap_auroc_diff, paired_bootstrap_over_seeds
from chexflow.report.errors import ReportInputError

# (A, B, what A - B answers): the file arm against each of the other two
PUBLISHED_PAIRS = (("file", "random", "Published weights \u2212 random"),
                   ("pretrained", "file", "Pretraining \u2212 published weights"))


def aligned(ref: pd.DataFrame, run: dict[str, Any]) -> pd.DataFrame:
    """``run``'s predictions in the row order of ``ref`` (the same test images, or an error)."""
    other = run["predictions"]
    key = ["image", "patient"]
    if len(other) != len(ref) or set(map(tuple, other[key].to_numpy())) != set(map(tuple, ref[key].to_numpy())):
        raise ReportInputError(f"{run['files']['predictions']}: the ablation's predictions.csv holds other test images "
                               "than the main run's: the paired comparison needs the same test split")
    return other.set_index("image").loc[ref["image"]].reset_index()


def verdict(ci: list | None, t_ci: list | None = None) -> dict[str, Any]:
    """helps / hurts when the CI(s) lie above / below zero, else inconclusive."""
    bounds = [c for c in (ci, t_ci) if c]
    lo = min(c[0] for c in bounds) if bounds else None
    hi = max(c[1] for c in bounds) if bounds else None
    verdict = "helps" if lo is not None and lo > 0 else "hurts" if hi is not None and hi < 0 else "inconclusive"
    return {"ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None, "verdict": verdict}



def published_comparisons(by: dict[tuple[str, int], dict[str, Any]], seeds: list[int], ref: pd.DataFrame,
                          labels: list[str], boot: dict[str, int]) -> list[dict[str, Any]]:
    """The file arm against random and against pretrained, per seed (of ``seeds``, those with all
    three arms) and over seeds; ``by``: the loaded runs by (init, seed); ``ref``: the predictions all
    are aligned to. Empty without a file arm."""
    with_file = [s for s in seeds if ("file", s) in by]
    if not with_file:
        if any(init == "file" for init, _ in by):
            raise ReportInputError("the ablation's published-weights runs share no seed with both other arms")
        return []
    y = ref[labels].to_numpy(float)
    cols = [f"{lab}_score" for lab in labels]
    groups = ref["patient"].to_numpy()
    out = []
    for a, b, title in PUBLISHED_PAIRS:
        scores = [(aligned(ref, by[(a, s)])[cols].to_numpy(float), aligned(ref, by[(b, s)])[cols].to_numpy(float))
                  for s in with_file]
        per_seed = []
        for s, (sa, sb) in zip(with_file, scores):
            res = paired_bootstrap_auroc_diff(y, sa, sb, groups, labels, **boot)
            per_seed.append({"seed": s, "diff": res["diff"], **verdict(res["ci"])})
        over = None
        if len(with_file) > 1:
            o = paired_bootstrap_over_seeds(y, scores, groups, labels, **boot)
            over = {"diff": o["diff"], "t_ci": o["t_ci"], **verdict(o["ci"], o["t_ci"])}
        out.append({"a": a, "b": b, "title": title, "per_seed": per_seed, "over_seeds": over})
    return out
