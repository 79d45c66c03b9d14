"""What a step, a start and a checkpoint cost on named clusters at 4 to 800 GPUs: a model on paper, fed by
what chexflow measures (bench/scale_measure.py) and by figures whose source it names
(bench/scale_clusters.py); the terms are bench/scale_terms.py.

    python bench/scale_model.py                    # the committed model (the inputs measured 2026-11-28)
    OMP_NUM_THREADS=1 python bench/scale_model.py --measure --json bench/results/scale-inputs-<host>.json
    python bench/scale_model.py --inputs bench/results/scale-inputs-<host>.json      # the tables again
    python bench/scale_model.py --gpu-inputs       # what a GPU cluster session must measure to confirm it
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import scale_terms as terms  # noqa: E402
from scale_clusters import CHEXFLOW, CLUSTERS, DATASETS, ROWS, Figure  # noqa: E402

COMMITTED_INPUTS = REPO / "bench/results/scale_inputs-20261128-cpu.json"


def cell(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "?" if value is None else f"{value:,.{digits}f}{suffix}"


def at_least(*parts: float | None) -> str:
    """The largest of the parts; '>= x' where a part is unknown (a figure no source gives)."""
    known = [p for p in parts if p is not None]
    return f"{max(known):,.2f}" if len(known) == len(parts) else f">= {max(known):,.2f}"


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
    ck, st = m["checkpoint_resnet50"], m["shard_stage"]
    lines += ["", f"* sha256: {m['sha256_MBps_core']:.0f} MB/s on one core",
              f"* ResNet-50 checkpoint (weights + SGD momentum): {ck['bytes'] / 1e6:.1f} MB, written in "
              f"{ck['write_s_local']:.2f} s ({ck['bytes'] / ck['write_s_local'] / 1e9:.2f} GB/s) to this machine's disk",
              f"* allreduced per step (fp32 gradients): ResNet-50 {4 * m['parameters']['resnet50'] / 1e6:.1f} MB, "
              f"DenseNet-121 {4 * m['parameters']['densenet121'] / 1e6:.1f} MB",
              f"* shard stage, 1,024 px PNG -> 256 px raw: {st['img_per_core_s']:.1f} images per core-second "
              f"({st['images']} images); {st['bytes_per_image_256']:,.0f} bytes per sample in a shard",
              f"* evaluation (predict, ResNet-50 at 224 px, CPU): {m['eval_img_s_resnet50_224']:.1f} images/s"]
    return "\n".join(lines)


def figure_line(name: str, f: Figure) -> str:
    value = "-" if f.value is None else f"{f.value:,.4g} {f.unit}"
    return f"| {name} | {value} | {f.kind} | {f.source} |"


def constants_table() -> str:
    lines = []
    for cluster in CLUSTERS:
        nccl = cluster.nccl
        lines += [f"{cluster.name}: {cluster.gpu}, NCCL {nccl.version} ({nccl.source}): ring base {nccl.ring_base_us} "
                  f"us, ring step NVLink {nccl.ring_nvlink_us} / network {nccl.ring_net_us} us, tree base "
                  f"{nccl.tree_base_us} us, tree hop NVLink {nccl.tree_nvlink_us} / network {nccl.tree_net_us} us, "
                  f"ring plateau x{nccl.ring_plateau}, network overhead {nccl.net_overhead_us[cluster.cpu_vendor]} us "
                  f"({cluster.cpu_vendor} CPU) x3, tree cap {nccl.tree_channel_max_GBps[cluster.gpu_generation]} GB/s "
                  f"per channel (2 nodes, more); channel speed {terms.channel_GBps(cluster):g} GB/s",
                  "| constant | value | kind | source |", "|---|---|---|---|"]
        lines += [figure_line(name, f) for name, f in cluster.figures.items()] + [""]
    lines += ["chexflow:", "| constant | value | kind | source |", "|---|---|---|---|"]
    lines += [figure_line(name, f) for name, f in CHEXFLOW.items()]
    return "\n".join(lines)


def _rows(m: dict):
    for cluster in CLUSTERS:
        for name, gpus, batch, optimizer in ROWS:
            yield cluster, name, gpus, batch, optimizer, terms.model_row(cluster, DATASETS[name], gpus, batch, m)


def step_table(m: dict) -> str:
    workers = int(CHEXFLOW["loader_workers_per_rank"].value)
    lines = [f"| cluster | data | GPUs (nodes) | batch per GPU | global batch (trained by) | steps/epoch | GPU ms | "
             f"network ms | loader ms ({workers} workers) | file system ms | bound (x the next) | epoch s | workers "
             "needed |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cluster, name, gpus, batch, optimizer, row in _rows(m):
        head = f"| {cluster.name} | {name} | {gpus} ({row['nodes']}) | {batch} | {optimizer} | {row['steps_per_epoch']:,} |"
        if "terms" not in row:
            lines.append(head + " - | - | - | - | no step: fewer images than one global batch | - | - |")
            continue
        ms = [cell(None if v is None else 1000 * v) for v in row["terms"].values()]
        lines.append(f"{head} {' | '.join(ms)} | {row['bound']} (x{row['margin']:.2f}) | {row['epoch_s']:,.1f} | "
                     f"{row['workers_needed']} |")
    return "\n".join(lines)


def start_table(m: dict) -> str:
    lines = ["| cluster | data | GPUs (nodes) | shards | first step, fresh s (read, hash) | before: TB served, s | "
             "first step, requeue s | staging s | open+fstat per start (s) |", "|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for cluster, name, gpus, _batch, _optimizer, row in _rows(m):
        if (cluster.name, name, gpus) in seen:
            continue
        seen.add((cluster.name, name, gpus))
        s = row["start"]
        lines.append(
            f"| {cluster.name} | {name} | {gpus} ({row['nodes']}) | {s['shards']} | "
            f"{at_least(s['fresh_read_s'], s['fresh_hash_s'])} ({cell(s['fresh_read_s'], 2)}, {s['fresh_hash_s']:.2f}) | "
            f"{s['before_bytes'] / 1e12:.2f}, {at_least(s['before_read_s'], s['before_hash_s'])} | "
            f"{s['requeue_s']:.3f} | {cell(s['staging_s'])} | {s['metadata_operations']:,} ({cell(s['metadata_s'], 2)}) |")
    return "\n".join(lines)


def checkpoint_table(m: dict) -> str:
    write = m["checkpoint_resnet50"]
    lines = [f"A checkpoint of {write['bytes'] / 1e6:.1f} MB written in {write['write_s_local']:.2f} s (measured: "
             f"{write['bytes'] / write['write_s_local'] / 1e9:.2f} GB/s); sensitivity: the same at "
             f"{CHEXFLOW['lustre_client_write_GBps'].value:g} GB/s (one file system client, assumed), at one NIC's "
             "25 GB/s, and at half the MTBF.",
             "| cluster | data | GPUs | batch per GPU | step ms | job MTBF h | Young/Daly interval s (steps) | overhead | "
             f"at every_steps {CHEXFLOW['every_steps'].value:g} | 2 GB/s | one NIC | MTBF / 2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cluster, name, gpus, batch, _optimizer, row in _rows(m):
        if "checkpoint" not in row:
            continue
        c, sens = row["checkpoint"], row["sensitivity"]
        lines.append(f"| {cluster.name} | {name} | {gpus} | {batch} | {1000 * row['step_s']:.1f} | "
                     f"{c['mtbf_s'] / 3600:,.0f} | {c['ideal_s']:,.0f} ({c['interval_steps']:,}) | "
                     f"{100 * c['overhead']:.2f}% | {100 * c['overhead_every_steps']:.1f}% | "
                     f"{100 * sens['2 GB/s']['overhead']:.2f}% | {100 * sens['one NIC']['overhead']:.2f}% | "
                     f"{100 * sens['MTBF / 2']['overhead']:.2f}% |")
    return "\n".join(lines)


def nccl_check() -> str:
    alps = next(c for c in CLUSTERS if "nccl_tests_2_nodes" in c.figures)
    nbytes = 128 * 2**20
    model = terms.allreduce_s(alps, nbytes, 8)
    measured = alps.value("nccl_tests_2_nodes")
    return (f"Check against a measurement: {alps.name}, all_reduce_perf of 128 MiB over 2 nodes (8 GPUs): "
            f"measured {1e6 * measured:,.0f} us, the model {1e6 * model:,.0f} us (x{model / measured:.2f}).")


GPU_INPUTS = """What a GPU cluster session must measure to confirm the model (and where the model now takes it from):
1. images/s per GPU of ResNet-50 at the per-GPU batch the run will use (10, 32, 128, 256), on the cluster's GPU:
   python bench/train_throughput.py --arch resnet50 --crop 224 --stored 256 --batch N --workers W
   (model: A100 published at 256; H200 measured at 32, 64, 256; the step floor from the H200 at 32)
2. allreduce time between nodes: nccl-tests all_reduce_perf -b 1M -e 32M -f 2 -g 1 over 2, 16 and 200 nodes
   (model: NCCL's own tuner constants of the cluster's NCCL release, one channel per rail)
3. the shared file system: one node reading shard files cold (GB/s), all nodes of the job at once, and the
   open+fstat rate (model: published aggregates where there are any; JUST's are not published)
4. time to the first step on GPU ranks, CUDA and NCCL set-up included, and the bytes each rank reads:
   python bench/scale_model.py --measure --json bench/results/scale-inputs-<host>.json on one GPU node
5. a ResNet-50 checkpoint written to the shared file system from one rank (seconds)   (model: the 0.75 s
   measured on this machine's disk; 2 GB/s and one NIC as sensitivity)
6. the loader's images/s per worker on the cluster's CPU at the run's batch (model: the H200 node's cores)"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="measure the inputs on this machine (minutes)")
    ap.add_argument("--inputs", type=Path, default=COMMITTED_INPUTS,
                    help="the measured inputs (JSON of an earlier --measure; default: the committed ones)")
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
        from scale_measure import measure
        m = measure(args.n_images, args.n_1024)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(m, indent=1))
    else:
        m = json.loads(args.inputs.read_text())
    print(measured_table(m), "", constants_table(), "", nccl_check(), "",
          "What bounds a step (ResNet-50, 224 px from raw 256 px shards, DDP):", step_table(m), "",
          "What a start costs (no process, CUDA or NCCL start-up in it):", start_table(m), "",
          "Checkpoints (Young/Daly, sqrt(2 x write time x MTBF)):", checkpoint_table(m), sep="\n")


if __name__ == "__main__":
    main()
