"""The ablation comparison's record, ``results/ablation/comparison.json``: its one format (written by
``chexflow.studies.ablation_compare``) and the reader the report goes through.

The record holds every number of the report's ablation section, computed where the study is:

* ``runs``: each (arm, seed) run's test mean AUROC with its CI, the epoch tested, the epochs trained,
  and its files (``metrics``, ``predictions``, ``training``);
* ``per_seed``: pretrained − random per training seed, a paired patient bootstrap of the test
  mean-AUROC difference on the same images (``chexflow.evaluate.metrics.paired_bootstrap_auroc_diff``),
  with each finding's difference and a verdict;
* ``over_seeds``: with several seeds, the seed-averaged gain with its patient CI and the t-interval
  over seeds (``paired_bootstrap_over_seeds``), or null;
* ``published``: with a published-weights arm (``finetune.init_file``), that arm against random and
  against pretrained, per seed and over seeds; empty without one.

A verdict is ``helps`` / ``hurts`` when the CI (both CIs over seeds) lies above / below zero, else
``inconclusive``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal, TypedDict

from chexflow.fsutil import read_regular

FORMAT = "chexflow ablation comparison 1"
VERDICTS = ("helps", "hurts", "inconclusive")
ARMS = ("pretrained", "random", "file")
Verdict = Literal["helps", "hurts", "inconclusive"]


class RunRecord(TypedDict):
    """One (arm, seed) run as the comparison read it."""
    name: str                       # the workflow's key, <init>_seed<seed>
    init: str                       # pretrained, random or file
    seed: int
    mean_auroc: float | None
    mean_auroc_ci: list[float] | None
    epoch: int | None               # the epoch tested (selected on validation)
    val_metric: float | None        # its validation metric
    n_epochs: int                   # epochs trained
    metrics: str                    # its files
    predictions: str
    training: str


class Difference(TypedDict, total=False):
    """A - B of one training seed: ``paired_bootstrap_auroc_diff``'s result with the verdict and
    ``ci_low``/``ci_high``; ``epochs``: the tested epoch of each arm (pretrained vs random only)."""
    seed: int
    diff: float
    ci: list[float] | None
    ci_low: float | None
    ci_high: float | None
    verdict: Verdict
    mean_a: float
    mean_b: float
    n_patients: int
    n_resamples_used: int
    labels_used: list[str]
    labels: dict[str, dict[str, Any]]
    epochs: dict[str, int | None]


class OverSeeds(TypedDict, total=False):
    """``paired_bootstrap_over_seeds``' result with the verdict (both CIs) and ``ci_low``/``ci_high``."""
    diff: float
    per_seed: list[float]
    ci: list[float] | None
    t_ci: list[float] | None
    ci_low: float | None
    ci_high: float | None
    verdict: Verdict
    n_seeds: int
    n_patients: int


class PublishedComparison(TypedDict):
    a: str
    b: str
    title: str
    per_seed: list[Difference]
    over_seeds: OverSeeds | None


class ComparisonRecord(TypedDict):
    format: str
    labels: list[str]
    bootstrap: dict[str, int]       # n_resamples, seed
    main_init: str
    main_seed: int
    other_init: str
    seeds: list[int]                # the seeds with both the pretrained and the random arm
    runs: list[RunRecord]
    per_seed: list[Difference]
    over_seeds: OverSeeds | None
    published: list[PublishedComparison]


class ComparisonRecordError(ValueError):
    """A comparison.json that is not the ablation comparison's record (names the file and the key)."""


# --------------------------------------------------------------------------- reading
class _Check:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, key: str, what: str) -> None:
        raise ComparisonRecordError(f"{self.path}: {key}: {what}")

    def obj(self, value: Any, key: str, needed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(key, f"expected an object, got {type(value).__name__}")
        missing = [k for k in needed if k not in value]
        if missing:
            self.fail(key, f"missing key(s) {missing}")
        return value

    def list(self, value: Any, key: str) -> list:
        if not isinstance(value, list):
            self.fail(key, f"expected a list, got {type(value).__name__}")
        return value

    def int(self, value: Any, key: str, *, null: bool = False) -> None:
        if value is None and null:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer{' or null' if null else ''}, got {value!r}")

    def num(self, value: Any, key: str, *, null: bool = True) -> None:
        if value is None and null:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, f"expected a finite number{' or null' if null else ''}, got {value!r}")

    def ci(self, value: Any, key: str) -> None:
        if value is None:
            return
        if not isinstance(value, list) or len(value) != 2:
            self.fail(key, f"expected [low, high] or null, got {value!r}")
        for v in value:
            self.num(v, key, null=False)
        if value[0] > value[1]:
            self.fail(key, f"low {value[0]} is above high {value[1]}")

    def choice(self, value: Any, key: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            self.fail(key, f"expected one of {list(allowed)}, got {value!r}")

    def difference(self, value: Any, key: str, *, per_label: bool) -> None:
        needed = ("seed", "diff", "ci", "ci_low", "ci_high", "verdict", "mean_a", "mean_b", "n_patients")
        d = self.obj(value, key, needed + (("labels_used", "labels") if per_label else ()))
        self.int(d["seed"], f"{key}.seed")
        for k in ("diff", "mean_a", "mean_b"):
            self.num(d[k], f"{key}.{k}", null=False)
        self.ci(d["ci"], f"{key}.ci")
        self.choice(d["verdict"], f"{key}.verdict", VERDICTS)
        if per_label:
            used = self.list(d["labels_used"], f"{key}.labels_used")
            labels = self.obj(d["labels"], f"{key}.labels", tuple(used))
            for lab in used:
                e = self.obj(labels[lab], f"{key}.labels[{lab!r}]", ("diff", "a", "b", "ci"))
                for k in ("diff", "a", "b"):
                    self.num(e[k], f"{key}.labels[{lab!r}].{k}", null=False)
                self.ci(e["ci"], f"{key}.labels[{lab!r}].ci")

    def over(self, value: Any, key: str) -> None:
        if value is None:
            return
        o = self.obj(value, key, ("diff", "per_seed", "ci", "t_ci", "ci_low", "ci_high", "verdict", "n_seeds",
                                  "n_patients"))
        self.num(o["diff"], f"{key}.diff", null=False)
        self.ci(o["ci"], f"{key}.ci")
        self.ci(o["t_ci"], f"{key}.t_ci")
        self.choice(o["verdict"], f"{key}.verdict", VERDICTS)
        if len(self.list(o["per_seed"], f"{key}.per_seed")) != o["n_seeds"]:
            self.fail(f"{key}.per_seed", f"expected n_seeds ({o['n_seeds']}) differences")


def read_comparison(path: Path) -> ComparisonRecord:
    """``comparison.json`` checked against the record's format; anything else fails naming the file
    and the key."""
    path = Path(path)
    try:
        data = json.loads(read_regular(path, what="ablation comparison").decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ComparisonRecordError(f"ablation comparison {path} is not valid JSON: {exc}") from exc
    c = _Check(path)
    rec = c.obj(data, "top level", ("format", "labels", "bootstrap", "main_init", "main_seed", "other_init",
                                    "seeds", "runs", "per_seed", "over_seeds", "published"))
    if rec["format"] != FORMAT:
        c.fail("format", f"expected {FORMAT!r} (the record chexflow compare-ablation writes), got {rec['format']!r}")
    c.choice(rec["main_init"], "main_init", ARMS)
    c.choice(rec["other_init"], "other_init", ARMS)
    c.int(rec["main_seed"], "main_seed")
    seeds = c.list(rec["seeds"], "seeds")
    if not seeds:
        c.fail("seeds", "no seed with both arms (pretrained and random)")
    for i, s in enumerate(seeds):
        c.int(s, f"seeds[{i}]")
    for i, run in enumerate(c.list(rec["runs"], "runs")):
        key = f"runs[{i}]"
        r = c.obj(run, key, tuple(RunRecord.__annotations__))
        c.choice(r["init"], f"{key}.init", ARMS)
        c.int(r["seed"], f"{key}.seed")
        c.int(r["epoch"], f"{key}.epoch", null=True)
        c.int(r["n_epochs"], f"{key}.n_epochs")
        c.num(r["mean_auroc"], f"{key}.mean_auroc")
        c.num(r["val_metric"], f"{key}.val_metric")
        c.ci(r["mean_auroc_ci"], f"{key}.mean_auroc_ci")
    per_seed = c.list(rec["per_seed"], "per_seed")
    if [d.get("seed") if isinstance(d, dict) else None for d in per_seed] != seeds:
        c.fail("per_seed", f"expected one difference per seed of 'seeds' {seeds}, in that order")
    for i, d in enumerate(per_seed):
        c.difference(d, f"per_seed[{i}]", per_label=True)
    c.over(rec["over_seeds"], "over_seeds")
    for i, comp in enumerate(c.list(rec["published"], "published")):
        key = f"published[{i}]"
        p = c.obj(comp, key, tuple(PublishedComparison.__annotations__))
        for j, d in enumerate(c.list(p["per_seed"], f"{key}.per_seed")):
            c.difference(d, f"{key}.per_seed[{j}]", per_label=False)
        c.over(p["over_seeds"], f"{key}.over_seeds")
    return rec
