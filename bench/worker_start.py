"""What starting loader workers costs: chexflow's fork server (chexflow.data.workers) against forking
the trainer directly (torch's default on Linux, chexflow's start method before issue 48).

Per run: a persistent loader of ``--workers`` workers started ``--passes`` times in a fresh process that
imports chexflow's loader and runs threads (as a trainer does), timed from ``iter(loader)`` to every
worker's first batch; the first start of the fork server is part of the run's cost. Memory: the
workers' unique set size (USS: what each adds to the node) and the fork server's. Alternated runs,
medians, the ratio fork server / fork.

    .venv/bin/python bench/worker_start.py [--workers 4] [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(method: str, workers: int, passes: int) -> dict:
    """In this process: start ``passes`` loaders of ``workers`` workers; times and memory."""
    import psutil
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from chexflow.data import workers as W

    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()     # a trainer runs threads
    args = W.loader_processes(workers) if method == "forkserver" else {"multiprocessing_context": "fork"}
    starts, uss = [], []
    for _ in range(passes):
        loader = DataLoader(TensorDataset(torch.zeros(workers, 1)), batch_size=1, num_workers=workers, **args)
        t0 = time.perf_counter()
        it = iter(loader)
        for _ in range(workers):
            next(it)
        starts.append(time.perf_counter() - t0)
        uss.append(sum(psutil.Process(w.pid).memory_full_info().uss for w in it._workers) / workers)
        it._shutdown_workers()
    server = sys.modules["multiprocessing.forkserver"]._forkserver._forkserver_pid if method == "forkserver" else None
    server_uss = psutil.Process(server).memory_full_info().uss if server else 0
    stop.set()
    return {"first_s": starts[0], "later_s": statistics.median(starts[1:]) if passes > 1 else None,
            "worker_uss_mib": statistics.median(uss) / 2**20, "server_uss_mib": server_uss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--passes", type=int, default=4, help="loader starts per run (the first starts the server)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--one", choices=["fork", "forkserver"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.workers, args.passes)))
        return
    found: dict[str, list[dict]] = {"fork": [], "forkserver": []}
    for _ in range(args.runs):
        for method in found:            # alternated: the host's drift falls on both
            out = subprocess.run([sys.executable, __file__, "--one", method, "--workers", str(args.workers),
                                  "--passes", str(args.passes)], capture_output=True, text=True, check=True,
                                 env={"PYTHONPATH": str(ROOT / "workflow"), "PATH": "/usr/bin:/bin"})
            found[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {m: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for m, runs in found.items()}
    for m, v in med.items():
        print(f"{m:>10}: first start of {args.workers} workers {v['first_s']:.3f} s, later starts {v['later_s']:.3f} s, "
              f"USS per worker {v['worker_uss_mib']:.1f} MiB, fork server {v['server_uss_mib']:.1f} MiB")
    f, s = med["fork"], med["forkserver"]
    print(f"ratio fork server / fork (medians of {args.runs} alternated runs): first start {s['first_s'] / f['first_s']:.2f}x "
          f"(+{s['first_s'] - f['first_s']:.2f} s once per run), later starts {s['later_s'] / f['later_s']:.2f}x, "
          f"USS per worker {s['worker_uss_mib'] / f['worker_uss_mib']:.2f}x")


if __name__ == "__main__":
    main()
