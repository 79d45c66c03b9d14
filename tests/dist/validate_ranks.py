"""One rank of a 2-rank world (`chexflow launch --backend ddp|horovod -n 2`) running chexflow's validation pass
twice on hand-made scores: each rank's share of 16 images (4 labels), its scores the image's targets plus
noise; the second time rank 1's scores of its first image are NaN. Records, per rank: what each pass
returned or raised, and whether the rank imported scikit-learn."""
import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from chexflow.train.backends import init_backend
from chexflow.train.validation import validate

ap = argparse.ArgumentParser()
ap.add_argument("--backend", required=True)
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()

backend = init_backend(args.backend, process_group="cpu:gloo", stage_through_cpu=True)
rng = np.random.default_rng(7)
targets = (rng.random((16, 4)) < 0.4).astype(np.float32)
scores = targets + rng.normal(0, 0.8, targets.shape).astype(np.float32)
mine = slice(8 * backend.rank, 8 * backend.rank + 8)


class Scores(torch.nn.Module):
    """The "model": each image's row of hand-made scores (the image tensor carries its index)."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.table = torch.from_numpy(table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x.flatten(1)[:, 0].long()]


data = SimpleNamespace(task="multilabel", labels=("A", "B", "C", "D"),
                       augment=lambda images, **_: images)
loader = [(torch.arange(mine.start, mine.stop, dtype=torch.float32)[i:i + 4, None, None, None].expand(-1, 1, 2, 2),
           torch.from_numpy(targets[mine][i:i + 4]), None) for i in (0, 4)]
passes = []
for table in (scores, np.where(np.arange(16)[:, None] == 8, np.nan, scores).astype(np.float32)):
    try:
        loss, metric, name = validate(Scores(table), data, backend, torch.device("cpu"), bf16=False,
                                      channels_last=False, loader=loader)
        passes.append({"metric": metric, "name": name, "loss": loss})
    except ValueError as exc:
        passes.append({"refused": str(exc)})
args.out.mkdir(parents=True, exist_ok=True)
(args.out / f"rank{backend.rank}.json").write_text(json.dumps(
    {"passes": passes, "sklearn_imported": "sklearn" in sys.modules, "world": backend.size}))
backend.shutdown()
