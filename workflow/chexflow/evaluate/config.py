"""The evaluation stage's settings (config.yaml ``evaluate:``). The crop is not one of them: the
model file records the crop it was trained at, and evaluation uses that one."""
from __future__ import annotations

from dataclasses import dataclass, field

from chexflow.settings import setting


@dataclass(frozen=True)
class SaliencyConfig:
    top_k: int = setting(3, ge=0)     # highest-scoring true and false positives shown per finding
    layer: str = "auto"               # Grad-CAM layer: a backbone stage (layer3, ...) or auto
    min_side: int = setting(7, ge=1)  # auto: the deepest stage with at least this many px a side
    batch_size: int = setting(64, ge=1)   # images per Grad-CAM batch


@dataclass(frozen=True)
class EvaluateConfig:
    batch_size: int = setting(256, ge=1)
    bootstrap_resamples: int = setting(1000, ge=1)   # patient-bootstrap resamples of the 95% CIs
    seed: int = setting(0, ge=0)
    # equal-width probability bins of the reliability diagram and ECE
    calibration_bins: int = setting(10, ge=1, le=100)
    # a threshold chosen on validation is flagged when it rests on fewer positive images or patients
    min_val_positives: int = setting(10, ge=1)
    # subgroup edges in years, ascending (checked by chexflow.config): <18, 18-39, ..., >=80
    age_bands: tuple[int, ...] = setting((18, 40, 60, 80), ge=1, le=120, unique=True)
    # the one small-count rule (chexflow.evaluate.intervals.too_few): every statistic shown (a finding's
    # AUROC, a subgroup's, an external drop, a rate at the operating point, an underdiagnosis cell, a
    # localisation verdict) needs this many positive and negative patients (a rate: patients in its
    # denominator); below it, "too few" with its counts, no CI, no verdict
    min_patients: int = setting(5, ge=1)
    saliency: SaliencyConfig = field(default_factory=SaliencyConfig)
    # external validation: the fine-tuned model on the test split of each of these datasets, for the
    # findings both share (chexflow.data.labelmap), beside the internal test (chexflow.evaluate.external)
    external: tuple[str, ...] = setting((), unique=True)
