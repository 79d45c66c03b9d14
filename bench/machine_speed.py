"""The machine's speed figure: images/s of one ResNet-18 training step (chexflow's grey stem, 14
outputs, 32 px, batch 64, SGD, fp32) on 1 thread and on every core, and the host it ran on.

Hosts of one machine kind differ up to ~3.7x in CPU speed and in vector units; a time measured on
one says little about another until it is scaled by this figure. BENCHMARKS.md gives it beside each
time, `.ci/run` prints it before the suite, and a reader runs it to scale a figure to their machine:

    python bench/machine_speed.py                  # ~20 s on a 2-core VM
    python bench/machine_speed.py --json speed.json

Median of --repeats timed runs of --steps steps each, after --warmup untimed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from chexflow import host  # noqa: E402
from chexflow.train.models import build_model  # noqa: E402


def step_rate(threads: int, *, batch: int, crop: int, steps: int, warmup: int, repeats: int) -> float:
    """Median images/s of the training step on ``threads`` threads."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model("resnet18", in_channels=1, num_outputs=14).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 1, crop, crop)
    y = (torch.rand(batch, 14) < 0.1).float()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps * batch / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--crop", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="also write the figure to this JSON file")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    kw = dict(batch=args.batch, crop=args.crop, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    one = step_rate(1, **kw)
    alln = step_rate(cores, **kw) if cores > 1 else one
    result = {"what": f"ResNet-18 training step, {args.crop} px, batch {args.batch}, fp32",
              "img_s_1_thread": round(one, 1), f"img_s_{cores}_threads": round(alln, 1), "cores": cores,
              "host": host.describe()}
    print(f"machine speed: {one:.1f} img/s on 1 thread, {alln:.1f} on {cores} "
          f"(ResNet-18 step, {args.crop} px, batch {args.batch}); {host.summary(result['host'])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
