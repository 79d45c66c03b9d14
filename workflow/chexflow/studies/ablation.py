"""The init ablation: fine-tuning from the other initialisation than the main run's.

The main run starts as ``finetune.init`` says (the ``TrainConfig.init`` default when the section
has no ``init``); the ablation run starts from the other one with the same budget. The workflow
(which job needs the pretraining model) and the report (which run is which) both ask here.
"""
from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

from chexflow.config import ConfigError, TrainConfig

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
