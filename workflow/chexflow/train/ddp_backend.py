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

from chexflow.train.distributed import Backend, DistributedError


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


class DDPBackend(Backend):
    name = "ddp"

    def __init__(self) -> None:
        _env_from_slurm()
        if "RANK" not in os.environ:
            raise DistributedError("train.backend is 'ddp' but no launcher set RANK/WORLD_SIZE "
                                   "(start with torchrun, srun, or `chexflow launch`)")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")).split("(")[0] or 1)
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=60))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broadcast_model(self, model: torch.nn.Module) -> None:
        for t in model.state_dict().values():
            dist.broadcast(t.data if hasattr(t, "data") else t, src=0)

    def broadcast_buffers(self, model: torch.nn.Module) -> None:
        for buf in model.buffers():
            dist.broadcast(buf.data, src=0)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        state = [optimizer.state_dict() if self.rank == 0 else None]
        dist.broadcast_object_list(state, src=0)
        optimizer.load_state_dict(state[0])

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def allreduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        v = value.detach().clone().to(self._device)
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
        return (v / self.size).to(value.device)

    def allreduce_max(self, value: torch.Tensor) -> torch.Tensor:
        v = value.detach().clone().to(self._device)
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
        ddp = DDP(model, device_ids=[self.local_rank] if torch.cuda.is_available() else None,
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
