"""The init ablation's comparison (``chexflow compare-ablation``, rule compare_ablation): every run's
test predictions paired on the same images, written as one record, ``results/ablation/comparison.json``
(its format: ``chexflow.evaluate.comparison_record``), which the report only renders.

Pretrained vs random init per training seed, and over seeds when there are several: a paired
patient bootstrap of the test mean-AUROC difference (``paired_bootstrap_auroc_diff``,
``paired_bootstrap_over_seeds``), each with a verdict. With a published-weights arm
(``finetune.init_file``) two more questions, the same way: do published weights beat random init,
and does chexflow's own pretraining beat the published weights?
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from chexflow.evaluate.comparison_record import (ARMS, FORMAT, ComparisonRecord, Difference, OverSeeds,
                                                 PublishedComparison, RunRecord)
from chexflow.evaluate.metrics import paired_bootstrap_auroc_diff, paired_bootstrap_over_seeds
from chexflow.evaluate.record import read_metrics, read_predictions
from chexflow.fsutil import write_text_atomic
from chexflow.train.epochs import read_epochs

RUN_FILES = ("metrics", "predictions", "training")
# (A, B, what A - B answers): the published-weights arm against each of the other two
PUBLISHED_PAIRS = (("file", "random", "Published weights \u2212 random"),
                   ("pretrained", "file", "Pretraining \u2212 published weights"))


class ComparisonInputError(ValueError):
    """The ablation's runs cannot be compared (another test split, no seed with both arms, a run
    that names no arm); the message names the file or the run."""


def verdict(ci: list | None, t_ci: list | None = None) -> dict[str, Any]:
    """helps / hurts when the CI(s) lie above / below zero, else inconclusive; with ``ci_low``/``ci_high``."""
    bounds = [c for c in (ci, t_ci) if c]
    lo = min(c[0] for c in bounds) if bounds else None
    hi = max(c[1] for c in bounds) if bounds else None
    said = "helps" if lo is not None and lo > 0 else "hurts" if hi is not None and hi < 0 else "inconclusive"
    return {"ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None, "verdict": said}


def _load(name: str, files: Any) -> dict[str, Any]:
    if not isinstance(files, dict) or set(files) != set(RUN_FILES):
        raise ComparisonInputError(f"ablation run {name!r} must name exactly {list(RUN_FILES)}, got {files!r}")
    paths = {k: Path(v) for k, v in files.items()}
    m = read_metrics(paths["metrics"])
    init, seed = m.get("model_init"), m.get("model_seed")
    if init not in ARMS or isinstance(seed, bool) or not isinstance(seed, int):
        raise ComparisonInputError(f"{paths['metrics']}: names no init/seed of its model (model_init, model_seed)")
    return {"name": name, "init": init, "seed": seed, "metrics": m, "files": paths,
            "predictions": read_predictions(paths["predictions"], list(m["labels"])),
            "n_epochs": len(read_epochs(paths["training"], f"ablation run {name}"))}


def _aligned(ref: pd.DataFrame, run: dict[str, Any]) -> pd.DataFrame:
    """``run``'s predictions in the row order of ``ref`` (the same test images, or an error)."""
    other = run["predictions"]
    key = ["image", "patient"]
    # (an image listed twice is refused by read_predictions, so equal lengths and sets mean the same rows)
    if len(other) != len(ref) or set(map(tuple, other[key].to_numpy())) != set(map(tuple, ref[key].to_numpy())):
        raise ComparisonInputError(f"{run['files']['predictions']}: the ablation's predictions.csv holds other test "
                                   "images than the main run's: the paired comparison needs the same test split")
    return other.set_index("image").loc[ref["image"]].reset_index()


def _differences(scores: dict[tuple[str, int], np.ndarray], a: str, b: str, seeds: list[int], ref: pd.DataFrame,
                 labels: list[str], boot: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Arm ``a`` - arm ``b`` per seed (the paired bootstrap's result) and over seeds (None for one);
    ``scores``: each run's test scores in ``ref``'s row order."""
    y = ref[labels].to_numpy(float)
    groups = ref["patient"].to_numpy()
    pairs = [(scores[(a, s)], scores[(b, s)]) for s in seeds]
    per_seed = []
    for s, (sa, sb) in zip(seeds, pairs):
        res = paired_bootstrap_auroc_diff(y, sa, sb, groups, labels, **boot)
        per_seed.append({**res, "seed": s, **verdict(res["ci"])})
    over = None
    if len(seeds) > 1:
        o = paired_bootstrap_over_seeds(y, pairs, groups, labels, **boot)
        over = {**o, **verdict(o["ci"], o["t_ci"])}
    return per_seed, over


def compare(runs: dict[str, Any], *, main: str, n_resamples: int, seed: int) -> ComparisonRecord:
    """The comparison of the ablation's ``runs`` (name -> its files ``RUN_FILES``, the workflow's
    ``<init>_seed<seed>`` keys); ``main``: the main run's name; the bootstrap's ``n_resamples`` and
    ``seed`` (the evaluate section's)."""
    if not isinstance(runs, dict) or main not in runs:
        raise ComparisonInputError(f"the ablation's runs {sorted(runs) if isinstance(runs, dict) else runs!r} "
                                   f"do not include the main run {main!r}")
    loaded = [_load(name, files) for name, files in runs.items()]
    by: dict[tuple[str, int], dict[str, Any]] = {}
    for r in loaded:
        if (r["init"], r["seed"]) in by:
            raise ComparisonInputError(f"{r['files']['metrics']}: a second run of arm {r['init']} with seed "
                                       f"{r['seed']} (also {by[(r['init'], r['seed'])]['files']['metrics']})")
        by[(r["init"], r["seed"])] = r
    seeds = sorted({s for _, s in by if ("pretrained", s) in by and ("random", s) in by})
    if not seeds:
        raise ComparisonInputError("the ablation's runs hold no seed with both arms (pretrained and random)")
    main_run = next(r for r in loaded if r["name"] == main)
    labels = list(main_run["metrics"]["labels"])
    for r in loaded:
        if list(r["metrics"]["labels"]) != labels:
            raise ComparisonInputError(f"{r['files']['metrics']}: labels {list(r['metrics']['labels'])} are not the "
                                       f"main run's {labels}")
    boot = {"n_resamples": int(n_resamples), "seed": int(seed)}
    ref = by[("pretrained", seeds[0])]["predictions"]
    cols = [f"{lab}_score" for lab in labels]
    scores = {key: _aligned(ref, run)[cols].to_numpy(float) for key, run in by.items()}   # each run aligned once
    per_seed, over = _differences(scores, "pretrained", "random", seeds, ref, labels, boot)
    for d in per_seed:
        d["epochs"] = {init: by[(init, d["seed"])]["metrics"].get("model_epoch") for init in ("pretrained", "random")}
    return {
        "format": FORMAT, "labels": labels, "bootstrap": boot,
        "main_init": main_run["init"], "main_seed": main_run["seed"],
        "other_init": "pretrained" if main_run["init"] == "random" else "random",
        "seeds": seeds,
        "runs": [_run_record(r) for r in sorted(loaded, key=lambda r: (r["seed"], ARMS.index(r["init"])))],
        "per_seed": per_seed, "over_seeds": over,
        "published": _published(scores, seeds, ref, labels, boot),
    }


def _run_record(r: dict[str, Any]) -> RunRecord:
    m = r["metrics"]
    return {"name": r["name"], "init": r["init"], "seed": r["seed"], "mean_auroc": m["mean_auroc"],
            "mean_auroc_ci": m["bootstrap"]["mean_auroc_ci"], "epoch": m.get("model_epoch"),
            "val_metric": m.get("model_val_metric"), "n_epochs": r["n_epochs"],
            **{k: str(r["files"][k]) for k in RUN_FILES}}


def _published(scores: dict[tuple[str, int], np.ndarray], seeds: list[int], ref: pd.DataFrame, labels: list[str],
               boot: dict[str, int]) -> list[PublishedComparison]:
    """The published-weights arm against random and against pretrained, per seed (of ``seeds``, those
    with all three arms) and over seeds; empty without that arm."""
    with_file = [s for s in seeds if ("file", s) in scores]
    if not with_file:
        if any(init == "file" for init, _ in scores):
            raise ComparisonInputError("the ablation's published-weights runs share no seed with both other arms")
        return []
    out = []
    for a, b, title in PUBLISHED_PAIRS:
        per_seed, over = _differences(scores, a, b, with_file, ref, labels, boot)
        out.append({"a": a, "b": b, "title": title, "over_seeds": _brief_over(over),
                    "per_seed": [_brief(d) for d in per_seed]})
    return out


def _brief(d: dict[str, Any]) -> Difference:
    keep = ("seed", "diff", "ci", "ci_low", "ci_high", "verdict", "mean_a", "mean_b", "n_patients", "n_resamples_used")
    return {k: d[k] for k in keep}


def _brief_over(o: dict[str, Any] | None) -> OverSeeds | None:
    keep = ("diff", "per_seed", "ci", "t_ci", "ci_low", "ci_high", "verdict", "n_seeds", "n_patients")
    return None if o is None else {k: o[k] for k in keep}


def write_comparison(runs: dict[str, Any], out: Path, *, main: str, n_resamples: int, seed: int) -> ComparisonRecord:
    """:func:`compare`, written to ``out`` atomically (a half-written record never looks complete)."""
    record = compare(runs, main=main, n_resamples=n_resamples, seed=seed)
    write_text_atomic(Path(out), json.dumps(record, indent=2) + "\n")
    return record
