"""What a start, an epoch, a checkpoint and a requeue cost at 1, 8, 64 and 800 GPUs: a model on paper,
fed by what chexflow measures here and by figures whose source it names.

``--measure`` runs chexflow on this machine and writes what it found to a JSON file:

* per-rank bytes read before the first step, and seconds from launch to that step, at world 1, 2
  and 4 (real ranks through ``chexflow launch``, DDP, bench/first_step.py), for a fresh start and
  for a requeue that resumes from the checkpoint, on a phantom dataset made by the real chain;
* sha256 over a shard, MB/s on one core (what hashing costs where the file system is not the bound);
* the size and write time of a ResNet-50 checkpoint (weights and SGD momentum, chexflow's format);
* the shard stage at NIH's 1,024 px -> 256 px (phantom PNGs, one process): images per core-second,
  and the bytes of one 256 px sample in a raw shard;
* evaluation (``chexflow.evaluate.run.predict``) images per second from those shards;
* the parameters of ResNet-50 and DenseNet-121 (bytes allreduced per step, from the settings).

The model (``--inputs FILE``, without ``--measure``: a JSON an earlier run wrote) then gives, for
NIH ChestX-ray14 at 256 px and ImageNet at 256 px, ResNet-50, per-GPU batch 256: time to the first
step (fresh start and requeue; and what the per-process hashing chexflow did before cost), node-local
staging, one epoch and which resource bounds it (GPU, shared file system, network, loader), the
checkpoint overhead at ``training.checkpoint.every_steps`` and the cost of one requeue. Every
constant is printed with its kind: ``measured`` (here, or on an H200 with chexflow), ``reference``
(../shared/reference, H100), ``published`` (the source named) or ``modelled`` (from those).

    OMP_NUM_THREADS=1 python bench/scale_model.py --measure --json bench/results/scale-inputs-<host>.json
    python bench/scale_model.py --inputs bench/results/scale-inputs-<host>.json      # the tables again
    python bench/scale_model.py --gpu-inputs       # what a GPU cluster session must measure to confirm it
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    kind: str       # measured | reference | published | modelled
    source: str


# ---------------------------------------------------------------------------------------- constants
GB = 1e9
JUWELS = "apps.fz-juelich.de/jsc/hps/juwels/booster-overview.html"
NCCL_TUNING = "NVIDIA/nccl src/graph/tuning.cc (the tuner's own cost model)"
CONSTANTS = {
    "gpu_img_s": Figure(3970, "img/s per GPU", "reference", "ResNet-50, bf16, batch 256, 224 px, channels_last, "
                        "H100 (../shared/reference/h100_bare_loop_2026-11-22.json: 3971.3)"),
    "gpu_img_s_h200_chexflow": Figure(4126, "img/s per GPU", "measured (H200)", "chexflow's full training path, "
                                      "ResNet-50 as above (bench/results/throughput-resnet50-20261128-h200.json)"),
    "loader_img_s_node": Figure(33680, "img/s per node", "measured (H200)", "chexflow's loader alone on raw 256 px "
                                "shards, 14 workers on 16 cores (same file, loader_img_s)"),
    "png_decode_img_s_node": Figure(7633, "img/s per 16 cores", "reference", "PNG 41.7 kB, torchvision, 16 "
                                    "processes (../shared/reference/h100_decode_2026-11-22.json)"),
    "gpus_per_node": Figure(4, "GPUs", "published", f"JUWELS Booster: 4 A100 per node ({JUWELS})"),
    "link_GBps": Figure(25, "GB/s per GPU", "published", f"one HDR200 InfiniBand adapter (200 Gbit/s) per GPU ({JUWELS})"),
    "nvlink_GBps": Figure(300, "GB/s per GPU", "published", "NVLink 3 (A100): 600 GB/s bidirectional, 300 per "
                          "direction (NVIDIA A100 datasheet)"),
    "fs_aggregate_GBps": Figure(500, "GB/s", "published", "a Lustre scratch file system's peak: RWTH CLAIX $HPCWORK, "
                                "500 GB/s read/write (www.hpc.itc.rwth-aachen.de/go/id/bcepsh/lidx/1); a job "
                                "shares it with every other job, so this is a best case"),
    "fs_node_GBps": Figure(25, "GB/s per node", "published", "a node's link to the shared file system: JUPITER, 200 "
                           "Gbit/s per node to JUST (apps.fz-juelich.de/jsc/hps/jupiter/configuration.html)"),
    "nccl_base_lat_us": Figure(8.4, "us", "published", f"ring/Simple base latency, {NCCL_TUNING}"),
    "nccl_ring_lat_us": Figure(9.6, "us per inter-node step", "published", f"NET ring/Simple, {NCCL_TUNING}"),
    "nccl_ring_nvl_us": Figure(3.4, "us per intra-node step", "published", f"NVLink ring/Simple, {NCCL_TUNING}"),
    "nccl_tree_lat_us": Figure(50, "us per tree level", "published", f"NET tree/Simple, {NCCL_TUNING}"),
    "nccl_tree_nvl_us": Figure(28, "us per intra-node hop", "published", f"NVLink tree/Simple, {NCCL_TUNING}"),
    "train_over_forward": Figure(3, "x", "published", "a training step costs about 3 forward passes (6N vs 2N FLOPs "
                                 "per sample: Kaplan et al. 2020, Scaling Laws for Neural Language Models)"),
    "every_steps": Figure(50, "steps", "measured", "config.yaml training.checkpoint.every_steps (a setting)"),
    "ddp_bucket_MB": Figure(25, "MB", "published", "torch DDP bucket_cap_mb default (torch.nn.parallel docs)"),
}
DATASETS = {   # images of the splits a run reads (train + val) and evaluates (test); published counts
    "NIH 1024->256 px": {"train": 77_872, "val": 8_652, "test": 25_596,
                         "source": "ChestX-ray14 (Wang et al. 2017): train_val_list 86,524 less "
                                   "shards.nih.val_fraction 0.1; test_list 25,596"},
    "ImageNet 256 px": {"train": 1_281_167, "val": 50_000, "test": 0,
                        "source": "ILSVRC-2012 (Russakovsky et al. 2015)"},
}
GPUS = (1, 8, 64, 800)
BATCH = 256     # per GPU (the reference figure's batch)


# ---------------------------------------------------------------------------------------- measuring

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


def measure(args) -> dict:
    import torch
    from shard_verify import demo_dataset
    out = {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
           "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "device": "cuda" if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("shard stage at 1,024 -> 256 px ...", flush=True)
        stage = shard_stage(tmp / "nih1024", args.n_1024)
        out["shard_stage"] = {k: v for k, v in stage.items() if k != "manifest"}
        print("evaluation ...", flush=True)
        out["eval_img_s_resnet50_224"] = evaluation_rate(Path(stage["manifest"]))
        print("checkpoint ...", flush=True)
        out["checkpoint_resnet50"] = checkpoint_cost(tmp / "ckpt")
        out["parameters"] = parameters()
        manifest = demo_dataset(tmp / "demo", args.n_images)
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


# ---------------------------------------------------------------------------------------- the model

def c(name: str) -> float:
    return CONSTANTS[name].value


def nodes(gpus: int) -> int:
    return -(-gpus // int(c("gpus_per_node")))


def allreduce_s(nbytes: float, gpus: int) -> float:
    """One allreduce of ``nbytes`` over ``gpus`` GPUs as NCCL's tuner models it (Simple protocol; the
    faster of ring and tree): latency + bytes / algorithm bandwidth."""
    if gpus == 1:
        return 0.0
    n_nodes, per_node = nodes(gpus), min(gpus, int(c("gpus_per_node")))
    steps, inter = 2 * (gpus - 1), 2 * (n_nodes - 1)
    bus = c("nvlink_GBps") if n_nodes == 1 else c("link_GBps")
    ring_lat = c("nccl_base_lat_us") + (steps - inter) * c("nccl_ring_nvl_us") + inter * c("nccl_ring_lat_us")
    if n_nodes > 1:
        ring_lat *= 1.9                             # the tuner's "plateau effect of ring" for large allreduces
    ring = ring_lat * 1e-6 + nbytes / (bus * GB * gpus / steps)
    tree_lat = 2 * ((per_node - 1) * c("nccl_tree_nvl_us") + math.log2(max(n_nodes, 1)) * c("nccl_tree_lat_us"))
    tree = tree_lat * 1e-6 + nbytes / (min(bus * 0.9, 80.0) * GB * 0.5)
    return min(ring, tree)


def step_comm_s(params: int, gpus: int, *, bucket_mb: float) -> float:
    """The gradient allreduces of one step: fp32 gradients in buckets of ``bucket_mb``."""
    grad = 4 * params
    buckets = math.ceil(grad / (bucket_mb * 1e6))
    return buckets * allreduce_s(grad / buckets, gpus)


def shared_fs_s(nbytes: float, readers_nodes: int) -> float:
    """Reading ``nbytes`` in all from the shared file system spread over ``readers_nodes`` nodes."""
    return nbytes / (min(c("fs_aggregate_GBps"), readers_nodes * c("fs_node_GBps")) * GB)


def model_row(name: str, data: dict, gpus: int, m: dict) -> dict:
    n_nodes = nodes(gpus)
    per_image = m["shard_stage"]["bytes_per_image_256"]
    split_bytes = (data["train"] + data["val"]) * per_image
    hash_Bps = m["sha256_MBps_core"] * 1e6
    steps = data["train"] // (gpus * BATCH)
    row = {"dataset": name, "gpus": gpus, "nodes": n_nodes, "global_batch": gpus * BATCH, "steps_per_epoch": steps,
           "split_GB": split_bytes / GB}
    # time to the first step (the start-up of processes, CUDA and NCCL is not in it: a GPU session measures it)
    ckpt = m["checkpoint_resnet50"]["bytes"]
    row["first_step_before_s"] = max(shared_fs_s(gpus * split_bytes, n_nodes), split_bytes / hash_Bps)
    row["first_step_fresh_s"] = max(shared_fs_s(split_bytes, n_nodes), split_bytes / gpus / hash_Bps)
    row["first_step_requeue_s"] = ckpt / (c("fs_node_GBps") * GB) + allreduce_s(ckpt, gpus) / 2
    row["staging_s"] = shared_fs_s(n_nodes * split_bytes, n_nodes)
    if steps == 0:
        row["bound"] = "no step: fewer training images than one global batch"
        return row
    compute = BATCH / c("gpu_img_s")
    comm = step_comm_s(m["parameters"]["resnet50"], gpus, bucket_mb=c("ddp_bucket_MB"))
    times = {"GPU": steps * compute, "network": steps * comm,
             "file system": shared_fs_s(data["train"] * per_image, n_nodes),
             "loader": data["train"] / (n_nodes * c("loader_img_s_node"))}
    row["epoch_s"] = max(times.values())
    row["bound"] = max(times, key=times.get)
    row["bound"] += " (" + ", ".join(f"{k} {100 * v / row['epoch_s']:.0f}%" for k, v in times.items()
                                     if k != row["bound"]) + " of it)"
    row["epoch_parts_s"] = times
    step = row["epoch_s"] / steps
    write = ckpt / (c("fs_node_GBps") * GB)
    interval = min(c("every_steps"), steps)            # the trainer also checkpoints at every epoch's end
    row["checkpoint_overhead"] = write / (interval * step)
    lost = interval / 2 * step                          # on average half a checkpoint interval is redone
    row["requeue_s"] = lost + row["first_step_requeue_s"]
    return row


def table(m: dict) -> str:
    lines = ["| data | GPUs (nodes) | global batch | steps/epoch | first step, before (s) | first step, fresh (s) "
             "| first step, requeue (s) | staging (s) | epoch (s) | bound | checkpoint overhead | requeue (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, data in DATASETS.items():
        for g in GPUS:
            r = model_row(name, data, g, m)
            ep = f"{r['epoch_s']:.1f}" if "epoch_s" in r else "-"
            ck = f"{100 * r['checkpoint_overhead']:.2f}%" if "epoch_s" in r else "-"
            rq = f"{r['requeue_s']:.2f}" if "epoch_s" in r else "-"
            lines.append(f"| {name} | {g} ({r['nodes']}) | {r['global_batch']:,} | {r['steps_per_epoch']:,} | "
                         f"{r['first_step_before_s']:.1f} | {r['first_step_fresh_s']:.2f} | "
                         f"{r['first_step_requeue_s']:.3f} | {r['staging_s']:.1f} | {ep} | {r['bound']} | {ck} | {rq} |")
    return "\n".join(lines)


def measured_table(m: dict) -> str:
    lines = [f"measured on {m['host']} ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['device']}), "
             f"{m['date']}: a train + val split of {m['split_shards']} shards, {m['split_bytes'] / 2**20:.1f} MiB; "
             f"the manifest {m['manifest_bytes']:,} bytes",
             "| world | start | MiB each rank read in fit() before its first step (x the split) | from the Trainer's "
             "construction (MiB) | seconds from launch to the first step |",
             "|---|---|---|---|---|"]
    for world, runs in m["first_step"].items():
        for tag, r in runs.items():
            fit = ", ".join(f"{b / 2**20:.2f} ({b / m['split_bytes']:.2f})" for b in r["fit_bytes"])
            whole = ", ".join(f"{b / 2**20:.2f}" for b in r["bytes"])
            lines.append(f"| {world} | {tag} | {fit} | {whole} | {r['seconds']:.1f} |")
    lines.append("(a requeue's rank 0 reads the checkpoint it resumes from: ResNet-18 and SGD momentum, ~89 MB)")
    ck, st = m["checkpoint_resnet50"], m["shard_stage"]
    lines += ["", f"* sha256: {m['sha256_MBps_core']:.0f} MB/s on one core",
              f"* ResNet-50 checkpoint (weights + SGD momentum): {ck['bytes'] / 1e6:.1f} MB, written in "
              f"{ck['write_s_local']:.2f} s to this machine's disk",
              f"* allreduced per step (fp32 gradients): ResNet-50 {4 * m['parameters']['resnet50'] / 1e6:.1f} MB, "
              f"DenseNet-121 {4 * m['parameters']['densenet121'] / 1e6:.1f} MB (half with fp16_compression)",
              f"* shard stage, 1,024 px PNG -> 256 px raw: {st['img_per_core_s']:.1f} images per core-second "
              f"({st['images']} images); {st['bytes_per_image_256']:,.0f} bytes per sample in a shard",
              f"* evaluation (predict, ResNet-50 at 224 px, CPU): {m['eval_img_s_resnet50_224']:.1f} images/s"]
    return "\n".join(lines)


def constants_table() -> str:
    lines = ["| constant | value | kind | source |", "|---|---|---|---|"]
    for name, f in CONSTANTS.items():
        lines.append(f"| {name} | {f.value:g} {f.unit} | {f.kind} | {f.source} |")
    return "\n".join(lines)


GPU_INPUTS = """What a GPU cluster session must measure to confirm the model (and where the model now takes it from):
1. images/s per GPU of ResNet-50 at the per-GPU batch the run will use (32, 64, 256): python bench/train_throughput.py
   --arch resnet50 --crop 224 --stored 256 --batch N --workers W   (model: H100 reference, batch 256 only)
2. allreduce bus bandwidth and latency between nodes: nccl-tests all_reduce_perf -b 8 -e 256M -f 2 -g 1 over 2
   and 16 nodes   (model: NCCL's tuner constants, HDR200 at 25 GB/s per GPU)
3. the shared file system: one node reading shard files cold (GB/s), and all nodes of the job at once
   (model: 25 GB/s per node, 500 GB/s for the whole file system)
4. time to the first step on GPU ranks, CUDA and NCCL set-up included, and the bytes each rank reads:
   python bench/scale_model.py --measure --json bench/results/scale-inputs-<host>.json on one GPU node
   (model: no process start-up time in the first-step column)
5. a ResNet-50 checkpoint written to the shared file system (seconds)   (model: size / 25 GB/s)
6. evaluation images/s on one GPU from raw 256 px shards   (model: not used for the epoch; CPU figure measured)"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="measure the inputs on this machine (minutes)")
    ap.add_argument("--inputs", type=Path, help="the measured inputs (JSON of an earlier --measure)")
    ap.add_argument("--json", type=Path, help="with --measure: where to write the inputs")
    ap.add_argument("--n-images", type=int, default=3000, help="the phantom release of the first-step runs "
                    "(the demo's fine-tuning release, shards as config.yaml's nih_demo)")
    ap.add_argument("--n-1024", type=int, default=40, help="images of the 1,024 px shard-stage run")
    ap.add_argument("--gpu-inputs", action="store_true", help="print what a GPU session must measure, and stop")
    args = ap.parse_args()
    if args.gpu_inputs:
        print(GPU_INPUTS)
        return
    if args.measure:
        m = measure(args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(m, indent=1))
    elif args.inputs:
        m = json.loads(args.inputs.read_text())
    else:
        ap.error("--measure or --inputs FILE")
    print(measured_table(m), "", constants_table(), "",
          f"The model, ResNet-50, {BATCH} images per GPU and step, raw 256 px shards:", table(m), sep="\n")


if __name__ == "__main__":
    main()
