"""The named clusters bench/scale_model.py models, and NCCL's tuner constants per version: every number
with its unit, its kind and where it comes from (a URL, a file at a commit, or the chexflow command that
measured it). Data only; the arithmetic is in bench/scale_terms.py.

Kinds: ``published`` (the source says it), ``measured`` (chexflow measured it; the host is named),
``modelled`` (derived from the others, the derivation said), ``setting`` (a chexflow setting or
recommendation), ``assumed`` (no source: a value to test the conclusion against, shown as such).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    value: float | None      # None: no published figure (the model says so instead of guessing)
    unit: str
    kind: str
    source: str


# ------------------------------------------------------------------------------------------ sources
NCCL_GIT = "https://github.com/NVIDIA/nccl/blob"
JUWELS_PAGE = "https://apps.fz-juelich.de/jsc/hps/juwels/booster-overview.html"
JSC_NCCL_MODULE = ("https://github.com/easybuilders/JSC Golden_Repo/n/NCCL/NCCL-default-GCCcore-13.3.0-CUDA-12.eb "
                   "(commit fbbe545; JSC's software stage 2025: local_realversion 2.22.3-1)")
CSCS_DOCS = "https://github.com/eth-cscs/cscs-docs (commit 80abed1, 2026-08-20)"
ALPS_NODE = f"{CSCS_DOCS} docs/alps/hardware.md and docs/images/alps/gh200-schematic.svg"
ALPS_STORAGE = f"{CSCS_DOCS} docs/alps/storage.md"
ALPS_NCCL = f"{CSCS_DOCS} docs/software/ml/pytorch.md: the pytorch/v2.9.1 uenv ships nccl 2.29.2-1"
DLE_RN50 = ("https://github.com/NVIDIA/DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/README.md "
            "(commit 291f0d0), 'Training performance: NVIDIA DGX A100 (8x A100 80GB)', pytorch-21.03 NGC")
H200_RUNS = "bench/train_throughput.py --arch resnet50 --crop 224 --stored 256 --workers 14 on an H200 node"
LLAMA3 = ("Dubey et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783) sec. 3.3.4: 419 unexpected "
          "interruptions in a 54-day snapshot on 16,384 H100 GPUs")


@dataclass(frozen=True)
class NcclTuning:
    """The Simple-protocol allreduce constants of one NCCL release's ``src/graph/tuning.cc`` (latencies
    in microseconds) and ``src/graph/search.cc`` (the per-channel speeds its topology search tries)."""
    version: str
    ring_base_us: float          # baseLat[Ring][Simple]
    tree_base_us: float          # baseLat[Tree][Simple]
    ring_nvlink_us: float        # hwLat[NVLINK][Ring][Simple]: per intra-node ring step
    ring_net_us: float           # hwLat[NET][Ring][Simple]: per inter-node ring step
    tree_nvlink_us: float        # hwLat[NVLINK][Tree][Simple]: per intra-node tree hop
    tree_net_us: float           # hwLat[NET][Tree][Simple]: per tree level between nodes
    inter_steps_less_one: bool   # allreduce's inter-node ring steps: 2*(nNodes-1) if True, 2*nNodes if not
    net_overhead_us: dict        # getNetOverhead() by CPU vendor, x3 for Simple (intra steps of a multi-node ring)
    ring_plateau: float          # "Plateau effect of ring" for sm80 and later (multi-node, large allreduce)
    tree_bus_factor: float       # busBw*.92 for trees
    tree_channel_max_GBps: dict  # perChMaxTreeBws[gpu generation]: (2 nodes, more than 2 nodes)
    tree_correction: tuple       # treeCorrectionFactor[Simple][log2(bytes/64)]
    channel_speeds_GBps: tuple   # search.cc speedArrayInter (sm90SpeedArrayInter on Hopper)

    @property
    def source(self) -> str:
        return f"{NCCL_GIT}/v{self.version}/src/graph/tuning.cc and search.cc"


# treeCorrectionFactor's Simple row is the same in both releases (2.29 adds a 24th entry, 256 MB)
_TREE_CORRECTION_SIMPLE = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)
_SPEEDS_SM80 = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12)
_SPEEDS_SM90 = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12)

NCCL_2_22_3 = NcclTuning(
    version="2.22.3-1", ring_base_us=8.4, tree_base_us=0.0, ring_nvlink_us=3.4, ring_net_us=14.0,
    tree_nvlink_us=28.0, tree_net_us=28.0, inter_steps_less_one=False,
    net_overhead_us={"amd": 2.0, "intel": 1.0, "arm": 1.0}, ring_plateau=1.4, tree_bus_factor=.92,
    tree_channel_max_GBps={"ampere": (23.6, 17.8), "hopper": (41.4, 36.0)}, tree_correction=_TREE_CORRECTION_SIMPLE,
    channel_speeds_GBps=_SPEEDS_SM80)
NCCL_2_29_2 = NcclTuning(
    version="2.29.2-1", ring_base_us=8.4, tree_base_us=8.4, ring_nvlink_us=3.4, ring_net_us=14.0,
    tree_nvlink_us=4.0, tree_net_us=14.0, inter_steps_less_one=True,
    net_overhead_us={"amd": 2.0, "intel": 1.0, "arm": 1.0}, ring_plateau=1.4, tree_bus_factor=.92,
    tree_channel_max_GBps={"ampere": (23.6, 17.8), "hopper": (41.4, 36.0)}, tree_correction=_TREE_CORRECTION_SIMPLE + (.9,),
    channel_speeds_GBps=_SPEEDS_SM90)


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: str
    gpu_generation: str          # the row of NCCL's per-generation tables: ampere | hopper
    cpu_vendor: str              # NCCL's getNetOverhead(): amd | intel | arm
    nccl: NcclTuning
    figures: dict                # name -> Figure; the names bench/scale_terms.py reads

    def value(self, name: str) -> float | None:
        return self.figures[name].value


# ---------------------------------------------- what chexflow measured on an H200 node (one GPU, 16 cores)
# Images/s of chexflow's full training path (ResNet-50, bf16, channels_last, 224 px from 256 px shards) and
# of its loader alone with 14 workers, at three per-GPU batches (bench/results/throughput-resnet50-*.json).
H200_FULL_IMG_S = {32: 1148.2, 64: 2326.0, 256: 4125.6}
H200_LOADER_IMG_S_14_WORKERS = {32: 14216.6, 64: 16747.9, 256: 33680.3}
H200_LOADER_WORKERS = 14
_H200_FILES = ("bench/results/throughput-resnet50-b32-s240-20261128-h200-lease4.json, "
               "throughput-resnet50-b64-s240-20261128-h200-lease4.json, throughput-resnet50-20261128-h200.json")


def _loader_figure() -> Figure:
    return Figure(H200_LOADER_IMG_S_14_WORKERS[256] / H200_LOADER_WORKERS, "img/s per worker at batch 256",
                  "measured (H200 node)", f"chexflow's loader alone, 14 workers on 16 cores ({H200_RUNS}; "
                  f"{_H200_FILES}); batches 32 and 64 read from the same files")


def _step_floor_figure() -> Figure:
    return Figure(32 / H200_FULL_IMG_S[32], "s per step", "measured (H200 node)",
                  "the full path's step at batch 32 (1,148.2 img/s): a step costs at least this however small "
                  "the batch (kernel launches and the host's share of a step; its batch 64 step is as long). "
                  f"{H200_RUNS} --batch 32; no torch.compile or CUDA graphs, which shorten it")


_FAILURES = Figure(54 * 24 * 16_384 / 419, "GPU-hours between failures", "published (another cluster)",
                   f"{LLAMA3}: 54 d x 24 h x 16,384 / 419; a job of G GPUs fails every this / G hours")

JUWELS_BOOSTER = Cluster(
    name="JUWELS Booster", gpu="A100 40 GB", gpu_generation="ampere", cpu_vendor="amd", nccl=NCCL_2_22_3,
    figures={
        "gpus_per_node": Figure(4, "GPUs", "published", f"4 x NVIDIA A100 40 GB per node ({JUWELS_PAGE})"),
        "nodes_in_system": Figure(936, "nodes", "published", JUWELS_PAGE),
        "rails_per_node": Figure(4, "adapters", "published", f"4 x HDR200 InfiniBand ConnectX-6 per node ({JUWELS_PAGE})"),
        "rail_GBps": Figure(25, "GB/s", "published", f"HDR200: 200 Gbit/s each ({JUWELS_PAGE})"),
        "nvlink_GBps": Figure(300, "GB/s per GPU and direction", "published",
                              "A100 SXM4: NVLink 3, 600 GB/s bidirectional (NVIDIA A100 datasheet); "
                              f"the 4 GPUs are connected by NVLink3 ({JUWELS_PAGE})"),
        "cores_per_node": Figure(48, "cores", "published", f"2 x AMD EPYC 7402, 24 cores each ({JUWELS_PAGE})"),
        "node_memory_GB": Figure(512, "GB", "published", f"512 GB DDR4, at least 20 GB taken by the system ({JUWELS_PAGE})"),
        "nccl_version": Figure(None, "", "published", f"NCCL 2.22.3-1: {JSC_NCCL_MODULE}"),
        "gpu_peak_img_s": Figure(2470, "img/s per GPU", "published",
                                 f"ResNet-50 v1.5, mixed precision, 1 x A100 80 GB, batch 256 ({DLE_RN50}); "
                                 "JUWELS's A100 40 GB has the same SMs and clocks, less memory bandwidth"),
        "step_floor_s": _step_floor_figure(),
        "loader_img_s_worker": _loader_figure(),
        "fs_read_GBps": Figure(None, "GB/s", "published",
                               "JUST $SCRATCH (GPFS, https://apps.fz-juelich.de/jsc/hps/juwels/filesystems.html): "
                               "no aggregate rate published there; measure it (--gpu-inputs 3)"),
        "fs_write_GBps": Figure(None, "GB/s", "published", "JUST $SCRATCH: no aggregate write rate published either"),
        "fs_client_GBps": Figure(100, "GB/s per node", "published",
                                 f"a node reaches JUST through its 4 HDR200 adapters ({JUWELS_PAGE}): an upper bound "
                                 "that NCCL's traffic shares"),
        "fs_metadata_ops_s": Figure(None, "operations/s", "published", "no metadata rate published for JUST"),
        "gpu_hours_between_failures": _FAILURES,
    })

ALPS_GH200 = Cluster(
    name="CSCS Alps (GH200)", gpu="GH200 (H100 96 GB)", gpu_generation="hopper", cpu_vendor="arm", nccl=NCCL_2_29_2,
    figures={
        "gpus_per_node": Figure(4, "GPUs", "published", f"4 Grace-Hopper modules per node ({ALPS_NODE})"),
        "nodes_in_system": Figure(2688, "nodes", "published", f"2,688 Grace-Hopper nodes ({ALPS_NODE})"),
        "rails_per_node": Figure(4, "NICs", "published", f"4 Slingshot 11 NICs per node, one per module ({ALPS_NODE})"),
        "rail_GBps": Figure(25, "GB/s", "published", f"'200Gb/s (25GB/s)' per NIC ({ALPS_NODE}, the schematic)"),
        "nvlink_GBps": Figure(150, "GB/s per GPU pair and direction", "published",
                              f"'150GB/s' between each pair of GH200 ({ALPS_NODE}, the schematic)"),
        "cores_per_node": Figure(288, "cores", "published", f"4 Grace CPUs of 72 cores ({ALPS_NODE})"),
        "node_memory_GB": Figure(480, "GB", "published", f"4 x 120 GB LPDDR5X ({ALPS_NODE}, the schematic: "
                                 "~855 GB unified with the GPUs' HBM3)"),
        "nccl_version": Figure(None, "", "published", f"NCCL 2.29.2-1: {ALPS_NCCL}"),
        "gpu_peak_img_s": Figure(H200_FULL_IMG_S[256], "img/s per GPU", "measured (H200 node)",
                                 f"chexflow's full training path at batch 256 ({H200_RUNS}); the GH200's GPU is the "
                                 "same Hopper die with 4 TB/s HBM3 (the H200: 4.8 TB/s HBM3e): confirm on a GH200"),
        "step_floor_s": _step_floor_figure(),
        "loader_img_s_worker": _loader_figure(),
        "fs_read_GBps": Figure(782, "GB/s", "published", f"Iopsstor (Lustre, NVMe), read; CSCS puts training data "
                               f"there ({ALPS_STORAGE}; docs/software/ml/pytorch.md)"),
        "fs_write_GBps": Figure(1090, "GB/s", "published", f"Capstor (Lustre), write; CSCS puts checkpoints there "
                                f"({ALPS_STORAGE})"),
        "fs_client_GBps": Figure(100, "GB/s per node", "published",
                                 f"a node's 4 x 25 GB/s NICs, which carry Lustre and NCCL alike ({ALPS_NODE}): an upper "
                                 "bound"),
        "fs_metadata_ops_s": Figure(214_000, "operations/s", "published",
                                    f"Iopsstor 'file create/s' ({ALPS_STORAGE}): the only metadata rate published; an "
                                    "open is cheaper than a create"),
        "gpu_hours_between_failures": _FAILURES,
        "nccl_tests_2_nodes": Figure(1916.4e-6, "s for 128 MiB over 8 GPUs", "published",
                                     f"all_reduce_perf on 2 GH200 nodes, busbw 122.57 GB/s ({CSCS_DOCS} "
                                     "docs/software/communication/nccl.md): a check of the model, not an input"),
    })

CLUSTERS = (JUWELS_BOOSTER, ALPS_GH200)

# --------------------------------------------------------------------------------- chexflow's side
CHEXFLOW = {
    "ddp_bucket_MB": Figure(25, "MB", "published", "torch DDP bucket_cap_mb default (torch.nn.parallel "
                            "DistributedDataParallel docs)"),
    "loader_workers_per_rank": Figure(4, "workers", "setting", "profiles/slurm/profile.yaml's recommendation "
                                      "(training.data.workers): what this model shows a rank needs"),
    "samples_per_shard": Figure(2000, "samples", "setting", "profiles/slurm/profile.yaml's recommendation "
                                "(shards.<dataset>.samples_per_shard)"),
    "every_steps": Figure(50, "steps", "setting", "config.yaml training.checkpoint.every_steps"),
    "lustre_client_write_GBps": Figure(2, "GB/s", "assumed", "one process writing one file through one Lustre or "
                                       "GPFS client: no source; shown to test the conclusion"),
}
DATASETS = {   # images of the splits a run reads (train + val); published counts
    "ImageNet 256 px": {"train": 1_281_167, "val": 50_000,
                        "source": "ILSVRC-2012 (Russakovsky et al. 2015)"},
    "NIH 1024->256 px": {"train": 77_872, "val": 8_652,
                         "source": "ChestX-ray14 (Wang et al. 2017): train_val_list 86,524 less "
                                   "shards.nih.val_fraction 0.1"},
}
# Per-GPU batches: what linear LR scaling with SGD is known to train (a global batch up to 8k, Goyal et al.
# 2017, 'Accurate, Large Minibatch SGD'), 32k only with LARS (You et al. 2017), which chexflow does not have,
# and the 256 per GPU of the earlier table for contrast.
ROWS = (
    ("ImageNet 256 px", 8, 256, "SGD (2,048)"),
    ("ImageNet 256 px", 64, 128, "SGD (8,192: Goyal et al.)"),
    ("ImageNet 256 px", 800, 10, "SGD (8,000: Goyal et al.)"),
    ("ImageNet 256 px", 800, 32, "LARS only (25,600)"),
    ("ImageNet 256 px", 800, 256, "none known (204,800)"),
    ("NIH 1024->256 px", 4, 64, "SGD (256)"),
    ("NIH 1024->256 px", 64, 128, "SGD (8,192)"),
)
