"""What making the bytes a step uses the bytes the manifest's sha256 covers costs per sample, for the
two ways of doing it, against the GPU rates of the scale model.

A shard of ``--samples`` 256 px samples in chexflow's format (img.npy, target.npy, meta.json; 69,120
bytes each, as the shard stage writes NIH at 256 px) is read and decoded by ``shard_reader.iter_shard``:

* ``plain``: as before (no proof that the bytes read are the bytes checked);
* ``descriptor``: through one descriptor that must describe the file its check described (fstat when
  opened and after the kept samples are read; the samples held until then): what chexflow does;
* ``hash as read``: the whole shard read and hashed by the reader before its samples are released
  (timed as the plain read plus a sha256 over the file's bytes read through the descriptor).

keeping every sample, and a quarter (a loader worker's share of a shard split among runs: the hash
covers the whole file whatever is kept). Best of ``--repeats``, CPU seconds of this process, from the
page cache. Prints the added time per kept sample and that time x a GPU's images/s: the share of one
core a rank spends on it.

    OMP_NUM_THREADS=1 python bench/verify_as_read.py [--samples 2000] [--repeats 5] [--json FILE]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import io
import json
import platform
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))

from chexflow.data import shard_reader  # noqa: E402
from chexflow.data.stamps import Stamp  # noqa: E402
from scale_clusters import CLUSTERS  # noqa: E402

IMAGE_SIDE = 256


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_shard(path: Path, samples: int) -> str:
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            members = {"img.npy": _npy(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE), dtype=np.uint8)),
                       "target.npy": _npy(np.zeros(14, np.float32)),
                       "meta.json": json.dumps({"patient": f"p{i}", "image": f"i{i}.png"}).encode()}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read(path: Path, keep, checked) -> None:
    for sample in shard_reader.iter_shard(str(path), keep=keep, checked=checked):
        shard_reader.decode(sample)


def _hash_then_read(path: Path, keep, _checked) -> None:
    with open(path, "rb") as fh:
        hashlib.file_digest(fh, "sha256")
    _read(path, keep, None)


def best_seconds(read, path: Path, keep, checked, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        read(path, keep, checked)
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "samples": args.samples,
           "date": time.strftime("%Y-%m-%d"), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.tar"
        digest = write_shard(path, args.samples)
        out["shard_bytes"] = path.stat().st_size
        checked = Stamp.of(os.stat(path), digest, checked_ns=time.time_ns())
        for name, keep in (("every sample", None), ("a quarter", range(0, args.samples, 4))):
            kept = args.samples if keep is None else len(keep)
            plain = best_seconds(_read, path, keep, None, args.repeats)
            case = {"kept": kept, "plain_s": plain}
            for way, read in (("descriptor", _read), ("hash as read", _hash_then_read)):
                seconds = best_seconds(read, path, keep, checked, args.repeats)
                added = (seconds - plain) / kept
                case[way] = {"s": seconds, "added_s_per_sample": added,
                             "core_share": {c.name: added * c.value("gpu_peak_img_s") for c in CLUSTERS}}
            out["cases"][name] = case
    print(f"{out['host']} ({out['cpu']}), a shard of {args.samples} samples, {out['shard_bytes'] / 1e6:.1f} MB, "
          f"best of {args.repeats} (CPU seconds of this process)")
    print("| kept | way | s (plain: read and decoded) | added per kept sample, us | "
          + " | ".join(f"share of a core at {c.name}'s {c.value('gpu_peak_img_s'):,.0f} img/s per GPU" for c in CLUSTERS)
          + " |")
    print("|---|---|---|---|" + "---|" * len(CLUSTERS))
    for name, case in out["cases"].items():
        print(f"| {name} ({case['kept']}) | plain | {case['plain_s']:.3f} | - |" + " - |" * len(CLUSTERS))
        for way in ("descriptor", "hash as read"):
            shares = " | ".join(f"{100 * s:.1f}%" for s in case[way]["core_share"].values())
            print(f"| {name} ({case['kept']}) | {way} | {case[way]['s']:.3f} | "
                  f"{1e6 * case[way]['added_s_per_sample']:.1f} | {shares} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
