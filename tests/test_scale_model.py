"""bench/scale_model.py's model, against cases worked out on paper, and its table from given inputs.
(Its measurements run chexflow for minutes: docs/scaling.md records them; bench/first_step.py,
which they use, is run by tests/test_verify_world.py.)"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scale_model", ROOT / "bench" / "scale_model.py")
SM = sys.modules["scale_model"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SM)

# inputs as --measure writes them, round numbers (a case to work by hand, not this machine's)
INPUTS = {"host": "paper", "cpu": "x", "cores": 2, "torch": "-", "date": "-", "device": "cpu",
          "split_bytes": 1 << 20, "split_shards": 4, "manifest_bytes": 1000,
          "first_step": {"4": {"fresh": {"bytes": [262144, 262144, 262144, 262144], "fit_bytes": [0] * 4,
                                         "seconds": 9.0},
                               "requeue": {"bytes": [4096, 100, 100, 100], "fit_bytes": [0] * 4, "seconds": 8.0}}},
          "sha256_MBps_core": 1e9, "checkpoint_resnet50": {"bytes": 200e6, "write_s_local": 1.0},
          "parameters": {"resnet50": 25_000_000, "densenet121": 8_000_000},
          "shard_stage": {"images": 40, "img_per_core_s": 10.0, "bytes_per_image_256": 1e5},
          "eval_img_s_resnet50_224": 5.0}


def test_allreduce_time_is_nccls_model_for_two_nodes():
    """8 GPUs on 2 nodes, 100 MB: ring 2*7 steps, 2 of them between nodes; latency (8.4 + 12 * 3.4 +
    2 * 9.6) us x 1.9 = 129.96 us; bandwidth 25 GB/s x 8 / 14; the tree is slower (268 us + 100 MB /
    11.25 GB/s), so the ring's time is the answer."""
    ring = 129.96e-6 + 1e8 / (25e9 * 8 / 14)
    assert SM.allreduce_s(1e8, 8) == pytest.approx(ring, rel=1e-12)
    assert ring < 268e-6 + 1e8 / 11.25e9
    assert SM.allreduce_s(1e8, 1) == 0.0


def test_allreduce_over_200_nodes_takes_the_tree():
    """800 GPUs: the ring's 1,598 steps cost (8.4 + 1,200 * 3.4 + 398 * 9.6) x 1.9 us = 15.0 ms of latency
    alone; the tree 2 * (3 * 28 + log2(200) * 50) us + 100 MB / 11.25 GB/s."""
    tree = 2 * (3 * 28 + math.log2(200) * 50) * 1e-6 + 1e8 / 11.25e9
    assert SM.allreduce_s(1e8, 800) == pytest.approx(tree, rel=1e-12)
    assert SM.step_comm_s(25_000_000, 800, bucket_mb=25) == pytest.approx(4 * SM.allreduce_s(25e6, 800), rel=1e-12)


def test_a_start_now_reads_the_split_once_where_every_rank_read_it_before():
    """Hashing faster than the file system: before, G ranks read the split G times through it; now once."""
    data = {"train": 1_000_000, "val": 0, "test": 0}
    for gpus in (8, 64, 800):
        row = SM.model_row("x", data, gpus, INPUTS)
        assert row["first_step_before_s"] == pytest.approx(gpus * row["first_step_fresh_s"], rel=1e-12)
        # 1e11 bytes over min(500 GB/s, nodes x 25 GB/s)
        assert row["first_step_fresh_s"] == pytest.approx(1e11 / (min(500, SM.nodes(gpus) * 25) * 1e9), rel=1e-12)


def test_the_epoch_names_its_bound_and_a_too_small_split_has_no_step():
    row = SM.model_row("x", {"train": 1_000_000, "val": 0, "test": 0}, 8, INPUTS)
    steps = 1_000_000 // (8 * 256)
    gpu = steps * 256 / 3970
    assert row["steps_per_epoch"] == steps and row["bound"].startswith("GPU (") and row["epoch_s"] == pytest.approx(gpu)
    # the others as shares of it: the training images' bytes over 2 nodes x 25 GB/s; 1e6 / (2 x 33,680 img/s)
    assert f"file system {100 * 1e11 / 50e9 / gpu:.0f}%" in row["bound"]
    assert f"loader {100 * 1e6 / (2 * 33680) / gpu:.0f}%" in row["bound"]
    assert row["checkpoint_overhead"] == pytest.approx(200e6 / 25e9 / (50 * gpu / steps))
    # fewer steps per epoch than every_steps: a checkpoint at every epoch's end, half an epoch lost per requeue
    short = SM.model_row("x", {"train": 10 * 800 * 256, "val": 0, "test": 0}, 800, INPUTS)
    step = short["epoch_s"] / 10
    assert short["checkpoint_overhead"] == pytest.approx(200e6 / 25e9 / (10 * step))
    assert short["requeue_s"] == pytest.approx(5 * step + short["first_step_requeue_s"])
    none = SM.model_row("x", {"train": 1000, "val": 0, "test": 0}, 800, INPUTS)
    assert none["steps_per_epoch"] == 0 and none["bound"].startswith("no step")


def test_the_script_prints_the_tables_from_given_inputs(tmp_path):
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps(INPUTS))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale_model.py"), "--inputs", str(inputs)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "| 4 | fresh | 0.00 (0.00), 0.00 (0.00), 0.00 (0.00), 0.00 (0.00) | 0.25, 0.25, 0.25, 0.25 | 9.0 |" in out
    assert "| NIH 1024->256 px | 800 (200) | 204,800 | 0 |" in out and "no step" in out
    rows = [line for line in out.splitlines() if line.startswith("| ImageNet 256 px |")]
    assert [line.split(" | ")[1] for line in rows] == ["1 (1)", "8 (2)", "64 (16)", "800 (200)"]
    for name, figure in SM.CONSTANTS.items():
        assert f"| {name} | {figure.value:g} {figure.unit} | {figure.kind} |" in out
