"""Hyper-parameter sweep of fine-tuning: trials, one fine-tuning run per trial, selection on val.

``expand_trials`` turns the ``sweep:`` section into a list of trials (pure, seeded). Each trial
is the finetune section with some keys overridden (dotted keys: ``optim.lr``, ...). A trial job
runs the real trainer through the configured launcher and records its outcome in ``result.json``:
``ok`` with the best validation metric, or ``failed`` when training diverged (non-finite loss) or
the ranks crashed. What is not the trial's fault fails the job instead: an invalid trial config or
missing input (before any rank starts) and preemption (so a retry resumes). ``select`` picks the
best validation metric among the ``ok`` trials and fails when none is (a broken setup fails every
trial). Only the winner is evaluated on test, once.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chexflow.fsutil import atomic_path, read_json, write_text_atomic
from chexflow.settings import ConfigError, from_dict, write_yaml_atomic
from chexflow.studies.config import SweepConfig
from chexflow.train.config import TrainConfig

if TYPE_CHECKING:
    import pandas as pd

# (numpy, pandas and torch are imported where used: the Snakefile expands the trials at DAG time)

# dotted finetune key -> how a random trial draws it from the listed values
KEYS = ("optim.lr", "optim.weight_decay", "batch_size", "model.dropout", "freeze")
LOG_UNIFORM = {"optim.lr", "optim.weight_decay"}   # between min and max of the list (log if min > 0)
CHOICE = {"batch_size", "freeze"}                   # one of the listed values
# any other key (model.dropout): uniform between min and max of the list


class SweepError(ConfigError):
    pass


class SweepRecordError(ValueError):
    """A trial's result.json that is not the sweep's record (names the file and the key)."""


def space_of(cfg: SweepConfig) -> dict[str, tuple]:
    """The swept keys (dotted) and their listed values; keys with an empty list are not swept (the
    values' ranges are the fields' of chexflow.studies.config.SweepSpace)."""
    s = cfg.space
    space = {"optim.lr": s.optim.lr, "optim.weight_decay": s.optim.weight_decay, "batch_size": s.batch_size,
             "model.dropout": s.model.dropout, "freeze": s.freeze}
    return {k: tuple(v) for k, v in space.items() if v}


def _short(x: float) -> float:
    return float(f"{x:.4g}")


def expand_trials(cfg: SweepConfig) -> list[dict[str, Any]]:
    """``[{"id": "t000", "params": {dotted key: value}}, ...]``.

    grid: every combination of the listed values (one trial of the unchanged finetune section
    when nothing is swept). random: ``n_trials`` draws seeded by ``seed``; lr and weight decay
    log-uniform between the smallest and largest listed value (uniform when the smallest is 0),
    dropout uniform in that range, batch size and freeze one of the listed values.
    """
    space = space_of(cfg)
    if cfg.method == "grid":
        keys = list(space)
        trials = [dict(zip(keys, combo)) for combo in itertools.product(*(space[k] for k in keys))]
    else:
        import numpy as np
        rng = np.random.default_rng(cfg.seed)
        trials = []
        for _ in range(cfg.n_trials):
            params: dict[str, Any] = {}
            for key in KEYS:
                if key not in space:
                    continue
                values = space[key]
                lo, hi = min(values), max(values)
                if key in CHOICE or lo == hi:
                    params[key] = values[int(rng.integers(len(values)))]
                elif key in LOG_UNIFORM and lo > 0:
                    params[key] = _short(math.exp(rng.uniform(math.log(lo), math.log(hi))))
                else:
                    params[key] = min(_short(rng.uniform(lo, hi)), hi)
            trials.append(params)
    return [{"id": f"t{i:03d}", "params": p} for i, p in enumerate(trials)]


def apply_params(finetune: dict, params: dict[str, Any]) -> dict:
    """The finetune section (a mapping) with dotted keys overridden."""
    out = copy.deepcopy(finetune)
    for dotted, value in params.items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def trial_config(finetune: dict, params: dict[str, Any]) -> TrainConfig:
    cfg = from_dict(TrainConfig, apply_params(finetune, params))
    from chexflow.train.models import ModelError, build_model, freeze_backbone
    try:       # freeze must fit the architecture: a sweep setup error, found before any rank starts
        freeze_backbone(build_model(cfg.model.arch, in_channels=cfg.model.in_channels, num_outputs=1), cfg.freeze)
    except ModelError as exc:
        raise SweepError(f"trial config: {exc}") from exc
    return cfg


def _best(history_file: Path) -> tuple[float | None, str | None, int | None]:
    from chexflow.train.epochs import read_epochs
    rows = read_epochs(history_file, "sweep trial")
    finite = [r for r in rows if r.get("val_metric") is not None and math.isfinite(float(r["val_metric"]))]
    if not finite:
        return None, rows[-1].get("val_metric_name") if rows else None, None
    best = max(finite, key=lambda r: float(r["val_metric"]))
    return float(best["val_metric"]), best.get("val_metric_name"), int(best["epoch"])


def run_trial(finetune: dict, params: dict[str, Any], *, trial_id: str, launcher: list[str], ranks: int,
              manifest: Path, pretrained: Path | None, out_dir: Path) -> dict[str, Any]:
    """Run one trial (its ranks started through ``launcher``: chexflow.train.run.start); write and
    return result.json."""
    from chexflow.train.run import start
    from chexflow.train.trainer import TrainPaths
    cfg = trial_config(finetune, params)
    for path in (manifest, pretrained) if cfg.init == "pretrained" else (manifest,):
        if path is None or not Path(path).is_file():
            raise SweepError(f"trial {trial_id}: input not found: {path}")
    out_dir = Path(out_dir)
    for name in ("result.json", "model.pt", "metrics.jsonl"):
        (out_dir / name).unlink(missing_ok=True)
    write_yaml_atomic(cfg, out_dir / "trial_config.yaml")
    print(f"trial {trial_id}: {json.dumps(params)}", flush=True)
    paths = TrainPaths(manifest=Path(manifest), out_dir=out_dir, ckpt_dir=out_dir / "checkpoints",
                       pretrained=None if pretrained is None else Path(pretrained))
    outcome = start(cfg, paths, launcher=launcher, ranks=ranks)
    if outcome.status == "interrupted":
        raise SystemExit(outcome.exit_code)     # preempted / killed: not the trial's outcome; a retry resumes
    result: dict[str, Any] = {"trial": trial_id, "params": params, "exit_code": outcome.exit_code, "status": "ok",
                              "reason": None, "val_metric": None, "val_metric_name": None, "best_epoch": None,
                              "model": None, "run_id": outcome.run_id}
    if outcome.status == "diverged":
        result.update(status="failed", reason=f"diverged: {outcome.detail}")
    elif outcome.status == "no_valid_epoch":
        result.update(status="failed", reason=outcome.detail)
    elif outcome.status == "crashed":
        result.update(status="failed", reason=f"crashed ({outcome.detail})", log_tail=list(outcome.log_tail))
    else:
        from chexflow.train.checkpoint import load_model_file
        metric, name, epoch = _best(out_dir / "metrics.jsonl")
        # the model the trainer just wrote is this trial's: the selection copies only a file of this run id
        load_model_file(outcome.model, expect={"run_id": outcome.run_id, "task": "multilabel"})
        result.update(val_metric=metric, val_metric_name=name, best_epoch=epoch, model=str(outcome.model))
        if metric is None:
            result.update(status="failed", reason="no finite validation metric")
    write_text_atomic(out_dir / "result.json", json.dumps(result, indent=1))
    print(f"trial {trial_id}: {result['status']}" + (f" ({result['reason']})" if result["reason"] else "")
          + (f", val {result['val_metric_name']} {result['val_metric']:.4f}" if result["val_metric"] is not None else ""))
    return result


def select(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``ok`` trial with the best validation metric (ties: the first trial id)."""
    ok = [r for r in results if r.get("status") == "ok" and r.get("val_metric") is not None
          and math.isfinite(float(r["val_metric"]))]
    if not ok:
        reasons = "; ".join(f"{r.get('trial')}: {r.get('reason')}" for r in results)
        raise SweepError(f"no sweep trial succeeded ({reasons}): check the setup")
    return max(sorted(ok, key=lambda r: r["trial"]), key=lambda r: float(r["val_metric"]))


def table(results: list[dict[str, Any]], winner: str | None) -> "pd.DataFrame":
    import pandas as pd
    return pd.DataFrame([{"trial": r["trial"], "status": r["status"], "val_metric": r.get("val_metric"),
                          "val_metric_name": r.get("val_metric_name"), "best_epoch": r.get("best_epoch"),
                          **{k: r["params"].get(k) for k in KEYS if k in r["params"]},
                          "reason": r.get("reason"), "winner": r["trial"] == winner}
                         for r in sorted(results, key=lambda r: r["trial"])])


# the keys of result.json the selection reads (run_trial writes them all)
RESULT_KEYS = ("trial", "params", "status", "val_metric", "model")


def read_result(path: Path) -> dict[str, Any]:
    """A trial's result.json as :func:`run_trial` writes it (a regular file, a JSON object with
    RESULT_KEYS); anything else is a :class:`SweepRecordError` naming the file and the key."""
    result = read_json(path, SweepRecordError, what="sweep trial result", kind="a sweep trial's result")
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing or not isinstance(result["params"], dict):
        raise SweepRecordError(f"{path}: not a sweep trial's result: " + (f"no {missing}" if missing else
                                                                          "params is not an object"))
    return result


def write_selection(result_files: list[Path], *, out_csv: Path, out_json: Path, out_model: Path) -> dict[str, Any]:
    results = [read_result(p) for p in result_files]
    winner = select(results)
    df = table(results, winner["trial"])
    with atomic_path(out_csv) as tmp:
        df.to_csv(tmp, index=False, float_format="%.6g")
    from chexflow.train.checkpoint import load_model_file
    # the winner's file must still be the model its trial recorded (format, task, run id), not a stale one
    load_model_file(winner["model"], expect={"run_id": winner.get("run_id"), "task": "multilabel"})
    with atomic_path(out_model) as tmp:
        shutil.copyfile(winner["model"], tmp)
    summary = {"winner": winner, "n_trials": len(results),
               "n_failed": sum(r["status"] != "ok" for r in results),
               "trials": json.loads(df.to_json(orient="records"))}
    write_text_atomic(out_json, json.dumps(summary, indent=1))
    return summary
