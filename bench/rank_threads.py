"""What sharing a job's threads among its local ranks saves: one 2-rank training job, each way.

Snakemake sets ``OMP_NUM_THREADS`` to a job's ``threads``; `chexflow launch` gives each of the job's local ranks
an even share (chexflow.train.launch.rank_threads). A real job (`chexflow launch -n 2 chexflow train`: Horovod
if it is built, else DDP; config.yaml's pretraining settings and model (--arch), 2 epochs of 32 px random images
written as chexflow shards, one loader worker per rank) runs --runs times in each of two ways, alternated,
after --warmup (1) untimed runs of each:

- ``shared``: a job of 2 threads, as `--set-threads pretrain_model=2` makes it: 1 thread per rank;
- ``each``: every rank takes the job's 2 threads, as before (a job of 4 threads, shared by 2 ranks, gives each
  of them 2: the same processes).

Per job: CPU seconds (the launcher and everything it started, reaped) and wall seconds. Prints medians and
the ratio shared / each:

    python bench/rank_threads.py                      # ~3 min on a 2-core VM
    python bench/rank_threads.py --runs 7 --json out.json
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "workflow")]

from chexflow import host  # noqa: E402
from import_cost import paired  # noqa: E402
from rank_start import config  # noqa: E402
from train_throughput import write_shards  # noqa: E402

RANKS = 2
JOB_THREADS = {"shared": 2, "each": 2 * RANKS}     # OMP_NUM_THREADS of the job; each rank gets it // RANKS


def backend() -> str:
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True)
    return "horovod" if probe.returncode == 0 else "ddp"


def run_once(job_threads: int, cfg: dict, manifest: Path, work: Path) -> tuple[float, float]:
    """(CPU seconds of the job, its wall seconds) of one `chexflow launch -n 2 chexflow train`."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(job_threads), "PYTHONPATH": str(REPO / "workflow"),
           "CHEXFLOW_VERIFIED_DIR": str(work / "verified")}
    argv = [sys.executable, "-m", "chexflow", "launch", "--backend", cfg["backend"], "-n", str(RANKS), "--",
            sys.executable, "-m", "chexflow", "train", "--config-json", json.dumps(cfg), "--manifest", str(manifest),
            "--out-dir", str(work / "out"), "--ckpt-dir", str(work / "ckpt")]
    start = time.monotonic()
    with open(work.parent / "train.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    if os.waitstatus_to_exitcode(status) != 0 or not (work / "out" / "model.pt").exists():
        raise SystemExit(f"the training job failed: {(work.parent / 'train.log').read_text()[-3000:]}")
    used = {json.loads(line)["host"]["torch_threads"] for line in (work / "out/metrics.jsonl").read_text().splitlines()}
    if used != {job_threads // RANKS}:       # what the ranks used (rank 0's record): the way measured is the way meant
        raise SystemExit(f"a job of {job_threads} threads: its ranks used {sorted(used)} each, "
                         f"not {job_threads // RANKS}")
    return usage.ru_utime + usage.ru_stime, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs of each way")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each way first")
    ap.add_argument("--arch", default="resnet18", help="torchvision model (default: config.yaml's, resnet18)")
    ap.add_argument("--images", type=int, default=1280, help="training images (2 epochs of them)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    batch, n_train, epochs = 32, args.images, 2
    with tempfile.TemporaryDirectory(prefix="chexflow-rank-threads-") as tmp:
        root = Path(tmp)
        (root / "shards").mkdir()
        manifest = write_shards(root / "shards", n_train=n_train, n_val=64, size=32, per_shard=64)
        steps = n_train // (batch * RANKS)
        cfg = {**config(steps, batch), "backend": backend(), "epochs": epochs}
        cfg["model"] = {**cfg["model"], "arch": args.arch}
        ways = {name: functools.partial(run_once, threads, cfg, manifest, root / "run")
                for name, threads in JOB_THREADS.items()}
        row, line = paired(ways, "shared", "each", runs=args.runs, warmup=args.warmup, second=("wall_s", "s wall"))
    result = {"host": host.describe(), "runs": args.runs, "backend": cfg["backend"], "ranks": RANKS, "arch": args.arch,
              "steps": steps * epochs, "job": row}
    print(f"a {RANKS}-rank training job ({cfg['backend']}, {steps * epochs} steps of {batch} per rank, {args.arch}, "
          f"32 px): {line}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
