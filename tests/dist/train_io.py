"""One rank of a real training run that records, for the tests, the bytes it reads (``rchar`` of
/proc/self/io: every byte that read(2) returned, whatever the file system or page cache) before its
first optimizer step: from the start of ``Trainer.fit``, and from the Trainer's construction (which
reads the manifest). Started through `chexflow launch`."""
import argparse
import linecache
import json
import sys
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
# read before counting: what a first model build reads, and the source of the trainer's module, which
# torch.manual_seed reads on a host without CUDA (torch.cuda's lazy seeding formats the caller's stack)
torch.manual_seed(0)
build_model(cfg.model.arch, in_channels=1, num_outputs=1)
linecache.getlines(T.__file__)
marks = {"trainer": rchar()}
trainer = T.Trainer(cfg, T.TrainPaths(manifest=args.manifest, out_dir=args.out_dir, ckpt_dir=args.ckpt_dir,
                                      verified=args.verified), backend)
step = T.Trainer.train_step


def first_step(self, *a, **k):
    marks.setdefault("first_step", rchar())
    return step(self, *a, **k)


T.Trainer.train_step = first_step
marks["fit"] = rchar()
code = trainer.fit()
args.record.mkdir(parents=True, exist_ok=True)
(args.record / f"rank{backend.rank}.json").write_text(json.dumps(
    {"fit": marks["first_step"] - marks["fit"], "trainer": marks["first_step"] - marks["trainer"],
     "rank": backend.rank, "world": backend.size, "code": code}))
backend.shutdown()
sys.exit(code)
