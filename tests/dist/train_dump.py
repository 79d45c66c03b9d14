"""One rank of a real training run that also records, for the tests, what this rank wrote, what each
validation returned on it, whether it imported scikit-learn or torch's compiler (TorchDynamo, Inductor), and its
final weights. Started by the tests through `chexflow launch` (horovodrun / torchrun)."""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

from chexflow.settings import load_stage_config
from chexflow.train.config import TrainConfig
from chexflow.fsutil import write_text_atomic as _real_write_text
from chexflow.train import checkpoint as ckpt
from chexflow.train import trainer as T
from chexflow.train.backends import backend_for

ap = argparse.ArgumentParser()
ap.add_argument("--config-json", required=True)
ap.add_argument("--manifest", type=Path, required=True)
ap.add_argument("--out-dir", type=Path, required=True)
ap.add_argument("--ckpt-dir", type=Path, required=True)
ap.add_argument("--pretrained", type=Path, default=None)
ap.add_argument("--dump", type=Path, required=True)
args = ap.parse_args()

cfg = load_stage_config(TrainConfig, text=args.config_json)
backend = backend_for(cfg)
writes = []
real_save = ckpt.save_atomic


def save_atomic(obj, path):
    writes.append(str(path))
    real_save(obj, path)


def write_text(path, text):
    writes.append(str(path))
    _real_write_text(path, text)


real_validate = T.validate
validations = []


def validate(*args, **kwargs):
    validations.append(real_validate(*args, **kwargs))
    return validations[-1]


ckpt.save_atomic = save_atomic
T.write_text_atomic = write_text
T.validate = validate
trainer = T.Trainer(cfg, T.TrainPaths(manifest=args.manifest, out_dir=args.out_dir, ckpt_dir=args.ckpt_dir,
                                      pretrained=args.pretrained), backend)
code = trainer.fit()
args.dump.mkdir(parents=True, exist_ok=True)
rank = backend.rank
torch.save({k: v.detach().cpu() for k, v in trainer.model.named_parameters()}, args.dump / f"rank{rank}.pt")
(args.dump / f"rank{rank}.json").write_text(json.dumps({"writes": writes, "world": backend.size,
                                                        "code": code, "pid": os.getpid(), "validations": validations,
                                                        "sklearn_imported": "sklearn" in sys.modules,
                                                        "compiler_imported": sorted({"torch._dynamo", "torch._inductor"}
                                                                                    & set(sys.modules)),
                                                        "deterministic": torch.are_deterministic_algorithms_enabled()}))
backend.shutdown()
sys.exit(code)
