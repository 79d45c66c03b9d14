"""Horovod behind the Backend interface. Every ``hvd`` call of chexflow is in this file."""
from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from chexflow.train.checkpoint import to_cpu
from chexflow.train.backends.base import Backend, DistributedError, expected_world_size, gpu_index


def dense_layout_compression(inner, *, stage_through_cpu: bool = False):
    """A Horovod compressor that hands the allreduce a contiguous copy of a gradient that is not
    contiguous (a channels_last conv weight's gradient; Horovod refuses those, horovod#3491) and
    gives the result back in the parameter's memory format. ``inner`` (none / fp16) runs on the
    contiguous copy. Contiguous gradients pass through without a copy.

    ``stage_through_cpu``: GPU gradients are reduced through host copies (a Horovod built without
    GPU operations, or several ranks sharing one GPU, which NCCL refuses)."""

    class DenseLayout(inner):
        @staticmethod
        def compress(tensor):
            layout, device = None, None
            if not tensor.is_contiguous():
                layout = torch.channels_last if tensor.dim() == 4 and tensor.is_contiguous(
                    memory_format=torch.channels_last) else "strided"
            if stage_through_cpu and tensor.device.type != "cpu":
                device = tensor.device
                tensor = tensor.to("cpu", memory_format=torch.contiguous_format)
            elif layout is not None:
                tensor = tensor.contiguous()
            compressed, ctx = inner.compress(tensor)
            return compressed, (ctx, layout, device)

        @staticmethod
        def decompress(tensor, ctx):
            inner_ctx, layout, device = ctx
            out = inner.decompress(tensor, inner_ctx)
            if device is not None:
                out = out.to(device)
            if layout is torch.channels_last:
                out = out.contiguous(memory_format=torch.channels_last)
            return out

    return DenseLayout


POLL_INTERVAL_S = 0.0005
# the modules of horovod.torch that bind ``synchronize`` by name (0.28.1)
SYNCHRONIZE_MODULES = ("horovod.torch.mpi_ops", "horovod.torch.optimizer", "horovod.torch.functions")


def poll_while_waiting(interval_s: float = POLL_INTERVAL_S) -> None:
    """Make every wait for a Horovod collective sleep between polls instead of spinning.

    Each collective's wait (``synchronize``: the gradients' allreduce in the optimizer's step,
    broadcasts, allgathers, the barrier) runs a C++ loop that polls the handle and only yields
    the CPU between polls (``WaitAndClear`` in horovod/torch/mpi_ops_v2.cc, 0.28.1). So a rank
    waiting for another one keeps a core busy. When CPU ranks share cores, that core belongs to
    the rank doing the work: rank 0 hashing shards, writing a checkpoint or scoring validation.
    The replacement polls the handle every ``interval_s`` with sleeps in between. Horovod's own
    ``synchronize`` then takes the finished handle, raising its error if it has one, and returns
    at once. Horovod binds the name in three modules (SYNCHRONIZE_MODULES); it is replaced in all three,
    the original kept as ``__wrapped__``. Idempotent."""
    import importlib

    import horovod.torch.mpi_ops as mpi_ops
    wait = mpi_ops.synchronize
    if getattr(wait, "chexflow_polls", False):
        return

    def synchronize(handle):
        while handle in mpi_ops._handle_map and not mpi_ops.poll(handle):
            time.sleep(interval_s)
        return wait(handle)

    synchronize.chexflow_polls = True
    synchronize.__doc__, synchronize.__wrapped__ = wait.__doc__, wait
    for name in SYNCHRONIZE_MODULES:
        importlib.import_module(name).synchronize = synchronize


class HorovodBackend(Backend):
    name = "horovod"

    def __init__(self, *, fusion_threshold_mb: int = 64, stage_through_cpu: bool = False) -> None:
        self.stage_through_cpu = stage_through_cpu
        os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(fusion_threshold_mb * 1024 * 1024))
        if not torch.cuda.is_available():
            # CPU ranks share cores with Horovod's background thread; its default 1 ms cycle
            # spins (2 CPU ranks on 2 cores, demo fine-tuning: 37 img/s at 1 ms, 47 at 10 ms; DDP 50)
            os.environ.setdefault("HOROVOD_CYCLE_TIME", "10")
        try:
            import horovod.torch as hvd
        except ImportError as exc:
            raise DistributedError(
                "train.backend is 'horovod' but horovod is not importable "
                f"({exc}); build it with `bash envs/setup.sh` or set train.backend: ddp"
            ) from exc
        if not torch.cuda.is_available():
            # a rank waiting for another spins on a core the other may need (on a GPU the wait
            # stays Horovod's own: not measured there)
            poll_while_waiting()
        self.hvd = hvd
        hvd.init()
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        self.local_size = hvd.local_size()
        expected = expected_world_size()
        if expected and expected != self.size:
            raise DistributedError(
                f"the launcher started {expected} ranks but Horovod formed a world of {self.size}: "
                "under srun Horovod must be built with MPI (HOROVOD_WITH_MPI) and started with "
                "--mpi=pmix; check `horovodrun --check-build`")
        if torch.cuda.is_available():
            torch.cuda.set_device(gpu_index(self.local_rank, torch.cuda.device_count()))

    def _broadcast_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if not self.stage_through_cpu:
            self.hvd.broadcast_parameters(tensors, root_rank=0)
            return
        host = {name: t.detach().to("cpu", memory_format=torch.contiguous_format) for name, t in tensors.items()}
        self.hvd.broadcast_parameters(host, root_rank=0)
        with torch.no_grad():
            for name, t in tensors.items():
                t.copy_(host[name])

    def broadcast_model(self, model: torch.nn.Module) -> None:
        self._broadcast_tensors(model.state_dict())

    def broadcast_buffers(self, model: torch.nn.Module) -> None:
        buffers = {name: buf for name, buf in model.named_buffers() if buf.is_floating_point()}
        if buffers:
            self._broadcast_tensors(buffers)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # Not hvd.broadcast_optimizer_state: on ranks with an empty state it first takes an
        # optimizer step with zero gradients (weight decay, momentum) to create the state, which
        # breaks bit-identical resume. The whole state dict of rank 0 is small next to a model.
        # an explicit name: Horovod's default is the object's type name, which differs between
        # rank 0 (dict) and the others (None), and mismatched names deadlock the collective
        # on the CPU whatever rank 0's device; load_state_dict moves it to each parameter's device
        state = self.hvd.broadcast_object(to_cpu(optimizer.state_dict()) if self.rank == 0 else None,
                                          root_rank=0, name="chexflow.optimizer_state")
        optimizer.load_state_dict(state)

    def broadcast_object(self, obj: Any) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=0, name="chexflow.object")

    def _host(self, value: torch.Tensor) -> torch.Tensor:
        return value.cpu() if self.stage_through_cpu else value

    def allreduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(self._host(value), op=self.hvd.Average).to(value.device)

    def allreduce_max(self, value: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(self._host(value), op=self.hvd.Max).to(value.device)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.hvd.allgather_object(obj)

    def barrier(self) -> None:
        self.hvd.barrier()

    def wrap(self, model, optimizer, *, fp16_compression: bool, backward_passes_per_step: int):
        compression = dense_layout_compression(
            self.hvd.Compression.fp16 if fp16_compression else self.hvd.Compression.none,
            stage_through_cpu=self.stage_through_cpu)
        wrapped = self.hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression,
            backward_passes_per_step=backward_passes_per_step, op=self.hvd.Average)
        # DistributedOptimizer builds a new optimizer over the *same* param-group dicts (so the LR
        # scheduler bound to `optimizer` still drives it) but with an empty state: carry the
        # (resumed) per-parameter state over, or momentum restarts from zero after a resume.
        # Not load_state_dict: that would replace the group dicts and detach the scheduler.
        assert all(a is b for a, b in zip(wrapped.param_groups, optimizer.param_groups))
        wrapped.state.update(optimizer.state)
        # the LR scheduler counts the steps of `optimizer`; the wrapper's class steps instead, so
        # torch's "lr_scheduler.step() before optimizer.step()" check would warn at every step
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before",
                                category=UserWarning)
        return model, wrapped

    def shutdown(self) -> None:
        self.hvd.shutdown()
