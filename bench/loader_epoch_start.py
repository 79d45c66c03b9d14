"""What starting the loader costs per epoch: workers forked for each pass (chexflow before) vs forked once
and kept (``make_loader(persistent=True)``, the trainer's loaders now).

Both loaders read the same shards with the same ``ShardStream`` settings; passes alternate between
the two (fresh, kept, fresh, kept, ...) so that the machine's load falls on both alike. A pass is
timed as the trainer times an epoch: from ``iter(loader)`` to the last batch, the fresh loader's
worker shutdown included; the time to its first batch is reported too. Ratios, not seconds, carry
across machines.

    python bench/loader_epoch_start.py --workers 14 --batch 64 --steps 20 --passes 8   # a GPU node's loader
    python bench/loader_epoch_start.py                                                 # this machine's cores
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chexflow.data import loader as data  # noqa: E402
from chexflow.data.manifest import split_shards  # noqa: E402
from chexflow.train import models  # noqa: E402
from train_throughput import write_shards  # noqa: E402


def one_pass(loader, stream, epoch: int, *, fresh: bool) -> tuple[float, float, int]:
    """(seconds for the pass, seconds to its first batch, batches)."""
    stream.set_epoch(epoch)
    t0 = time.perf_counter()
    it = iter(loader)
    first, n = None, 0
    for _ in it:
        if first is None:
            first = time.perf_counter() - t0
        n += 1
    if fresh:
        del it                       # the workers stop here (the trainer's `del batches`)
    return time.perf_counter() - t0, first or 0.0, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=max(1, min(4, len(os.sched_getaffinity(0)))))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="batches per pass (an epoch's steps)")
    p.add_argument("--passes", type=int, default=6, help="passes per loader")
    p.add_argument("--size", type=int, default=256, help="stored image side (px)")
    p.add_argument("--arch", default="resnet50",
                   help="a model built in this process first, as the trainer's is when its workers fork ('none': no model)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    model = None if args.arch == "none" else models.build_model(args.arch, in_channels=1, num_outputs=14)
    with tempfile.TemporaryDirectory() as tmp:
        n = args.steps * args.batch
        manifest = write_shards(Path(tmp), n_train=n, n_val=args.batch, size=args.size,
                                per_shard=max(args.batch, n // max(2 * args.workers, 1)))
        shards = split_shards(manifest, "train")

        def stream():
            return data.ShardStream(shards, rank=0, world=1, seed=0, batch_size=args.batch, shuffle=True,
                                    shuffle_buffer=1000)
        fresh_stream, kept_stream = stream(), stream()
        fresh = data.make_loader(fresh_stream, batch_size=args.batch, workers=args.workers, pin_memory=False)
        kept = data.make_loader(kept_stream, batch_size=args.batch, workers=args.workers, pin_memory=False,
                                persistent=True)
        times = {"fresh": [], "kept": []}
        try:
            for epoch in range(args.passes):
                times["fresh"].append(one_pass(fresh, fresh_stream, epoch, fresh=True))
                times["kept"].append(one_pass(kept, kept_stream, epoch, fresh=False))
        finally:
            data.close_loader(kept)
    batches = {k: {t[2] for t in v} for k, v in times.items()}
    if batches["fresh"] != batches["kept"] or len(batches["kept"]) != 1:
        raise SystemExit(f"the loaders gave different passes: {batches}")
    # the kept loader's first pass forks its workers as the fresh one does every time: medians of the rest
    med = {k: {"pass_s": statistics.median(t[0] for t in v[1:]), "first_batch_s": statistics.median(t[1] for t in v[1:])}
           for k, v in times.items()}
    del model
    out = {"arch": args.arch, "workers": args.workers, "batch": args.batch, "steps": args.steps, "passes": args.passes,
           "size": args.size, "cpus": len(os.sched_getaffinity(0)), "batches_per_pass": batches["kept"].pop(),
           "fresh": med["fresh"], "kept": med["kept"],
           "kept_first_pass_s": times["kept"][0][0],
           "start_saved_per_pass_s": med["fresh"]["pass_s"] - med["kept"]["pass_s"],
           "pass_ratio_fresh_over_kept": med["fresh"]["pass_s"] / med["kept"]["pass_s"]}
    for k in ("fresh", "kept"):
        print(f"{k:5s}: pass {med[k]['pass_s'] * 1e3:8.1f} ms (median of {args.passes - 1}), first batch "
              f"{med[k]['first_batch_s'] * 1e3:7.1f} ms")
    print(f"saved per pass: {out['start_saved_per_pass_s'] * 1e3:.1f} ms; fresh / kept: "
          f"{out['pass_ratio_fresh_over_kept']:.2f}x ({args.workers} workers, batch {args.batch}, {args.steps} steps)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
