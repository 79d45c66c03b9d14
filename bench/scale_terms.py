"""The terms of bench/scale_model.py's model: what a step, a start and a checkpoint cost on a named cluster
(bench/scale_clusters.py) given what chexflow measured (``inputs``: the JSON of ``scale_model.py
--measure``). Each function is one term, small enough to check by hand (tests/test_scale_model.py).

A term that needs a figure no source gives returns None: the tables print "?" and name the figure.
"""
from __future__ import annotations

import math

from scale_clusters import CHEXFLOW, H200_LOADER_IMG_S_14_WORKERS, H200_LOADER_WORKERS, Cluster

GB = 1e9
MICROSECOND = 1e-6
NCCL_SIMPLE_OVERHEAD_FACTOR = 3      # tuning.cc: "if (p == NCCL_PROTO_SIMPLE) netOverhead *= 3"
NCCL_TREE_ALGORITHM_FACTOR = 0.5     # tuning.cc: a tree's bus bandwidth to algorithm bandwidth ("ratio *= .5")
NCCL_PLATEAU_MIN_BYTES = 64          # tuning.cc: the ring plateau applies from 64 bytes per channel and rank
BYTES_PER_GRADIENT = 4               # fp32 gradients (DDP's default; Horovod's without fp16_compression)
FILE_OPERATIONS_PER_SHARD = 2        # open + fstat of each shard by each rank when its ShardStream is built


# ------------------------------------------------------------------------------------------ the network

def nodes_of(cluster: Cluster, gpus: int) -> int:
    return -(-gpus // int(cluster.value("gpus_per_node")))


def channel_GBps(cluster: Cluster) -> float:
    """The per-channel speed NCCL's topology search settles on between nodes: the fastest entry of its speed
    array (search.cc) that one rail carries. With one rail per GPU the search finds one channel per rail."""
    rail = cluster.value("rail_GBps")
    return max(speed for speed in cluster.nccl.channel_speeds_GBps if speed <= rail)


def ring_allreduce_s(cluster: Cluster, nbytes: float, gpus: int) -> float:
    """NCCL's ring, Simple protocol: latency of 2(G-1) steps (base + intra-node + inter-node steps, x the
    plateau factor between nodes) plus the bytes over the algorithm bandwidth (bus x G / (2(G-1)))."""
    tuning, n_nodes = cluster.nccl, nodes_of(cluster, gpus)
    per_node = gpus // n_nodes
    steps = 2 * (gpus - 1)
    channels = int(cluster.value("rails_per_node"))
    if n_nodes == 1:
        latency_us = tuning.ring_base_us + steps * tuning.ring_nvlink_us
        bus_GBps = cluster.value("nvlink_GBps")
    else:
        inter = 2 * (n_nodes - 1) if tuning.inter_steps_less_one else 2 * n_nodes
        overhead = NCCL_SIMPLE_OVERHEAD_FACTOR * tuning.net_overhead_us[cluster.cpu_vendor]
        intra_us = max(tuning.ring_nvlink_us, overhead)
        net_us = tuning.tree_net_us if (per_node == 1 and tuning.inter_steps_less_one) else tuning.ring_net_us
        latency_us = tuning.ring_base_us + (steps - inter) * intra_us + inter * net_us
        if nbytes / (channels * gpus) >= NCCL_PLATEAU_MIN_BYTES:
            latency_us *= tuning.ring_plateau
        bus_GBps = channels * channel_GBps(cluster)
    algorithm_GBps = bus_GBps * gpus / steps
    return latency_us * MICROSECOND + nbytes / (algorithm_GBps * GB)


def tree_allreduce_s(cluster: Cluster, nbytes: float, gpus: int) -> float | None:
    """NCCL's tree between nodes, Simple protocol: 2 x (hops within the node + levels between nodes) of
    latency, bus bandwidth min(0.92 x channels x speed, channels x the per-channel tree cap), half of it
    as algorithm bandwidth, times the size's correction factor. None on one node (the ring serves it)."""
    tuning, n_nodes = cluster.nccl, nodes_of(cluster, gpus)
    if n_nodes == 1:
        return None
    per_node = gpus // n_nodes
    channels = int(cluster.value("rails_per_node"))
    levels = int(math.log2(n_nodes))                       # NCCL's log2i: the floor
    latency_us = tuning.tree_base_us + 2 * ((per_node - 1) * tuning.tree_nvlink_us + levels * tuning.tree_net_us)
    cap_two_nodes, cap_more = tuning.tree_channel_max_GBps[cluster.gpu_generation]
    cap = cap_two_nodes if n_nodes == 2 else cap_more
    bus_GBps = min(tuning.tree_bus_factor * channels * channel_GBps(cluster), channels * cap)
    algorithm_GBps = NCCL_TREE_ALGORITHM_FACTOR * bus_GBps
    size_index = int(math.log2(int(nbytes) >> 6)) if int(nbytes) >> 6 else -1
    if 0 <= size_index < len(tuning.tree_correction):
        algorithm_GBps *= tuning.tree_correction[size_index]
    return latency_us * MICROSECOND + nbytes / (algorithm_GBps * GB)


def allreduce_s(cluster: Cluster, nbytes: float, gpus: int) -> float:
    """The faster of ring and tree, as NCCL's tuner picks (CollNet and NVLS need SHARP or NVSwitch, which
    neither cluster's nodes have; LL and LL128 lose to Simple at the sizes of gradient buckets)."""
    if gpus == 1:
        return 0.0
    tree = tree_allreduce_s(cluster, nbytes, gpus)
    ring = ring_allreduce_s(cluster, nbytes, gpus)
    return ring if tree is None else min(ring, tree)


def step_network_s(cluster: Cluster, parameters: int, gpus: int) -> float:
    """One step's gradient allreduces: fp32 gradients in DDP's 25 MB buckets, one allreduce each."""
    gradient_bytes = BYTES_PER_GRADIENT * parameters
    buckets = math.ceil(gradient_bytes / (CHEXFLOW["ddp_bucket_MB"].value * 1e6))
    return buckets * allreduce_s(cluster, gradient_bytes / buckets, gpus)


# ------------------------------------------------------------------------------------- GPU and loader

def step_gpu_s(cluster: Cluster, batch: int) -> float:
    """A step's GPU time: the batch at the GPU's peak rate, never below the step floor (a small batch
    does not make the step shorter than its launches)."""
    return max(cluster.value("step_floor_s"), batch / cluster.value("gpu_peak_img_s"))


def worker_batch_s(batch: int) -> float:
    """Seconds one loader worker takes to make a batch: measured at 32, 64 and 256 (H200 node, 14 workers),
    linear between those batches and along the nearest segment outside them."""
    points = sorted((b, b * H200_LOADER_WORKERS / rate) for b, rate in H200_LOADER_IMG_S_14_WORKERS.items())
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if batch <= b1 or (b1, t1) == points[-1]:
            return t0 + (batch - b0) * (t1 - t0) / (b1 - b0)
    raise AssertionError("unreachable: the last segment returns")


def step_loader_s(batch: int, workers: int) -> float:
    """A rank's loader delivers a batch every worker_batch_s / workers (its workers make whole batches)."""
    return worker_batch_s(batch) / workers


def workers_needed(cluster: Cluster, batch: int) -> int:
    """The fewest workers per rank whose batches keep up with the GPU's step."""
    return math.ceil(worker_batch_s(batch) / step_gpu_s(cluster, batch))


# --------------------------------------------------------------------------------------- file system

def read_GBps(cluster: Cluster, n_nodes: int) -> float | None:
    """What ``n_nodes`` read from the shared file system at most: the file system's aggregate or the nodes'
    links, the smaller; None where the aggregate is not published."""
    aggregate = cluster.value("fs_read_GBps")
    return None if aggregate is None else min(aggregate, n_nodes * cluster.value("fs_client_GBps"))


def step_file_system_s(cluster: Cluster, gpus: int, batch: int, bytes_per_image: float) -> float | None:
    """Each training image is read once per epoch from the shared file system (no staging)."""
    rate = read_GBps(cluster, nodes_of(cluster, gpus))
    return None if rate is None else gpus * batch * bytes_per_image / (rate * GB)


def step_terms(cluster: Cluster, gpus: int, batch: int, inputs: dict) -> dict:
    workers = int(CHEXFLOW["loader_workers_per_rank"].value)
    return {"GPU": step_gpu_s(cluster, batch),
            "network": step_network_s(cluster, inputs["parameters"]["resnet50"], gpus),
            f"loader ({workers} workers)": step_loader_s(batch, workers),
            "file system": step_file_system_s(cluster, gpus, batch, inputs["shard_stage"]["bytes_per_image_256"])}


def bound(terms: dict) -> tuple[str, float, float]:
    """The term that bounds the step (DDP overlaps the allreduces with the backward pass, the loader's
    workers run ahead: the step takes the longest of them), its seconds and how far ahead of the next."""
    known = sorted(((seconds, name) for name, seconds in terms.items() if seconds is not None), reverse=True)
    (longest, name), (second, _) = known[0], known[1]
    return name, longest, longest / second


# ------------------------------------------------------------------------------------------ a start

def split_shards(data: dict) -> int:
    per_shard = CHEXFLOW["samples_per_shard"].value
    return math.ceil(data["train"] / per_shard) + math.ceil(data["val"] / per_shard)


def metadata_operations(data: dict, gpus: int) -> int:
    """open + fstat of every shard of the split by every rank, when each builds its ShardStream."""
    return FILE_OPERATIONS_PER_SHARD * split_shards(data) * gpus


def start_before_bytes(cluster: Cluster, split_bytes: float, gpus: int) -> float:
    """Bytes the file system served when every rank hashed the whole split: once per node while the split
    fits the node's page cache (the node's ranks read the same files), once per rank if it does not."""
    fits = split_bytes <= cluster.value("node_memory_GB") * GB
    return (nodes_of(cluster, gpus) if fits else gpus) * split_bytes


def seconds_at(nbytes: float, rate_GBps: float | None) -> float | None:
    return None if rate_GBps is None else nbytes / (rate_GBps * GB)


def start_terms(cluster: Cluster, data: dict, gpus: int, inputs: dict) -> dict:
    """Time to the first step (fresh, before, requeue), staging, metadata: processes, CUDA and NCCL set-up
    not included (a GPU session measures them)."""
    n_nodes = nodes_of(cluster, gpus)
    split = (data["train"] + data["val"]) * inputs["shard_stage"]["bytes_per_image_256"]
    hash_Bps = inputs["sha256_MBps_core"] * 1e6
    rate = read_GBps(cluster, n_nodes)
    checkpoint = inputs["checkpoint_resnet50"]["bytes"]
    before_bytes = start_before_bytes(cluster, split, gpus)
    metadata_rate = cluster.value("fs_metadata_ops_s")
    operations = metadata_operations(data, gpus)
    return {"split_bytes": split, "shards": split_shards(data),
            "fresh_read_s": seconds_at(split, rate), "fresh_hash_s": split / gpus / hash_Bps,
            "before_bytes": before_bytes, "before_read_s": seconds_at(before_bytes, rate),
            "before_hash_s": split / hash_Bps,
            "requeue_s": checkpoint / (cluster.value("fs_client_GBps") * GB) + allreduce_s(cluster, checkpoint, gpus) / 2,
            "staging_s": seconds_at(n_nodes * split, rate),
            "metadata_operations": operations,
            "metadata_s": None if metadata_rate is None else operations / metadata_rate}


# ------------------------------------------------------------------------------------- checkpoints

def job_mtbf_s(cluster: Cluster, gpus: int) -> float:
    """A job of ``gpus`` GPUs fails every (GPU-hours between failures) / gpus hours."""
    return cluster.value("gpu_hours_between_failures") / gpus * 3600


def young_daly_s(write_s: float, mtbf_s: float) -> float:
    """Young (1974) / Daly (2006), first order, as CSCS recommends: sqrt(2 x write time x MTBF)."""
    return math.sqrt(2 * write_s * mtbf_s)


def checkpoint_overhead(write_s: float, interval_s: float, mtbf_s: float) -> float:
    """The share of time lost: writing (write / interval) plus half an interval redone per failure
    (interval / (2 MTBF)). At the Young/Daly interval both are equal: sqrt(2 write / MTBF) in all."""
    return write_s / interval_s + interval_s / (2 * mtbf_s)


def checkpoint_terms(mtbf: float, step_s: float, steps_per_epoch: int, write_s: float) -> dict:
    """The Young/Daly interval (in steps; the trainer also writes at every epoch's end, so an epoch shorter
    than the interval sets it), its overhead, and the overhead at config.yaml's every_steps."""
    ideal = young_daly_s(write_s, mtbf)
    interval_steps = max(1, min(round(ideal / step_s), steps_per_epoch))
    configured = min(int(CHEXFLOW["every_steps"].value), steps_per_epoch)
    return {"mtbf_s": mtbf, "ideal_s": ideal, "interval_steps": interval_steps,
            "overhead": checkpoint_overhead(write_s, interval_steps * step_s, mtbf),
            "overhead_every_steps": checkpoint_overhead(write_s, configured * step_s, mtbf)}


# ----------------------------------------------------------------------------------------- a row

def model_row(cluster: Cluster, data: dict, gpus: int, batch: int, inputs: dict) -> dict:
    steps = data["train"] // (gpus * batch)
    row = {"nodes": nodes_of(cluster, gpus), "global_batch": gpus * batch, "steps_per_epoch": steps,
           "start": start_terms(cluster, data, gpus, inputs)}
    if steps == 0:
        return row
    terms = step_terms(cluster, gpus, batch, inputs)
    name, step_s, margin = bound(terms)
    checkpoint = inputs["checkpoint_resnet50"]
    measured_write_s, mtbf = checkpoint["write_s_local"], job_mtbf_s(cluster, gpus)
    client_write_s = checkpoint["bytes"] / (CHEXFLOW["lustre_client_write_GBps"].value * GB)
    nic_write_s = checkpoint["bytes"] / (cluster.value("rail_GBps") * GB)
    row.update(terms=terms, bound=name, step_s=step_s, margin=margin, epoch_s=steps * step_s,
               workers_needed=workers_needed(cluster, batch),
               checkpoint=checkpoint_terms(mtbf, step_s, steps, measured_write_s),
               sensitivity={"2 GB/s": checkpoint_terms(mtbf, step_s, steps, client_write_s),
                            "one NIC": checkpoint_terms(mtbf, step_s, steps, nic_write_s),
                            "MTBF / 2": checkpoint_terms(mtbf / 2, step_s, steps, measured_write_s)})
    return row
