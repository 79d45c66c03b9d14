"""What bench/scale_model.py's model takes from this machine (``scale_model.py --measure``):

* per-rank bytes read before the first step, and seconds from launch to that step, at world 1, 2 and 4
  (real ranks through ``chexflow launch``, DDP, bench/first_step.py), for a fresh start and for a requeue
  that resumes from the checkpoint, on a phantom dataset made by the real chain;
* sha256 over a shard, MB/s on one core (what hashing costs where the file system is not the bound);
* the size and write time of a ResNet-50 checkpoint (weights and SGD momentum, chexflow's format);
* the shard stage at NIH's 1,024 px -> 256 px (phantom PNGs, one process): images per core-second,
  and the bytes of one 256 px sample in a raw shard;
* evaluation (``chexflow.evaluate.run.predict``) images per second from those shards;
* the parameters of ResNet-50 and DenseNet-121 (bytes allreduced per step).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))


def rank_cfg(steps: int) -> dict:
    """The ranks' settings: a CPU run with the GPU path's branches, as tests/test_distributed.py."""
    return {"stage": "pretrain", "dataset": "nih_demo", "backend": "ddp", "epochs": 1, "batch_size": 8, "seed": 0,
            "init": "random", "model": {"arch": "resnet18", "in_channels": 1}, "max_steps": steps,
            "ddp": {"process_group": "cpu:gloo,cuda:gloo", "timeout_s": 600},
            "data": {"crop": 32, "workers": 0}, "optim": {"name": "sgd", "lr": 0.01, "reference_batch": 8},
            "checkpoint": {"every_steps": 0, "keep": 2}}


def first_steps(manifest: Path, work: Path, world: int) -> dict:
    """Fresh start then requeue at ``world`` ranks: per-rank bytes and seconds to the first step."""
    out = {}
    for tag, steps in (("fresh", 1), ("requeue", 2)):
        t0 = time.time()
        cmd = [sys.executable, "-m", "chexflow", "launch", "--backend", "ddp", "-n", str(world), "--", sys.executable,
               str(REPO / "bench/first_step.py"), "--config-json", json.dumps(rank_cfg(steps)), "--manifest",
               str(manifest), "--out-dir", str(work / "out"), "--ckpt-dir", str(work / "ckpt"),
               "--verified", str(work / "verified"), "--record", str(work / tag)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPO / 'workflow'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise SystemExit(f"world {world} {tag}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        recs = [json.loads((work / tag / f"rank{r}.json").read_text()) for r in range(world)]
        out[tag] = {"bytes": [r["trainer"] for r in recs], "fit_bytes": [r["fit"] for r in recs],
                    "seconds": max(r["first_step_at"] for r in recs) - t0}
    return out


def sha256_MBps(path: Path, repeats: int = 5) -> float:
    data = path.read_bytes()
    best = min(_timed(lambda: hashlib.sha256(data).digest()) for _ in range(repeats))
    return len(data) / best / 1e6


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def checkpoint_cost(root: Path) -> dict:
    """Size and write time of a ResNet-50 checkpoint as the trainer writes it (weights + SGD momentum)."""
    import torch
    from chexflow.train import checkpoint as ckpt
    from chexflow.train.models import build_model
    model = build_model("resnet50", in_channels=1, num_outputs=1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, 1, 32, 32)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "run_id": "0" * 16, "step": 1}
    seconds = min(_timed(lambda: ckpt.save_checkpoint(root, 1, state, keep=1)) for _ in range(3))
    size = sum(p.stat().st_size for p in ckpt.list_checkpoints(root))
    return {"bytes": size, "write_s_local": seconds}


def parameters() -> dict:
    from chexflow.train.models import build_model
    return {arch: sum(p.numel() for p in build_model(arch, in_channels=1, num_outputs=1000).parameters())
            for arch in ("resnet50", "densenet121")}


def shard_stage(root: Path, n_images: int) -> dict:
    """NIH's 1,024 -> 256 px through the real chain (phantom PNGs at 1,024 px), one process."""
    from chexflow.data import download, registry, shards, sources
    from chexflow.data.config import ShardConfig
    from chexflow.data.phantoms.release import make_release
    make_release(root / "release", n_images=n_images, image_size=1024, images_per_archive=n_images,
                 test_fraction=0.2, seed=11)
    src = registry.get_source("nih_demo", n_archives=1)
    for name in sources.file_names(src):
        download.fetch_source_file(src, name, root / "raw", str(root / "release"), progress=False)
    cfg = ShardConfig(dataset="nih_demo", image_size=256, samples_per_shard=50, val_fraction=0.2,
                      max_reject_fraction=0.0)
    shards.split_dataset("nih_demo", root / "raw", cfg, root / "shards" / "splits.csv")
    cpu = time.process_time()
    m = shards.write_part("nih_demo", "images_001", root / "raw", root / "shards" / "splits.csv",
                          root / "shards" / "parts" / "images_001", cfg, n_archives=1)
    cpu = time.process_time() - cpu
    count = sum(s["count"] for s in m["shards"])
    size = sum((root / "shards" / "parts" / "images_001" / s["file"]).stat().st_size for s in m["shards"])
    shards.gather("nih_demo", [root / "shards/parts/images_001/manifest.json"], root / "shards/manifest.json", cfg)
    return {"images": count, "img_per_core_s": count / cpu, "bytes_per_image_256": size / count,
            "manifest": str(root / "shards/manifest.json")}


def evaluation_rate(manifest: Path) -> float:
    import torch
    from chexflow.data import manifest as loader
    from chexflow.evaluate.run import predict
    from chexflow.train.models import build_model
    net = build_model("resnet50", in_channels=1, num_outputs=14)
    shards = loader.split_shards(manifest, "train")
    n = sum(s.count for s in shards)
    return n / _timed(lambda: predict(net, shards, crop=224, batch_size=16, device=torch.device("cpu")))


def measure(n_images: int, n_1024: int) -> dict:
    import torch
    from shard_verify import demo_dataset
    out = {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
           "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "device": "cuda" if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("shard stage at 1,024 -> 256 px ...", flush=True)
        stage = shard_stage(tmp / "nih1024", n_1024)
        out["shard_stage"] = {k: v for k, v in stage.items() if k != "manifest"}
        print("evaluation ...", flush=True)
        out["eval_img_s_resnet50_224"] = evaluation_rate(Path(stage["manifest"]))
        print("checkpoint ...", flush=True)
        out["checkpoint_resnet50"] = checkpoint_cost(tmp / "ckpt")
        out["parameters"] = parameters()
        manifest = demo_dataset(tmp / "demo", n_images)
        from chexflow.data import manifest as loader
        refs = loader.split_shards(manifest, "train") + loader.split_shards(manifest, "val")
        out["split_bytes"] = sum(Path(r.path).stat().st_size for r in refs)
        out["split_shards"] = len(refs)
        out["manifest_bytes"] = manifest.stat().st_size
        out["sha256_MBps_core"] = sha256_MBps(Path(refs[0].path))
        out["first_step"] = {}
        for world in (1, 2, 4):
            print(f"first step at world {world} ...", flush=True)
            out["first_step"][str(world)] = first_steps(manifest, tmp / f"w{world}", world)
            shutil.rmtree(tmp / f"w{world}")
    return out
