"""Images/s per core of the shard stage on release-resolution PNGs vs a plain PIL loop.

N grey PNGs at the NIH release's 1,024 px (smooth random field + gradient + pixel noise, the
generator of ``bench/loader_vs_imagefolder.py``; every ``--rgba-every``-th one stored as RGBA, as a
few NIH images are), in the same run:

* baseline, the plain PIL loop, ``PIL.Image.open`` -> ``convert("L")`` -> ``resize((S, S),
  BILINEAR)`` -> ``numpy.asarray`` (no writing), over the same images read two ways:
  "PIL loop, archive": straight from the release's ``images_001.tar.gz`` (``tarfile.open(...,
  "r:gz")``), the same input bytes as the shard job (the target's reference);
  "PIL loop, PNG files": from the PNGs as files on disk (already extracted: no gunzip);
* chexflow: one per-archive shard job, ``shards.write_part`` on the same PNGs packed as an
  NIH-layout ``images_001.tar.gz`` (``phantoms.release.write_archive``): stream the gzip tar, decode, crop,
  resize to S px, encode raw uint8, write the WebDataset shards and their manifest.

One process, one core (``OMP_NUM_THREADS=1``); one untimed pass each (page cache warm), then
``--repeats`` passes alternating, median counts. "Per core" is images per second of this
process's CPU time (``time.process_time``: on a machine shared with other jobs, wall time also
counts the time other processes held the core); wall-clock rates are printed too. The
full-release estimate divides the 112,120 images of ChestX-ray14 by the shard stage's rate.

    OMP_NUM_THREADS=1 .venv/bin/python bench/shard_stage.py --n 200
"""
from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from PIL import Image  # noqa: E402

from loader_vs_imagefolder import make_png  # noqa: E402

RELEASE_SIDE = 1024


def write_inputs(work: Path, n: int, rgba_every: int, seed: int) -> tuple[list[Path], Path]:
    """The PNGs as files and as an NIH-layout release with one archive; returns (files, raw dir)."""
    from chexflow.data import nih
    from chexflow.data.phantoms.release import write_archive, write_tables
    files_dir, raw = work / "png", work / "raw"
    files_dir.mkdir(parents=True)
    raw.mkdir(parents=True)
    members, rows, files = [], [], []
    for i in range(n):
        data = make_png((i, RELEASE_SIDE, seed))
        if rgba_every and i % rgba_every == 0:
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).convert("RGBA").save(buf, format="PNG")
            data = buf.getvalue()
        name = f"{i // 3:08d}_{i % 3:03d}.png"
        (files_dir / name).write_bytes(data)
        files.append(files_dir / name)
        members.append((name, data))
        rows.append([name, nih.LABELS[i % len(nih.LABELS)], 0, f"{i // 3}", 50, "M", "PA", RELEASE_SIDE,
                     RELEASE_SIDE, 0.143, 0.143])
    write_archive(raw / "images_001.tar.gz", members)
    table = pd.DataFrame(rows, columns=list(nih.CSV_COLUMNS))
    names = table["Image Index"].tolist()
    write_tables(raw, table, names, [])
    return files, raw


def plain_pil(files: list[Path], size: int) -> tuple[int, float, float]:
    """(images, wall s, CPU s) of the plain loop."""
    t0, c0 = time.perf_counter(), time.process_time()
    total = 0
    for path in files:
        with Image.open(path) as img:
            arr = np.asarray(img.convert("L").resize((size, size), Image.Resampling.BILINEAR))
        total += int(arr.shape[0] == size)
    return total, time.perf_counter() - t0, time.process_time() - c0


def plain_pil_archive(archive: Path, size: int) -> tuple[int, float, float]:
    """(images, wall s, CPU s) of the plain loop over the members of the .tar.gz."""
    import tarfile
    t0, c0 = time.perf_counter(), time.process_time()
    total = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            with Image.open(tar.extractfile(member)) as img:
                arr = np.asarray(img.convert("L").resize((size, size), Image.Resampling.BILINEAR))
            total += int(arr.shape[0] == size)
    return total, time.perf_counter() - t0, time.process_time() - c0


def shard_job(raw: Path, splits: Path, out: Path, size: int) -> tuple[int, float, float]:
    """(images, wall s, CPU s) of one shard job (``shards.write_part``)."""
    from chexflow.data.config import ShardConfig
    from chexflow.data import shards
    cfg = ShardConfig(dataset="nih_demo", image_size=size, samples_per_shard=2000, encoding="raw",
                      val_fraction=0.0, max_reject_fraction=0.0)
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    m = shards.write_part("nih_demo", "images_001", raw, splits, out, cfg, n_archives=1)
    return sum(s["count"] for s in m["shards"]), time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="images")
    ap.add_argument("--size", type=int, default=256, help="stored side in px (config shards.nih.image_size)")
    ap.add_argument("--rgba-every", type=int, default=20, help="every k-th PNG is RGBA (0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes of each (median)")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed")
    args = ap.parse_args(argv)
    from chexflow.data.config import ShardConfig
    from chexflow.data import nih, shards

    work = args.workdir or Path(tempfile.mkdtemp(prefix="chexflow-bench-shards-"))
    try:
        t0 = time.perf_counter()
        files, raw = write_inputs(work, args.n, args.rgba_every, seed=0)
        png_mb = sum(p.stat().st_size for p in files) / 1e6
        splits = work / "splits.csv"
        shards.split_dataset("nih_demo", raw, ShardConfig(dataset="nih_demo", val_fraction=0.0), splits)
        print(f"inputs: {args.n} PNGs at {RELEASE_SIDE} px ({png_mb / args.n:.2f} MB each, "
              f"{sum(1 for i in range(args.n) if args.rgba_every and i % args.rgba_every == 0)} RGBA), "
              f"made in {time.perf_counter() - t0:.1f} s, in {work}")
        archive = raw / "images_001.tar.gz"
        passes = {"PIL loop, archive": lambda: plain_pil_archive(archive, args.size),
                  "PIL loop, PNG files": lambda: plain_pil(files, args.size),
                  "shard stage": lambda: shard_job(raw, splits, work / "shards", args.size)}
        for run in passes.values():                                          # warm page cache
            run()
        runs = tuple(passes)
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        wall: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for k, run in passes.items():
                n, dt, dc = run()
                assert n == args.n, (k, n)
                wall[k].append(n / dt)
                cpu[k].append(n / dc)
        med = {k: statistics.median(v) for k, v in cpu.items()}
        medw = {k: statistics.median(v) for k, v in wall.items()}
        print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.1f}; 1 core (OMP_NUM_THREADS="
              f"{os.environ.get('OMP_NUM_THREADS', 'unset')}); {args.size} px out; repeats={args.repeats}")
        for k in runs:
            print(f"{k:19s} median {med[k]:6.1f} images per CPU-second (passes: {', '.join(f'{x:.1f}' for x in cpu[k])}); "
                  f"wall {medw[k]:6.1f} images/s")
        for base in ("PIL loop, archive", "PIL loop, PNG files"):
            ratio = med["shard stage"] / med[base]
            print(f"ratio shard stage / {base} per core: {ratio:.2f}x"
                  + (f" (target >= 0.9x): {'OK' if ratio >= 0.9 else 'MISSED'}" if base.endswith("archive") else "")
                  + f"; wall-clock ratio {medw['shard stage'] / medw[base]:.2f}x")
        full = nih.PUBLISHED.n_images
        print(f"full release: {full:,} images / {med['shard stage']:.1f} images per core-second = "
              f"{full / med['shard stage'] / 3600:.2f} core-hours for the shard stage "
              f"(12 jobs of ~{full / 12 / med['shard stage'] / 60:.0f} min on one core each)")
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
