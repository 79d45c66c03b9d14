"""The init ablation: fine-tuning from the other initialisation than the main run's.

The main run starts as ``finetune.init`` says (the ``TrainConfig.init`` default when the section
has no ``init``); the ablation run starts from the other one with the same budget. The workflow
(which job needs the pretraining model, where each run lives) asks here.

``ablation.seeds`` (default: the finetune section's one seed) gives the training seeds per arm: one
fine-tuning and evaluation per arm and seed (``runs``). The runs with ``finetune.seed`` are today's:
the main run (``results/finetune``, ``results/evaluate``) and ``results/ablation/``; the others live
under ``results/ablation/seed<seed>/<init>/``.
"""
from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chexflow.config import AblationConfig, ConfigError, TrainConfig, from_dict

INITS: tuple[str, ...] = typing.get_args(typing.get_type_hints(TrainConfig)["init"])   # random, pretrained


def main_init(config: Mapping[str, Any]) -> str:
    """``finetune.init`` of a whole config mapping (config.yaml), with the dataclass default."""
    init = str((config.get("finetune") or {}).get("init", TrainConfig.init))
    if init not in INITS:
        raise ConfigError(f"finetune.init: expected one of {list(INITS)}, got {init!r}")
    return init


def other_init(config: Mapping[str, Any]) -> str:
    """The ablation run's init: the one of ``INITS`` that the main run does not use."""
    main = main_init(config)
    return next(init for init in INITS if init != main)


@dataclass(frozen=True)
class Run:
    """One fine-tuning + evaluation of the ablation: an arm (init) and a training seed."""
    init: str
    seed: int
    root: str          # results/ (the main run), results/ablation/ or results/ablation/seed<s>/<init>/

    @property
    def train_dir(self) -> str:
        return f"{self.root}/finetune"

    @property
    def eval_dir(self) -> str:
        return f"{self.root}/evaluate"

    @property
    def is_main(self) -> bool:
        return self.root == "results"


def finetune_seed(config: Mapping[str, Any]) -> int:
    """``finetune.seed`` of a whole config mapping, with the dataclass default."""
    return int((config.get("finetune") or {}).get("seed", TrainConfig.seed))


def seeds(config: Mapping[str, Any]) -> list[int]:
    """The training seeds per arm: ``ablation.seeds``, or the finetune section's one seed."""
    chosen = from_dict(AblationConfig, config.get("ablation") or {}, "ablation").seeds
    return list(chosen) if chosen is not None else [finetune_seed(config)]


def runs(config: Mapping[str, Any]) -> list[Run]:
    """Every (arm, seed) run, the main init's first; the finetune seed's two are today's paths."""
    main, other, base = main_init(config), other_init(config), finetune_seed(config)

    def root(init: str, seed: int) -> str:
        if seed == base:
            return "results" if init == main else "results/ablation"
        return f"results/ablation/seed{seed}/{init}"

    return [Run(init, seed, root(init, seed)) for init in (main, other) for seed in seeds(config)]
