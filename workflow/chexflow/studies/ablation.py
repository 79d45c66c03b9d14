"""The init ablation's runs: fine-tuning from each initialisation, for each training seed.

The main run starts as ``finetune.init`` says; the ablation's arm starts from the other one
(``chexflow.train.config.other_init``) with the same budget; with ``finetune.init_file`` set, a
third arm starts from that file (published weights, e.g. ImageNet's), so the study answers whether
its own pretraining beats them: random vs own pretraining vs the file. ``ablation.seeds`` (default: the
finetune section's one seed) gives the training seeds per arm: one fine-tuning and evaluation per
arm and seed (:func:`runs`). The runs with ``finetune.seed`` are today's: the main run
(``results/finetune``, ``results/evaluate``) and ``results/ablation/``; the others live under
``results/ablation/seed<seed>/<init>/``, as does the third arm's run with ``finetune.seed``. The
workflow asks here where each run lives.
"""
from __future__ import annotations

from dataclasses import dataclass

from chexflow.train.config import ABLATION_INITS, INITS


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


def arms(main_init: str, *, published: bool = False) -> list[str]:
    """The ablation's arms, the main init's first, then the other of random/pretrained; ``published``
    (finetune.init_file set): the third init too (file, or pretrained when the main run starts from the file)."""
    if main_init not in INITS:
        raise ValueError(f"finetune.init: expected one of {list(INITS)}, got {main_init!r}")
    other = next(init for init in ABLATION_INITS if init != main_init)
    out = [main_init, other]
    return out + [init for init in INITS if init not in out] if published or main_init == "file" else out


def runs(main_init: str, base_seed: int, seeds: tuple[int, ...] | None, *, published: bool = False) -> list[Run]:
    """Every (arm, seed) run, the main init's first; ``base_seed`` (finetune.seed) gives today's two
    runs their paths; ``seeds`` (ablation.seeds) None: that seed only; ``published``: see :func:`arms`."""
    chosen_arms = arms(main_init, published=published)

    def root(init: str, seed: int) -> str:
        if seed == base_seed and init in chosen_arms[:2]:
            return "results" if init == main_init else "results/ablation"
        return f"results/ablation/seed{seed}/{init}"

    chosen = list(seeds) if seeds is not None else [base_seed]
    return [Run(init, seed, root(init, seed)) for init in chosen_arms for seed in chosen]


def study_runs(study) -> list[Run]:
    """The ablation's runs of a checked config (``chexflow.config.Study``); none when it is off."""
    if not study.ablation.enabled:
        return []
    finetune = study.train["finetune"]
    return runs(finetune.init, finetune.seed, study.ablation.seeds, published=finetune.init_file is not None)
