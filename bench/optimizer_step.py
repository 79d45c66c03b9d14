"""Seconds per optimizer step by kernel implementation (optim.implementation), same process.

The baseline is torch's default on CPU, the for-loop kernels (one tensor at a time); foreach and
fused (chexflow's default) are reported as ratios against it, measured in the same run on the
same parameters and gradients. Only the optimizer step is timed (no forward/backward).

usage: OMP_NUM_THREADS=1 PYTHONPATH=workflow python bench/optimizer_step.py [--archs resnet18]
       [--optims adam,sgd] [--device cpu|cuda] [--steps 20] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from chexflow.train.config import OptimConfig
from chexflow.train.models import build_model, param_groups
from chexflow.train.schedule import build_optimizer

IMPLS = ("for-loop", "foreach", "fused")


def seconds_per_step(arch: str, optim: str, impl: str, device: torch.device, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model(arch, in_channels=1, num_outputs=14).to(device)
    opt = build_optimizer(OptimConfig(name=optim, lr=1e-3, implementation=impl), param_groups(model, backbone_lr_mult=1.0))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    for _ in range(3):                                   # state allocated, kernels warm
        opt.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="resnet18")
    ap.add_argument("--optims", default="adam,sgd")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'arch':<12}{'optim':<7}" + "".join(f"{i + ' s':>13}" for i in IMPLS) + f"{'fused/for-loop':>16}")
    for arch in args.archs.split(","):
        for optim in args.optims.split(","):
            t = {impl: seconds_per_step(arch, optim, impl, device, args.steps) for impl in IMPLS}
            rows.append({"arch": arch, "optim": optim, "device": str(device), "threads": torch.get_num_threads(),
                         **{f"{impl}_s": t[impl] for impl in IMPLS},
                         "fused_speedup": t["for-loop"] / t["fused"], "foreach_speedup": t["for-loop"] / t["foreach"]})
            print(f"{arch:<12}{optim:<7}" + "".join(f"{t[i]:>13.4f}" for i in IMPLS)
                  + f"{t['for-loop'] / t['fused']:>15.1f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
