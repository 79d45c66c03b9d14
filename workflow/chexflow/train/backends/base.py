"""The Backend interface: what the trainer may ask of a world of ranks.

This class is the single-process world (``single``: laptops, debugging); ``horovod.py`` and
``ddp.py`` implement the same methods with Horovod and ``torch.distributed``.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch


class DistributedError(RuntimeError):
    """The launch environment and the requested backend do not fit together."""


def gpu_index(local_rank: int, n_visible: int) -> int:
    """The CUDA device of a rank: its local rank among the devices it sees, modulo their number. One
    GPU per task (SLURM's --gpus-per-task or gpu-bind shows each task a single device, index 0) and
    several ranks sharing one GPU both land on a device that exists; every use of the rank's device
    (``set_device``, DDP's ``device_ids``) takes this one index."""
    if n_visible < 1:
        raise DistributedError("no CUDA device visible to this rank")
    return local_rank % n_visible


class Backend:
    """World of ranks. Subclasses implement the communication; this class is the single-process one."""

    name = "single"

    def __init__(self) -> None:
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1

    # ---- topology
    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # ---- communication (single process: identities)
    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Parameters and buffers of rank 0 to all ranks (call before channels_last)."""

    def broadcast_buffers(self, model: torch.nn.Module) -> None:
        """Buffers (BatchNorm running statistics) of rank 0 to all ranks, so every rank evaluates
        exactly the model rank 0 saves."""

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer state of rank 0 to all ranks."""

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def allreduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def allreduce_max(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    # ---- gradient averaging
    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, fp16_compression: bool,
             backward_passes_per_step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Return (model, optimizer) that average gradients over ranks on ``optimizer.step()``."""
        return model, optimizer

    def no_sync(self, model: torch.nn.Module):
        """Context for backward passes that only accumulate (gradient accumulation)."""
        import contextlib
        return contextlib.nullcontext()

    def shutdown(self) -> None:
        pass


def expected_world_size() -> int | None:
    """World size the launcher announced (horovodrun, srun, torchrun), if any."""
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return None


def gather_arrays(backend: Backend) -> Callable:
    """A ``gather`` callable for metric classes: concatenates every rank's arrays on every rank."""
    import numpy as np

    def gather(local: list) -> list:
        parts = backend.allgather_object([np.asarray(a) for a in local])
        return [np.concatenate([p[i] for p in parts]) for i in range(len(local))]
    return gather
