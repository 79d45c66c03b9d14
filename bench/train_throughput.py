"""Images/s of chexflow's full training path against a bare torchvision loop, in one process.

Three measurements, same model, same per-rank batch, same device, same process:

* ``bare``   -- the reference: a torchvision model (with chexflow's grey stem and 14-way head)
               trained on one GPU-resident synthetic batch: no data loading, no framework;
* ``full``   -- chexflow's Trainer for real: WebDataset shards on disk -> streaming loader (CPU
               workers) -> pinned host->device copy -> augmentation on the device -> step through the
               configured backend (Horovod's DistributedOptimizer with ``--backend horovod``, one rank);
               images/s from the trainer's own per-epoch metrics (the last epoch, after warm-up);
* ``loader`` -- the shard loader alone (decode + collate + device copy), samples/s.

Prints ``full / bare`` (target >= 0.95) and ``loader / full`` (target >= 1.5).

    python bench/train_throughput.py --arch resnet50 --crop 224 --stored 256 --batch 256 --workers 14
    python bench/train_throughput.py --arch densenet121 ...      # add --compile for torch.compile

On a CPU-only machine it runs too (small defaults: resnet18, 32 px), which checks the script,
not the GPU targets.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import webdataset as wds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from chexflow.settings import from_dict  # noqa: E402
from chexflow.train.config import TrainConfig  # noqa: E402
from chexflow.data import loader as data  # noqa: E402
from chexflow.data.manifest import split_shards  # noqa: E402
from chexflow.fsutil import sha256_file, write_text_atomic  # noqa: E402
from chexflow.train import models  # noqa: E402
from chexflow.train.trainer import TrainPaths, Trainer  # noqa: E402
from chexflow.train.backends import backend_for  # noqa: E402

N_LABELS = 14


def write_shards(root: Path, *, n_train: int, n_val: int, size: int, per_shard: int) -> Path:
    """Random grey images with multi-label targets, written as chexflow raw-uint8 shards + manifest."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", n_train), ("val", n_val)):
        shards, positives = [], np.zeros(N_LABELS, np.int64)
        for first in range(0, n, per_shard):
            path = root / f"{split}-{first // per_shard:05d}.tar"
            count = min(per_shard, n - first)
            with wds.TarWriter(str(path), encoder=False) as sink:
                for i in range(first, first + count):
                    img, tgt = io.BytesIO(), io.BytesIO()
                    np.save(img, rng.integers(0, 256, (size, size), dtype=np.uint8), allow_pickle=False)
                    target = (rng.random(N_LABELS) < 0.1).astype(np.float32)
                    positives += target.astype(np.int64)
                    np.save(tgt, target, allow_pickle=False)
                    sink.write({"__key__": f"{split}{i:08d}", "img.npy": img.getvalue(),
                                "target.npy": tgt.getvalue(),
                                "meta.json": json.dumps({"image": f"{split}{i}.png", "patient": str(i)}).encode()})
            shards.append({"path": path.name, "count": count, "sha256": sha256_file(path)})
        # one patient per image; label counts as the shard stage writes them (the run id reads both)
        splits[split] = {"n_images": n, "n_patients": n, "shards": shards,
                         "label_counts": {f"label{i}": int(c) for i, c in enumerate(positives)}}
    manifest = {"dataset": "bench", "title": "random bench images", "synthetic": True, "task": "multilabel",
                "labels": [f"label{i}" for i in range(N_LABELS)], "image_size": size, "encoding": "raw",
                "splits": splits, "n_rejects": 0}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root / "manifest.json"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_loop(cfg: TrainConfig, device: torch.device, steps: int, warmup: int) -> float:
    model = models.build_model(cfg.model.arch, in_channels=1, num_outputs=N_LABELS).to(device)
    bf16 = device.type == "cuda"
    if bf16:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(cfg.batch_size, 1, cfg.data.crop, cfg.data.crop, device=device)
    if bf16:
        x = x.contiguous(memory_format=torch.channels_last)
    y = (torch.rand(cfg.batch_size, N_LABELS, device=device) < 0.1).float()
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).float(), y)
        loss.backward()
        opt.step()
    sync(device)
    return steps * cfg.batch_size / (time.perf_counter() - t0)


def full_path(cfg: TrainConfig, manifest: Path, work: Path) -> float:
    backend = backend_for(cfg)
    try:
        code = Trainer(cfg, TrainPaths(manifest=manifest, out_dir=work / "out", ckpt_dir=work / "ckpt"),
                       backend).fit()
    finally:
        backend.shutdown()
    if code:
        raise SystemExit(f"training failed with exit code {code}")
    rows = [json.loads(line) for line in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["images_per_sec"]


def loader_alone(cfg: TrainConfig, manifest: Path, device: torch.device, batches: int) -> float:
    stream = data.ShardStream(split_shards(manifest, "train"), rank=0, world=1, seed=0,
                              batch_size=cfg.batch_size, shuffle=True, shuffle_buffer=cfg.data.shuffle_buffer)
    loader = data.make_loader(stream, batch_size=cfg.batch_size, workers=cfg.data.workers,
                              pin_memory=device.type == "cuda")
    it, n = iter(loader), 0
    next(it)                                    # workers started, first shard open
    t0 = time.perf_counter()
    for _, (images, _, _) in zip(range(batches), it):
        images.to(device, non_blocking=True)
        n += images.shape[0]
    sync(device)
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="resnet50" if gpu else "resnet18")
    p.add_argument("--crop", type=int, default=224 if gpu else 32, help="training crop (px)")
    p.add_argument("--stored", type=int, default=256 if gpu else 40, help="stored shard image side (px)")
    p.add_argument("--batch", type=int, default=256 if gpu else 32, help="per-rank batch")
    p.add_argument("--steps", type=int, default=60 if gpu else 15, help="timed steps per epoch")
    p.add_argument("--warmup", type=int, default=15 if gpu else 3, help="untimed steps (bare loop)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--backend", default="horovod", choices=["horovod", "single"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--dir", type=Path, default=None, help="where to write the shards (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the result to this JSON file")
    args = p.parse_args(argv)

    device = torch.device("cuda" if gpu else "cpu")
    cfg = from_dict(TrainConfig, {
        "stage": "pretrain", "dataset": "bench", "backend": args.backend, "epochs": 2, "batch_size": args.batch,
        "compile": args.compile, "checkpoint": {"every_steps": 0, "keep": 1},
        "model": {"arch": args.arch, "in_channels": 1},
        "data": {"crop": args.crop, "workers": args.workers, "shuffle_buffer": 256,
                 "samples_per_epoch": args.steps * args.batch},
        "schedule": {"warmup_epochs": 0.0, "decay": "none"}})
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        manifest = write_shards(root, n_train=(args.steps + 2) * args.batch, n_val=args.batch,
                                size=args.stored, per_shard=max(args.batch * 2, 256))
        print(f"shards: {(args.steps + 2) * args.batch} train images at {args.stored} px written in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        bare = bare_loop(cfg, device, args.steps, args.warmup)
        print(f"bare loop      : {bare:10.1f} img/s", flush=True)
        full = full_path(cfg, manifest, root / "run")
        print(f"chexflow full  : {full:10.1f} img/s  ({args.backend})", flush=True)
        load = loader_alone(cfg, manifest, device, args.steps)
        print(f"loader alone   : {load:10.1f} img/s  ({args.workers} workers)", flush=True)
    name = torch.cuda.get_device_name() if gpu else f"CPU ({len(os.sched_getaffinity(0))} cores)"
    try:
        import horovod
        hvd_version = horovod.__version__
    except ImportError:
        hvd_version = None
    result = {"device": name, "torch": torch.__version__, "horovod": hvd_version, "arch": args.arch,
              "crop": args.crop, "batch": args.batch, "precision": "bf16" if gpu else "fp32",
              "channels_last": gpu, "compile": args.compile, "backend": args.backend, "workers": args.workers,
              "bare_img_s": round(bare, 1), "full_img_s": round(full, 1), "loader_img_s": round(load, 1),
              "full_over_bare": round(full / bare, 3), "loader_over_full": round(load / full, 3),
              "targets": {"full_over_bare": 0.95, "loader_over_full": 1.5}}
    print(json.dumps(result))
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=1) + "\n")

if __name__ == "__main__":
    main()
