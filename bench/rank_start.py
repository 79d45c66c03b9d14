"""What a training rank that does not compile pays for TorchDynamo and Inductor, and what it pays without them.

A real `chexflow train` (one rank, backend single, config.yaml's pretraining settings with a ResNet-18, one
epoch of 32 px random images written as chexflow shards, one loader worker, OMP_NUM_THREADS=1) runs --runs
times in each of two ways, alternated, after --warmup (1) untimed runs of each:

- ``now``: as installed (envs/setup.sh patches torch 2.14.1's optimizers, envs/patches/torch-dynamo-import.md,
  and the trainer sets the deterministic flag without Inductor's configuration);
- ``before``: the same process with ``torch._dynamo`` and ``torch._inductor.config`` imported first, which is
  what torch.optim and ``torch.use_deterministic_algorithms`` imported before: the optimizer's wrappers and the
  trainer then take torch's own paths, as they did.

Per process: CPU seconds (user + system of the process and its loader worker, reaped) and peak memory of the
rank. Prints medians and the ratio now / before:

    python bench/rank_start.py                      # ~3 min on a 2-core VM
    python bench/rank_start.py --runs 7 --json out.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "workflow")]

from chexflow import host  # noqa: E402
from chexflow.config import stage_settings  # noqa: E402
from import_cost import paired  # noqa: E402
from train_throughput import write_shards  # noqa: E402

BEFORE = "import torch._dynamo, torch._inductor.config; "
MAIN = "import sys; from chexflow.cli import main; sys.exit(main(sys.argv[1:]))"


def config(steps_per_epoch: int, batch: int) -> dict:
    cfg = stage_settings(yaml.safe_load((REPO / "config.yaml").read_text()), "pretrain", "bench")
    cfg.update(backend="single", epochs=1, batch_size=batch, compile=False, deterministic=True)
    cfg["model"] = {**cfg["model"], "arch": "resnet18"}
    cfg["data"] = {**cfg["data"], "workers": 1, "crop": 32}
    cfg["checkpoint"] = {**cfg["checkpoint"], "every_steps": steps_per_epoch}
    cfg["check_every_steps"] = steps_per_epoch
    return cfg


def run_once(prelude: str, cfg: dict, manifest: Path, work: Path) -> tuple[float, float]:
    """(CPU seconds of the rank and its worker, the rank's peak MiB) of one `chexflow train`."""
    shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "workflow"),
           "CHEXFLOW_VERIFIED_DIR": str(work / "verified")}
    argv = ["train", "--config-json", json.dumps(cfg), "--manifest", str(manifest),
            "--out-dir", str(work / "out"), "--ckpt-dir", str(work / "ckpt")]
    with open(work.parent / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", prelude + MAIN, *argv], env=env, stdout=log, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not (work / "out" / "model.pt").exists():
        raise SystemExit(f"chexflow train failed: {(work.parent / 'train.log').read_text()[-3000:]}")
    # the loader worker is the rank's child: its CPU is in the rank's reaped usage when it was waited for
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs of each way")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each way first")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    batch, n_train = 32, 320
    with tempfile.TemporaryDirectory(prefix="chexflow-rank-start-") as tmp:
        root = Path(tmp)
        (root / "shards").mkdir()
        manifest = write_shards(root / "shards", n_train=n_train, n_val=64, size=32, per_shard=64)
        cfg = config(n_train // batch, batch)
        ways = {name: functools.partial(run_once, prelude, cfg, manifest, root / "run")
                for name, prelude in (("now", ""), ("before", BEFORE))}
        row, line = paired(ways, "now", "before", runs=args.runs, warmup=args.warmup)
    result = {"host": host.describe(), "runs": args.runs, "steps": n_train // batch, "rank": row}
    print(f"a training rank ({n_train // batch} steps, ResNet-18, 32 px): {line}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
