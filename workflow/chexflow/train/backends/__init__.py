"""Distributed backends behind one interface (:class:`Backend`).

Every Horovod call of chexflow is in ``horovod.py`` and every ``torch.distributed`` call in
``ddp.py``; the trainer only calls the methods of :class:`Backend` (``base.py``). The modules of
the communication libraries are imported only when their backend is asked for.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from chexflow.train.backends.base import Backend, DistributedError, expected_world_size, gather_arrays

if TYPE_CHECKING:
    from chexflow.train.config import TrainConfig

__all__ = ["Backend", "DistributedError", "backend_for", "expected_world_size", "gather_arrays", "init_backend"]


def init_backend(name: str, *, fusion_threshold_mb: int = 64, stage_through_cpu: bool = False,
                 process_group: str = "auto", timeout_s: int = 1800) -> Backend:
    """Initialise the backend named in the config (``horovod`` | ``ddp`` | ``single``).

    ``fusion_threshold_mb`` and ``stage_through_cpu`` are Horovod's; ``process_group`` and
    ``timeout_s`` are DDP's."""
    if name == "single":
        world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")) or 1)
        if world > 1:
            raise DistributedError(f"backend 'single' cannot run {world} ranks; use horovod or ddp")
        return Backend()
    if name == "horovod":
        from chexflow.train.backends.horovod import HorovodBackend
        return HorovodBackend(fusion_threshold_mb=fusion_threshold_mb, stage_through_cpu=stage_through_cpu)
    if name == "ddp":
        from chexflow.train.backends.ddp import DDPBackend
        return DDPBackend(process_group=process_group, timeout_s=timeout_s)
    raise DistributedError(f"train.backend: unknown backend {name!r} (horovod | ddp | single)")


def backend_for(cfg: TrainConfig) -> Backend:
    """The backend a TrainConfig asks for, with its Horovod/DDP settings."""
    return init_backend(cfg.backend, fusion_threshold_mb=cfg.horovod.fusion_threshold_mb,
                        stage_through_cpu=cfg.horovod.stage_through_cpu,
                        process_group=cfg.ddp.process_group, timeout_s=cfg.ddp.timeout_s)
