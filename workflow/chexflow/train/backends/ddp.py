"""torch DDP behind the Backend interface. Every ``torch.distributed`` call of chexflow is here.

Started by ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR set) or by ``srun`` (rendezvous derived from
SLURM's environment: first host of the step's node list, a port from the job id).
"""
from __future__ import annotations

import datetime
import os
import subprocess
from typing import Any

import torch
import torch.distributed as dist

from chexflow.train.checkpoint import to_cpu
from chexflow.train.backends.base import Backend, DistributedError, gpu_index


def _env_from_slurm() -> None:
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        try:
            host = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                  text=True, check=True).stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            host = "127.0.0.1"
        os.environ["MASTER_ADDR"] = host
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def process_group_spec(requested: str, *, cuda: bool) -> str:
    """The ``init_process_group`` backend string: with GPUs, NCCL for CUDA tensors and gloo for CPU
    tensors (the trainer's flags, objects and CPU state dicts), so no collective ever meets a
    tensor on a device its backend cannot carry."""
    if requested == "auto":
        return "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if "nccl" in requested and not cuda:
        raise DistributedError(f"ddp.process_group: {requested!r} needs GPUs (NCCL); none is visible here")
    return requested


class DDPBackend(Backend):
    name = "ddp"

    def __init__(self, *, process_group: str = "auto", timeout_s: int = 1800) -> None:
        _env_from_slurm()
        if "RANK" not in os.environ:
            raise DistributedError("train.backend is 'ddp' but no launcher set RANK/WORLD_SIZE "
                                   "(start with torchrun, srun, or `chexflow launch`)")
        cuda = torch.cuda.is_available()
        self.spec = process_group_spec(process_group, cuda=cuda)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")).split("(")[0] or 1)
        # the rank's CUDA device (None on CPU): set here, handed to DDP as its one device_id
        self.device_index = gpu_index(self.local_rank, torch.cuda.device_count()) if cuda else None
        if cuda:
            torch.cuda.set_device(self.device_index)
        dist.init_process_group(backend=self.spec, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        # a tensor stays on its device when the group has a backend for it; a single-backend NCCL
        # group only carries CUDA tensors, a gloo group carries CPU (and, for gloo, CUDA) tensors
        self._nccl_only = self.spec == "nccl"

    def _carry(self, value: torch.Tensor) -> torch.Tensor:
        if self._nccl_only and value.device.type != "cuda":
            return value.to(torch.device("cuda", torch.cuda.current_device()))
        return value

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's values into ``tensor`` in place (through a copy where the group cannot carry it)."""
        carried = self._carry(tensor.data)
        dist.broadcast(carried, src=0)
        if carried is not tensor.data:
            tensor.data.copy_(carried)

    def broadcast_model(self, model: torch.nn.Module) -> None:
        for t in model.state_dict().values():
            self._broadcast(t)

    def broadcast_buffers(self, model: torch.nn.Module) -> None:
        for buf in model.buffers():
            self._broadcast(buf)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # on the CPU whatever rank 0's device; load_state_dict moves it to each parameter's device
        state = [to_cpu(optimizer.state_dict()) if self.rank == 0 else None]
        dist.broadcast_object_list(state, src=0)
        optimizer.load_state_dict(state[0])

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def allreduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        v = self._carry(value.detach().clone())
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
        return (v / self.size).to(value.device)

    def allreduce_max(self, value: torch.Tensor) -> torch.Tensor:
        v = self._carry(value.detach().clone())
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.to(value.device)

    def allgather_object(self, obj: Any) -> list[Any]:
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def wrap(self, model, optimizer, *, fp16_compression: bool, backward_passes_per_step: int):
        from torch.nn.parallel import DistributedDataParallel as DDP
        # device_ids: the device set at init, not the local rank (two ranks sharing a GPU, or one GPU
        # per task, have local rank 1 and no device 1)
        ddp = DDP(model, device_ids=None if self.device_index is None else [self.device_index],
                  broadcast_buffers=False)
        if fp16_compression:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, optimizer

    def no_sync(self, model):
        return model.no_sync()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
