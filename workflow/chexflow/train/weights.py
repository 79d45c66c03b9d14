"""Whether a state dict fits a network: the one check of every weights file chexflow reads (resume
checkpoints, ``best-<run id>.pt``, ``model.pt`` for evaluate, predict and export, the pretrained
backbone). Its callers name the file; this says what does not fit."""
from __future__ import annotations

from typing import Any, Mapping

import torch


def weights_problem(expected: Mapping[str, torch.Tensor], got: Mapping[str, Any], *, show: int = 3) -> str | None:
    """Why the state dict ``got`` does not fit a network whose state dict is ``expected`` (the same
    keys, each a tensor of the same shape), naming the first mismatching keys; None when it fits."""
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    wrong = [f"{k}: {_shape(got[k])} where {tuple(expected[k].shape)} is expected" for k in expected
             if k in got and (not isinstance(got[k], torch.Tensor) or got[k].shape != expected[k].shape)]
    problems = [f"{len(items)} {what} ({', '.join(items[:show])}{', ...' if len(items) > show else ''})"
                for items, what in ((missing, "expected tensor(s) missing"),
                                    (extra, "tensor(s) the network does not have"),
                                    (wrong, "tensor(s) of another shape")) if items]
    return "; ".join(problems) or None


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
