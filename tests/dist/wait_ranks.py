"""One rank of a 2-rank Horovod world (`chexflow launch --backend horovod -n 2`) where rank 0 works alone
for ``--wait`` seconds before each collective (an allreduce, a broadcast of an object, the barrier) and
rank 1 waits in it. Records, per rank, the collectives' results and the CPU time of the calling thread
inside each one. ``--spin``: Horovod's own wait (chexflow's polling taken out again), for comparison."""
import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from chexflow.train.backends import init_backend
from chexflow.train.backends.horovod import SYNCHRONIZE_MODULES

ap = argparse.ArgumentParser()
ap.add_argument("--out", type=Path, required=True)
ap.add_argument("--wait", type=float, required=True)
ap.add_argument("--spin", action="store_true")
args = ap.parse_args()

backend = init_backend("horovod", stage_through_cpu=True)
if args.spin:
    for module in map(importlib.import_module, SYNCHRONIZE_MODULES):
        module.synchronize = module.synchronize.__wrapped__


def timed(collective):
    """``collective()`` after rank 0's ``--wait`` seconds of work: (its result, this thread's CPU s in it)."""
    if backend.rank == 0:
        time.sleep(args.wait)               # rank 0 busy elsewhere (a checkpoint, a hash)
    start = time.thread_time()
    result = collective()
    return result, time.thread_time() - start


out = {"rank": backend.rank}
(mean, out["allreduce_cpu_s"]) = timed(lambda: backend.allreduce_mean(torch.tensor([float(backend.rank)])))
out["mean"] = mean.item()
(out["object"], out["broadcast_cpu_s"]) = timed(lambda: backend.broadcast_object({"from": backend.rank}))
(_, out["barrier_cpu_s"]) = timed(backend.barrier)
(args.out / f"rank{backend.rank}.json").write_text(json.dumps(out))
backend.shutdown()
