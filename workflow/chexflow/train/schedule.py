"""The optimizer, and learning-rate scaling and warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

The LR in the config is for ``reference_batch`` images; with ``world`` ranks of ``batch_size``
each, the target LR is ``lr * batch_size * world / reference_batch`` (the linear scaling rule).
Training starts at the single-worker LR ``lr * batch_size / reference_batch`` and ramps linearly to
the target over ``warmup_epochs`` (gradual warmup), then decays (cosine, step or none).
"""
from __future__ import annotations

import math

import torch

from chexflow.train.config import OptimConfig, ScheduleConfig


def build_optimizer(optim: OptimConfig, params) -> torch.optim.Optimizer:
    """``optim.name`` over ``params`` (parameter groups: their ``lr_mult`` is applied by the
    schedule, so the base LR is 1.0), with the kernels ``optim.implementation`` names.

    Fused is one kernel over all parameters on CUDA and on CPU. On CPU torch's default is the
    for-loop one: for ResNet-18 an Adam step costs 0.092 s on one core against 0.016 s fused
    (``bench/optimizer_step.py``); for-loop Adam was a quarter of a demo training step. The kernels differ in
    floating-point rounding only; a run's checkpoints resume with the implementation they were
    written with (it is part of the config, hence of the run id).
    """
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True},
            "for-loop": {"foreach": False, "fused": False}}[optim.implementation]
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=1.0, momentum=optim.momentum, weight_decay=optim.weight_decay,
                               nesterov=optim.nesterov, **impl)
    cls = torch.optim.Adam if optim.name == "adam" else torch.optim.AdamW
    return cls(params, lr=1.0, weight_decay=optim.weight_decay, **impl)


def scaled_lr(optim: OptimConfig, *, batch_size: int, world: int) -> float:
    return optim.lr * batch_size * world / optim.reference_batch


def lr_at(step: int, *, optim: OptimConfig, sched: ScheduleConfig, batch_size: int, world: int,
          steps_per_epoch: int, epochs: int) -> float:
    """The LR used for optimizer step ``step`` (0-based)."""
    target = scaled_lr(optim, batch_size=batch_size, world=world)
    start = target / world
    warm = int(round(sched.warmup_epochs * steps_per_epoch))
    if step < warm:
        return start + (target - start) * step / warm
    total = max(epochs * steps_per_epoch, 1)
    if sched.decay == "cosine":
        progress = min((step - warm) / max(total - warm, 1), 1.0)
        return target * 0.5 * (1.0 + math.cos(math.pi * progress))
    if sched.decay == "step":
        epoch = step // max(steps_per_epoch, 1)
        return target * 0.1 ** sum(1 for e in sched.step_epochs if epoch >= e)
    return target


def make_scheduler(optimizer: torch.optim.Optimizer, **kw) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor reproduces :func:`lr_at` (the optimizer's base LR is 1.0), times the
    group's ``lr_mult`` (:func:`chexflow.train.models.param_groups`; 1.0 when absent)."""
    for group in optimizer.param_groups:
        group["lr"] = 1.0
        group["initial_lr"] = 1.0

    def factor(mult: float):
        return lambda step: mult * lr_at(step, **kw)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor(float(g.get("lr_mult", 1.0)))
                                                         for g in optimizer.param_groups])


def set_scheduler_step(sched: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put ``sched`` (and its optimizer's LRs) at optimizer step ``step`` of its own schedule, as if
    it had been stepped that often (a resume whose schedule was recomputed, e.g. for another world)."""
    sched.last_epoch = step
    sched._step_count = step + 1
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(step)
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]
