"""Scaling study of pretraining (weak scaling): the same per-rank workload at every world size.

Each world size is one multi-rank job running the real trainer on the pretraining data with the
pretraining settings, except for a fixed workload (``scaling:`` in config.yaml: steps per rank,
batch per rank, architecture, crop). Its throughput is that of the last epoch (the first warms
up: worker start, allocator, caches). The summary compares every world size with the smallest:
speedup = images/s(w) / images/s(w0), scaling efficiency = speedup / (w / w0).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from chexflow.fsutil import atomic_path, read_json, write_text_atomic
from chexflow.studies.config import ScalingConfig
from chexflow.train.config import TrainConfig

COLUMNS = ["world_size", "images_per_sec", "images_per_sec_per_rank", "speedup", "ideal_speedup",
           "efficiency", "time_per_epoch_s", "measured_epoch_s", "steps_per_rank", "batch_per_rank",
           "global_batch", "epoch_images", "nodes", "ranks_per_node", "cores_per_node", "threads_per_rank"]
PLACEMENT = ("nodes", "ranks_per_node", "cores_per_node", "threads_per_rank")   # where the ranks ran
# the columns a point measures (summarize computes the rest; PLACEMENT may be absent from older points)
MEASURED = tuple(c for c in COLUMNS if c not in ("speedup", "ideal_speedup", "efficiency", *PLACEMENT))


class ScalingError(ValueError):
    pass


def train_config(pretrain: TrainConfig, scaling: ScalingConfig, world: int) -> TrainConfig:
    """The pretraining config with the fixed workload of the study for ``world`` ranks."""
    if world < 1:
        raise ScalingError(f"world size must be >= 1, got {world}")
    return dataclasses.replace(
        pretrain, epochs=scaling.epochs, batch_size=scaling.batch_size, max_steps=None,
        model=dataclasses.replace(pretrain.model, arch=scaling.arch),
        data=dataclasses.replace(pretrain.data, crop=scaling.crop,
                                 samples_per_epoch=scaling.steps_per_rank * scaling.batch_size * world),
        checkpoint=dataclasses.replace(pretrain.checkpoint, every_steps=0, keep=1))


def epoch_images(pretrain: TrainConfig, manifest: dict) -> int:
    """Images in one epoch of the real pretraining run (its cap, or the whole train split)."""
    n = int(manifest["splits"]["train"]["n_images"])
    cap = pretrain.data.samples_per_epoch
    return min(n, cap) if cap is not None else n


def throughput_point(history: list[dict], *, world: int, scaling: ScalingConfig, n_epoch_images: int) -> dict:
    """Throughput of one world size from the trainer's per-epoch rows (the last epoch counts)."""
    if not history:
        raise ScalingError("the scaling run recorded no epoch")
    last = history[-1]
    if int(last["world_size"]) != world:
        raise ScalingError(f"ran on {last['world_size']} ranks, expected {world}")
    ips = float(last["images_per_sec"])
    per_rank = [float(v) for v in last["images_per_sec_per_rank"]]
    return {"world_size": world, "images_per_sec": ips, "images_per_sec_per_rank": ips / world,
            "per_rank": per_rank, "measured_epoch_s": float(last["epoch_time_s"]),
            "time_per_epoch_s": n_epoch_images / ips, "epoch_images": n_epoch_images,
            "steps_per_rank": scaling.steps_per_rank, "batch_per_rank": scaling.batch_size,
            "global_batch": scaling.batch_size * world, "epochs": len(history)}


def run_point(pretrain: TrainConfig, scaling: ScalingConfig, *, world: int, manifest: Path, out_dir: Path,
              job_threads: int | None = None, verified: Path | None = None) -> None:
    """One rank of the scaling job for ``world`` ranks; rank 0 writes ``out_dir/throughput.json``.
    ``verified``: the folder of shard verification stamps (chexflow.data.stamps).

    ``job_threads``: the cores of the job on this node, shared evenly by the ranks on this node
    (so world 1 and world 2 on a workstation use the same cores, without oversubscription).
    """
    from chexflow.data.manifest import read_manifest
    from chexflow.train.backends import backend_for
    from chexflow.train.epochs import read_epochs
    from chexflow.train.inputs import TrainData
    from chexflow.train.run import start
    from chexflow.train.trainer import TrainPaths

    cfg = train_config(pretrain, scaling, world)
    out_dir = Path(out_dir)
    paths = TrainPaths(manifest=Path(manifest), out_dir=out_dir, ckpt_dir=out_dir / "checkpoints", verified=verified)
    backend = backend_for(cfg)
    code = 0
    try:
        if backend.size != world:
            raise ScalingError(f"{backend.size} ranks were launched for world size {world} "
                               "(resources.tasks must equal the world wildcard)")
        if job_threads:
            os.environ["OMP_NUM_THREADS"] = str(max(1, job_threads // max(backend.local_size, 1)))
        if backend.is_root:         # a measurement is never resumed from an older run's checkpoint
            shutil.rmtree(paths.ckpt_dir, ignore_errors=True)
        steps = TrainData.build(cfg, paths.manifest, rank=backend.rank, world=backend.size).steps_per_epoch
        if steps != scaling.steps_per_rank:
            raise ScalingError(f"the train split allows only {steps} steps of "
                               f"{scaling.batch_size} per rank on {world} ranks, the study needs "
                               f"{scaling.steps_per_rank}: lower scaling.steps_per_rank or batch_size")
        outcome = start(cfg, paths, backend=backend)
        code = outcome.exit_code
        if outcome.finished and backend.is_root:
            history = read_epochs(out_dir / "metrics.jsonl", "scaling point")
            point = throughput_point(history, world=world, scaling=scaling,
                                     n_epoch_images=epoch_images(pretrain, read_manifest(manifest)))
            point["threads_per_rank"] = int(os.environ.get("OMP_NUM_THREADS", 0)) or None
            point["ranks_per_node"] = backend.local_size
            point["nodes"] = -(-world // max(backend.local_size, 1))
            point["cores_per_node"] = len(os.sched_getaffinity(0))    # the cores the node's ranks share
            write_text_atomic(out_dir / "throughput.json", json.dumps(point, indent=1))
            print(json.dumps(point), flush=True)
    finally:
        backend.shutdown()
    if code:
        sys.exit(code)

def summarize(points: list[dict]) -> pd.DataFrame:
    """One row per world size: speedup and efficiency relative to the smallest world size."""
    if not points:
        raise ScalingError("no scaling points")
    df = pd.DataFrame(points).sort_values("world_size").reset_index(drop=True)
    if df["world_size"].duplicated().any():
        raise ScalingError(f"world sizes measured twice: {sorted(df['world_size'])}")
    for col in PLACEMENT:       # points written before these were recorded
        if col not in df.columns:
            df[col] = None
    base = df.iloc[0]
    df["speedup"] = df["images_per_sec"] / base["images_per_sec"]
    df["ideal_speedup"] = df["world_size"] / base["world_size"]
    df["efficiency"] = df["speedup"] / df["ideal_speedup"]
    return df[COLUMNS]


def plot(df: pd.DataFrame, out_png: Path) -> None:
    """Throughput (measured vs ideal) and scaling efficiency against the world size, as PNG."""
    fig = figure(df)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def figure(df: pd.DataFrame):
    """The matplotlib Figure of :func:`plot`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    w = df["world_size"].to_numpy()
    ax1.plot(w, df["images_per_sec"], "-o", color="#1f6fb4", label="measured")
    ax1.plot(w, df["images_per_sec"].iloc[0] * df["ideal_speedup"], "--", color="#9a9a9a", label="ideal (linear)")
    ax1.set_xticks(w)          # ranks are whole numbers: a tick per measured world size only
    ax1.set_xlabel("ranks (world size)")
    ax1.set_ylabel("images/s (all ranks)")
    ax1.set_title("Pretraining throughput")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax2.bar([str(x) for x in w], df["efficiency"] * 100, color="#2a9d8f")
    ax2.axhline(100, ls="--", color="#9a9a9a")
    ax2.set_xlabel("ranks (world size)")
    ax2.set_ylabel("scaling efficiency (%)")
    ax2.set_title("Efficiency vs the smallest world size")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def read_point(path: Path) -> dict[str, Any]:
    """A world size's throughput.json as :func:`run_point` writes it (a regular file, a JSON object with a
    number for every measured column); anything else is a :class:`ScalingError` naming the file and key."""
    point = read_json(path, ScalingError, what="scaling point", kind="a scaling point")
    for key in MEASURED:
        if isinstance(point.get(key), bool) or not isinstance(point.get(key), (int, float)):
            raise ScalingError(f"{path}: {key} must be a number, got {point.get(key)!r}")
    return point


def write_summary(point_files: list[Path], *, out_csv: Path, out_json: Path, out_png: Path) -> pd.DataFrame:
    points = [read_point(p) for p in point_files]
    df = summarize(points)
    with atomic_path(out_csv) as tmp:
        df.to_csv(tmp, index=False, float_format="%.6g")
    rows: list[dict[str, Any]] = json.loads(df.to_json(orient="records", double_precision=15))
    write_text_atomic(out_json, json.dumps({"rows": rows, "baseline_world_size": int(df["world_size"].iloc[0]),
                                            "scaling": "weak (fixed work per rank)"}, indent=1))
    plot(df, out_png)
    return df
