"""One rank of a real training run that records what it reads and when, before its first optimizer
step: the bytes (``rchar`` of /proc/self/io: every byte read(2) returned, whatever the file system
or page cache) from the start of ``Trainer.fit`` and from the Trainer's construction (which reads
the manifest), and the wall-clock time of that step. Started through `chexflow launch` by
bench/scale_model.py and tests/test_verify_world.py:

    chexflow launch -n 4 -- python bench/first_step.py --config-json '{...}' --manifest M \
        --out-dir O --ckpt-dir C --verified V --record R      # R/rank<r>.json
"""
import argparse
import linecache
import json
import sys
import time
from pathlib import Path

import torch

from chexflow.settings import load_stage_config
from chexflow.train import trainer as T
from chexflow.train.backends import backend_for
from chexflow.train.config import TrainConfig
from chexflow.train.models import build_model


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


ap = argparse.ArgumentParser()
ap.add_argument("--config-json", required=True)
ap.add_argument("--manifest", type=Path, required=True)
ap.add_argument("--out-dir", type=Path, required=True)
ap.add_argument("--ckpt-dir", type=Path, required=True)
ap.add_argument("--verified", type=Path, required=True)
ap.add_argument("--record", type=Path, required=True)
args = ap.parse_args()

cfg = load_stage_config(TrainConfig, text=args.config_json)
backend = backend_for(cfg)
# read before counting: what a first model build and optimizer read (modules, not data; with torch as
# released, torch.optim imported TorchDynamo here: envs/patches/torch-dynamo-import.md), then the sources that
# torch.manual_seed reads on a host without CUDA (torch.cuda's lazy seeding formats the caller's stack): the
# trainer's module and, in a process that imported TorchDynamo, eval_frame.py and _compile.py
torch.optim.SGD(build_model(cfg.model.arch, in_channels=1, num_outputs=1).parameters(), lr=0.1)
torch.manual_seed(0)
# and the modules a run imports when it first needs them (scikit-learn, imported by rank 0 at validation
# alone, no longer brings them in first; nor does TorchDynamo, which torch.optim no longer imports): the
# lease's psutil, the loader's worker semaphores, the shuffle's numpy.random
import multiprocessing.synchronize  # noqa: E402,F401
import numpy.random  # noqa: E402,F401
import psutil  # noqa: E402,F401
linecache.getlines(T.__file__)
marks = {"trainer": rchar()}
trainer = T.Trainer(cfg, T.TrainPaths(manifest=args.manifest, out_dir=args.out_dir, ckpt_dir=args.ckpt_dir,
                                      verified=args.verified), backend)
step = T.Trainer.train_step


def first_step(self, *a, **k):
    if "first_step" not in marks:
        marks.update(first_step=rchar(), first_step_at=time.time())
    return step(self, *a, **k)


T.Trainer.train_step = first_step
marks["fit"] = rchar()
code = trainer.fit()
args.record.mkdir(parents=True, exist_ok=True)
(args.record / f"rank{backend.rank}.json").write_text(json.dumps(
    {"fit": marks["first_step"] - marks["fit"], "trainer": marks["first_step"] - marks["trainer"],
     "first_step_at": marks["first_step_at"], "rank": backend.rank, "world": backend.size, "code": code}))
backend.shutdown()
sys.exit(code)
