"""The cost of checking every shard against its manifest's sha256, as a share of a demo epoch on CPU.

The default demo's fine-tuning data is made by the real chain (phantom release at ``demo_release``'s
settings -> verified download from the release folder -> split -> shards -> manifest, the demo's
``shards.nih_demo`` settings), then, alternating, in this one process:

* ``baseline`` -- one training epoch as the demo's fine-tuning runs it (ShardStream of the train split
  -> make_loader -> gpu_augment -> ResNet-18 forward/backward -> Adam step, batch 32, crop 32, CPU),
  every shard already checked (what the epochs after the first cost);
* ``checked``  -- the same epoch from a process that has checked nothing yet: the train and val
  shards are hashed (as a training run does once, when it builds its streams), then the epoch.

Prints the medians and the fastest of each (the fastest is the least disturbed on a shared machine),
``checked / baseline`` for both, and the hashing alone as a share of the median epoch (target: at
most 5%).

    OMP_NUM_THREADS=1 python bench/shard_verify.py [--n-images 3000] [--repeats 3] [--workers 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from chexflow.data import augment, download, loader, manifest, registry, shards, sources  # noqa: E402
from chexflow.data.config import AugmentConfig, ShardConfig  # noqa: E402
from chexflow.data.phantoms.release import make_release  # noqa: E402
from chexflow.train.models import build_model  # noqa: E402


def demo_dataset(root: Path, n_images: int | None) -> Path:
    """The demo's fine-tuning shards at its settings (config.yaml); returns the manifest."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    rel = dict(cfg["demo_release"])
    if n_images:
        rel["n_images"] = n_images
    make_release(root / "release", n_images=rel["n_images"], image_size=rel["image_size"],
                 images_per_archive=rel["images_per_archive"], test_fraction=rel["test_fraction"], seed=rel["seed"])
    n_archives = -(-rel["n_images"] // rel["images_per_archive"])
    src = registry.get_source("nih_demo", n_archives=n_archives)
    for name in sources.file_names(src):
        download.fetch_source_file(src, name, root / "raw", str(root / "release"), progress=False)
    s = cfg["shards"]["nih_demo"]
    shard_cfg = ShardConfig(dataset="nih_demo", image_size=s["image_size"], samples_per_shard=s["samples_per_shard"],
                            val_fraction=s["val_fraction"], max_reject_fraction=s["max_reject_fraction"])
    return shards.build_dataset("nih_demo", root / "raw", root / "shards", shard_cfg, n_archives=n_archives)


def epoch(path: Path, *, batch: int, crop: int, workers: int) -> int:
    """One demo fine-tuning epoch on CPU (streams built here: their shards are checked here)."""
    stream = loader.ShardStream(manifest.split_shards(path, "train"), rank=0, world=1, seed=0, batch_size=batch,
                                shuffle=True, shuffle_buffer=1000)
    loader.ShardStream(manifest.split_shards(path, "val"), rank=0, world=1, seed=0, batch_size=batch, shuffle=False)
    torch.manual_seed(0)
    model = build_model("resnet18", in_channels=1, num_outputs=14)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    n = 0
    for x, y, _ in loader.make_loader(stream, batch_size=batch, workers=workers, pin_memory=False):
        z = augment.gpu_augment(x, out_size=crop, train=True, cfg=AugmentConfig(), generator=gen)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(z), torch.nan_to_num(y, 0.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        n += len(x)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-images", type=int, default=None, help="the release's size (default: config.yaml's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--crop", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = demo_dataset(Path(tmp), args.n_images)
        refs = manifest.split_shards(path, "train") + manifest.split_shards(path, "val")
        size = sum(Path(r.path).stat().st_size for r in refs)
        print(f"dataset: {sum(r.count for r in refs)} train+val images in {len(refs)} shards, {size / 2**20:.1f} MiB "
              f"({time.perf_counter() - t:.0f} s to build)", flush=True)
        base, checked, hashing = [], [], []
        for _ in range(args.repeats):
            manifest.verify_shards(refs)             # checked already: the baseline's epochs
            t = time.perf_counter()
            n = epoch(path, batch=args.batch, crop=args.crop, workers=args.workers)
            base.append(time.perf_counter() - t)
            manifest.forget_verified()
            t = time.perf_counter()
            manifest.verify_shards(refs)
            hashing.append(time.perf_counter() - t)
            manifest.forget_verified()
            t = time.perf_counter()
            epoch(path, batch=args.batch, crop=args.crop, workers=args.workers)
            checked.append(time.perf_counter() - t)
            print(f"  baseline {base[-1]:.2f} s, checked {checked[-1]:.2f} s, hashing alone {hashing[-1] * 1e3:.1f} ms "
                  f"({n} images)", flush=True)
    b, c, h = statistics.median(base), statistics.median(checked), statistics.median(hashing)
    print(f"median epoch: baseline {b:.2f} s, checked {c:.2f} s: checked / baseline = {c / b:.3f}")
    print(f"fastest epoch: baseline {min(base):.2f} s, checked {min(checked):.2f} s: checked / baseline = "
          f"{min(checked) / min(base):.3f}")
    print(f"hashing every train+val shard: {h * 1e3:.1f} ms = {100 * h / b:.2f}% of a demo epoch "
          f"({size / 2**20 / h:.0f} MiB/s); target <= 5%: {'met' if h / b <= 0.05 else 'MISSED'}")


if __name__ == "__main__":
    main()
