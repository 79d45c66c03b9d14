"""The evaluation stage's settings (config.yaml ``evaluate:``). The crop is not one of them: the
model file records the crop it was trained at, and evaluation uses that one."""
from __future__ import annotations

from dataclasses import dataclass

from chexflow.settings import setting


@dataclass(frozen=True)
class EvaluateConfig:
    batch_size: int = setting(256, ge=1)
    bootstrap_resamples: int = setting(1000, ge=1)   # patient-bootstrap resamples of the 95% CIs
    seed: int = setting(0, ge=0)
