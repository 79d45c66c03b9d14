"""Samples/s per core: chexflow's shard loader vs a torchvision ImageFolder of PNGs.

Both read the same N grey images (smooth random fields plus noise, ``--size`` px, PNG) from the
same disk in the same run:

* baseline: ``DataLoader(ImageFolder(root, transform=ToTensor(), loader=PIL "L"), shuffle=True)``,
  i.e. one PNG file per sample, decoded by PIL in the workers;
* chexflow: the same PNGs packed as an NIH-layout release (``images_NNN.tar.gz`` + label CSV +
  split lists) and run through the project's own shard stage (``shards.split_dataset``,
  ``write_part``, ``gather``: raw uint8 WebDataset shards), then read with ``ShardStream`` +
  ``make_loader`` exactly as the trainer builds them.

Same batch size and number of loader worker processes for both; each is read once untimed (page
cache warm for both) and then ``--repeats`` times, alternating; the median pass counts. "Per core"
divides by the number of worker processes (the cores doing the decoding).

    OMP_NUM_THREADS=1 .venv/bin/python bench/loader_vs_imagefolder.py            # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402


def make_png(args: tuple[int, int, int]) -> bytes:
    """Image ``i``: a smooth random field, a vertical gradient and pixel noise (radiograph-like
    statistics for PNG), encoded as an 8-bit grey PNG at PIL's default compression."""
    i, size, seed = args
    rng = np.random.default_rng([seed, i])
    coarse = Image.fromarray(rng.integers(40, 200, (12, 12), dtype=np.uint8))
    field = np.asarray(coarse.resize((size, size), Image.Resampling.BICUBIC), dtype=np.int16)
    ramp = np.linspace(0, 60, size).astype(np.int16)[:, None]
    img = np.clip(field + ramp + rng.integers(-8, 9, (size, size), dtype=np.int16), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def write_inputs(work: Path, n: int, size: int, per_archive: int, seed: int) -> tuple[Path, Path]:
    """ImageFolder tree and an NIH-layout release of the same PNGs; returns (imagefolder, raw dir)."""
    from chexflow.data import nih
    folder, raw = work / "imagefolder", work / "raw"
    rows, names = [], []
    archives: dict[int, list[tuple[str, bytes]]] = {}
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        pngs = pool.map(make_png, [(i, size, seed) for i in range(n)], chunksize=50)
    for i, data in enumerate(pngs):
        name = f"{i // 3:08d}_{i % 3:03d}.png"        # 3 images per "patient"
        label = nih.LABELS[i % len(nih.LABELS)]
        (folder / label).mkdir(parents=True, exist_ok=True)
        (folder / label / name).write_bytes(data)
        archives.setdefault(i // per_archive, []).append((name, data))
        rows.append(f"{name},{label},0,{i // 3},50,M,PA,{size},{size},0.14,0.14\n")
        names.append(name)
    raw.mkdir(parents=True, exist_ok=True)
    for k, members in archives.items():
        with tarfile.open(raw / f"images_{k + 1:03d}.tar.gz", "w:gz", compresslevel=1) as tar:
            for name, data in members:
                info = tarfile.TarInfo(f"images/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    header = ("Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
              "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]\n")
    (raw / "Data_Entry_2017_v2020.csv").write_text(header + "".join(rows))
    (raw / "train_val_list.txt").write_text("\n".join(names) + "\n")
    (raw / "test_list.txt").write_text("")
    return folder, raw


def write_shards(raw: Path, out: Path, size: int, samples_per_shard: int, n_archives: int) -> Path:
    from chexflow.data.config import ShardConfig
    from chexflow.data import shards
    cfg = ShardConfig(dataset="nih_demo", image_size=size, samples_per_shard=samples_per_shard,
                      encoding="raw", val_fraction=0.0, max_reject_fraction=0.0)
    return shards.build_dataset("nih_demo", raw, out, cfg, n_archives=n_archives)


def grey_loader(path: str) -> Image.Image:
    with open(path, "rb") as fh:
        img = Image.open(fh)
        return img.convert("L")


def imagefolder_pass(folder: Path, batch: int, workers: int, epoch: int) -> tuple[int, float]:
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms
    ds = datasets.ImageFolder(str(folder), transform=transforms.ToTensor(), loader=grey_loader)
    dl = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                    generator=torch.Generator().manual_seed(epoch),
                    prefetch_factor=4 if workers > 0 else None)
    t0 = time.perf_counter()
    n = sum(x.shape[0] for x, _ in dl)
    return n, time.perf_counter() - t0


def shard_pass(manifest: Path, batch: int, workers: int, epoch: int, shuffle_buffer: int) -> tuple[int, float]:
    from chexflow.data import loader as L
    from chexflow.data.manifest import split_shards
    shards = split_shards(manifest, "train")
    stream = L.ShardStream(shards, rank=0, world=1, seed=0, batch_size=batch, epoch=epoch, shuffle=True,
                           shuffle_buffer=shuffle_buffer)
    dl = L.make_loader(stream, batch_size=batch, workers=workers, pin_memory=False)
    t0 = time.perf_counter()
    n = sum(x.shape[0] for x, _, _ in dl)
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="images")
    ap.add_argument("--size", type=int, default=256, help="side in px")
    ap.add_argument("--workers", type=int, default=1, help="loader worker processes (both loaders)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per loader (median)")
    ap.add_argument("--samples-per-shard", type=int, default=500)
    ap.add_argument("--shuffle-buffer", type=int, default=1000)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="chexflow-bench-loader-"))
    try:
        t0 = time.perf_counter()
        per_archive = 1000
        folder, raw = write_inputs(work, args.n, args.size, per_archive, seed=0)
        t1 = time.perf_counter()
        manifest = write_shards(raw, work / "shards", args.size, args.samples_per_shard,
                                -(-args.n // per_archive))
        t2 = time.perf_counter()
        png_mb = sum(p.stat().st_size for p in folder.rglob("*.png")) / 1e6
        shard_mb = sum(p.stat().st_size for p in (work / "shards").rglob("*.tar")) / 1e6
        print(f"inputs: {args.n} images {args.size}px, PNG {png_mb:.0f} MB ({t1 - t0:.1f} s), "
              f"shards {shard_mb:.0f} MB ({t2 - t1:.1f} s) in {work}")

        imagefolder_pass(folder, args.batch, args.workers, epoch=99)           # warm page cache
        shard_pass(manifest, args.batch, args.workers, 99, args.shuffle_buffer)
        rates = {"imagefolder": [], "shards": []}
        for r in range(args.repeats):
            n, dt = imagefolder_pass(folder, args.batch, args.workers, epoch=r)
            assert n == args.n, n
            rates["imagefolder"].append(n / dt)
            n, dt = shard_pass(manifest, args.batch, args.workers, r, args.shuffle_buffer)
            assert n == args.n // args.batch * args.batch, n      # a training epoch: full batches only
            rates["shards"].append(n / dt)
        cores = max(args.workers, 1)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores; workers={args.workers} batch={args.batch} repeats={args.repeats}")
        for k, v in rates.items():
            print(f"{k:12s} median {med[k]:8.0f} samples/s = {med[k] / cores:8.0f} samples/s per core "
                  f"(passes: {', '.join(f'{x:.0f}' for x in v)})")
        ratio = med["shards"] / med["imagefolder"]
        print(f"ratio shards / imagefolder: {ratio:.1f}x (target >= 3x): {'OK' if ratio >= 3 else 'MISSED'}")
        return 0
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
