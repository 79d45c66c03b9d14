# Path helpers and wildcard lists for the rules (no logic beyond naming things).
import json
import math
import os
import sys

from chexflow.data import sources as _sources
from chexflow.data import shards as _shards

# `chexflow` (the package's CLI) sits next to the Python that runs Snakemake (the venv).
shell.prefix(f"set -euo pipefail; export PATH=\"$PATH:{os.path.dirname(sys.executable)}\"; ")

PRETRAIN_DATASET = config["study"]["pretrain_dataset"]
FINETUNE_DATASET = config["study"]["finetune_dataset"]
DEMO_DIR = "data/demo/nih_demo"


wildcard_constraints:
    dataset="fashion_mnist|nih_demo|nih",
    part="[A-Za-z0-9_]+",
    file="[^/]+",


def n_demo_archives():
    d = config.get("demo_release", {})
    return math.ceil(d.get("n_images", 3000) / d.get("images_per_archive", 1000))


def source_of(dataset):
    return _sources.get_source(dataset, n_archives=n_demo_archives() if dataset == "nih_demo" else None)


def raw_files(dataset):
    return [f"data/raw/{dataset}/{name}" for name in _sources.file_names(source_of(dataset))]


def demo_release_files():
    names = _sources.file_names(source_of("nih_demo"))
    return [f"{DEMO_DIR}/{name}" for name in names] + [f"{DEMO_DIR}/SHA256SUMS"]


def download_inputs(wildcards):
    """The demo's 'remote' is the locally generated release; real sources need nothing local."""
    return [f"{DEMO_DIR}/SHA256SUMS"] if wildcards.dataset == "nih_demo" else []


def download_mirror(wildcards):
    if wildcards.dataset == "nih_demo":
        return DEMO_DIR
    return config["datasets"].get(wildcards.dataset, {}).get("mirror") or ""


def shard_config_json(wildcards):
    return json.dumps({**config["shards"][wildcards.dataset], "dataset": wildcards.dataset})


def split_inputs(wildcards):
    if wildcards.dataset == "fashion_mnist":
        return raw_files("fashion_mnist")
    base = f"data/raw/{wildcards.dataset}"
    return [f"{base}/Data_Entry_2017_v2020.csv", f"{base}/train_val_list.txt", f"{base}/test_list.txt"]


def part_inputs(wildcards):
    base = f"data/raw/{wildcards.dataset}"
    if wildcards.dataset == "fashion_mnist":
        from chexflow.data.fashion_mnist import PARTS
        return [f"{base}/{name}" for name in PARTS[wildcards.part]]
    return [f"{base}/{wildcards.part}.tar.gz", f"{base}/Data_Entry_2017_v2020.csv"]


def part_manifests(wildcards):
    parts = _shards.parts_of(wildcards.dataset, n_demo_archives())
    return [f"data/shards/{wildcards.dataset}/parts/{p}/manifest.json" for p in parts]


def manifest(dataset):
    return f"data/shards/{dataset}/manifest.json"


def train_config_json(stage):
    dataset = PRETRAIN_DATASET if stage == "pretrain" else FINETUNE_DATASET
    return json.dumps({**config[stage], "stage": stage, "dataset": dataset})


def stage_json(section):
    return json.dumps(config[section])
