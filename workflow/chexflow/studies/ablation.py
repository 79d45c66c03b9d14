"""The init ablation's runs: fine-tuning from each initialisation, for each training seed.

The main run starts as ``finetune.init`` says; the ablation's arm starts from the other one
(``chexflow.train.config.other_init``) with the same budget. ``ablation.seeds`` (default: the
finetune section's one seed) gives the training seeds per arm: one fine-tuning and evaluation per
arm and seed (:func:`runs`). The runs with ``finetune.seed`` are today's: the main run
(``results/finetune``, ``results/evaluate``) and ``results/ablation/``; the others live under
``results/ablation/seed<seed>/<init>/``. The workflow asks here where each run lives.
"""
from __future__ import annotations

from dataclasses import dataclass

from chexflow.train.config import INITS


@dataclass(frozen=True)
class Run:
    """One fine-tuning + evaluation of the ablation: an arm (init) and a training seed."""
    init: str
    seed: int
    root: str          # results (the main run), results/ablation or results/ablation/seed<s>/<init>

    @property
    def train_dir(self) -> str:
        return f"{self.root}/finetune"

    @property
    def eval_dir(self) -> str:
        return f"{self.root}/evaluate"

    @property
    def is_main(self) -> bool:
        return self.root == "results"


def runs(main_init: str, base_seed: int, seeds: tuple[int, ...] | None) -> list[Run]:
    """Every (arm, seed) run, the main init's first; ``base_seed`` (finetune.seed) gives today's two
    runs their paths; ``seeds`` (ablation.seeds) None: that seed only."""
    if main_init not in INITS:
        raise ValueError(f"finetune.init: expected one of {list(INITS)}, got {main_init!r}")
    other = next(init for init in INITS if init != main_init)

    def root(init: str, seed: int) -> str:
        if seed == base_seed:
            return "results" if init == main_init else "results/ablation"
        return f"results/ablation/seed{seed}/{init}"

    chosen = list(seeds) if seeds is not None else [base_seed]
    return [Run(init, seed, root(init, seed)) for init in (main_init, other) for seed in chosen]


def study_runs(study) -> list[Run]:
    """The ablation's runs of a checked config (``chexflow.config.Study``); none when it is off."""
    if not study.ablation.enabled:
        return []
    finetune = study.train["finetune"]
    return runs(finetune.init, finetune.seed, study.ablation.seeds)
