"""bench/scale_model.py's model (bench/scale_terms.py on bench/scale_clusters.py's figures), against cases
worked out on paper from the NCCL releases' tuning.cc, and its tables. (Its measurements run chexflow for
minutes: docs/scaling.md records them; bench/first_step.py, which they use, is run by
tests/test_verify_world.py.)"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import scale_clusters as SC  # noqa: E402
import scale_terms as ST  # noqa: E402

JUWELS, ALPS = SC.JUWELS_BOOSTER, SC.ALPS_GH200
INPUTS = json.loads((ROOT / "bench/results/scale_inputs-20261128-cpu.json").read_text())


def test_each_cluster_names_a_source_for_every_constant():
    for cluster in SC.CLUSTERS:
        for name, figure in cluster.figures.items():
            assert figure.source and figure.kind, (cluster.name, name)
            assert figure.value is not None or "no " in figure.source or name == "nccl_version", (cluster.name, name)
    assert "v2.22.3-1" in JUWELS.nccl.source and "v2.29.2-1" in ALPS.nccl.source


def test_the_channel_speed_is_the_fastest_of_the_search_that_a_25_GBps_rail_carries():
    assert ST.channel_GBps(JUWELS) == 24.0 == ST.channel_GBps(ALPS)


def test_ring_over_200_nodes_with_nccl_2_22_3_on_amd_hosts():
    """800 A100 on 200 nodes, 16 MiB: 1,598 steps, 2 x 200 of them between nodes (2.22's count); an
    intra-node step costs max(3.4, 3 x 2.0 us of AMD network overhead) = 6 us: (8.4 + 1,198 x 6 + 400 x 14)
    x 1.4 = 17,914.96 us; bus 4 rails x 24 GB/s, algorithm bandwidth x 800 / 1,598."""
    nbytes = 2 ** 24
    expected = (8.4 + 1198 * 6.0 + 400 * 14.0) * 1.4e-6 + nbytes / (96e9 * 800 / 1598)
    assert ST.ring_allreduce_s(JUWELS, nbytes, 800) == pytest.approx(expected, rel=1e-12)


def test_ring_over_200_nodes_with_nccl_2_29_2_on_grace_hosts():
    """2.29 counts 2 x (200 - 1) inter-node steps; Grace's overhead 3 x 1.0 us is below NVLink's 3.4 us."""
    nbytes = 2 ** 24
    expected = (8.4 + 1200 * 3.4 + 398 * 14.0) * 1.4e-6 + nbytes / (96e9 * 800 / 1598)
    assert ST.ring_allreduce_s(ALPS, nbytes, 800) == pytest.approx(expected, rel=1e-12)


def test_ring_on_one_node_runs_over_nvlink_without_plateau():
    """4 GPUs: 6 steps of 3.4 us after 8.4 us; NVLink's 300 GB/s per direction x 4 / 6."""
    expected = (8.4 + 6 * 3.4) * 1e-6 + 1e8 / (300e9 * 4 / 6)
    assert ST.allreduce_s(JUWELS, 1e8, 4) == pytest.approx(expected, rel=1e-12)
    assert ST.tree_allreduce_s(JUWELS, 1e8, 4) is None and ST.allreduce_s(JUWELS, 1e8, 1) == 0.0


def test_tree_over_200_nodes_with_the_ampere_cap_and_the_size_correction():
    """2.22.3: 2 x (3 hops x 28 + floor(log2 200) = 7 levels x 28) = 560 us; bus min(0.92 x 96, 4 x 17.8)
    = 71.2 GB/s, half of it, x 0.7 (treeCorrectionFactor[Simple][log2(2^24 / 64) = 18])."""
    nbytes = 2 ** 24
    expected = 560e-6 + nbytes / (71.2e9 * 0.5 * 0.7)
    assert ST.tree_allreduce_s(JUWELS, nbytes, 800) == pytest.approx(expected, rel=1e-12)
    assert ST.allreduce_s(JUWELS, nbytes, 800) == pytest.approx(expected, rel=1e-12)   # faster than the ring


def test_tree_on_two_hopper_nodes_is_bound_by_the_rails_not_the_cap():
    """2.29.2: 8.4 + 2 x (3 x 4.0 + 1 x 14) = 60.4 us; min(0.92 x 96, 4 x 41.4) = 88.32 GB/s; 128 MiB is
    index 21 of the correction (0.9)."""
    nbytes = 128 * 2 ** 20
    expected = 60.4e-6 + nbytes / (88.32e9 * 0.5 * 0.9)
    assert ST.tree_allreduce_s(ALPS, nbytes, 8) == pytest.approx(expected, rel=1e-12)


def test_a_step_allreduces_the_fp32_gradients_in_25_MB_buckets():
    """25,550,760 parameters: 102.2 MB of gradients, 5 buckets of a fifth each."""
    params = INPUTS["parameters"]["resnet50"]
    bucket = 4 * params / 5
    assert ST.step_network_s(JUWELS, params, 800) == pytest.approx(5 * ST.allreduce_s(JUWELS, bucket, 800))


def test_the_gpu_step_never_falls_below_the_floor():
    assert ST.step_gpu_s(JUWELS, 256) == pytest.approx(256 / 2470)
    assert ST.step_gpu_s(JUWELS, 10) == pytest.approx(32 / 1148.2) == ST.step_gpu_s(ALPS, 10)
    assert ST.step_gpu_s(ALPS, 256) == pytest.approx(256 / 4125.6)


def test_a_workers_batch_time_is_measured_at_three_batches_and_linear_between():
    t32, t64, t256 = (b * 14 / r for b, r in ((32, 14216.6), (64, 16747.9), (256, 33680.3)))
    assert ST.worker_batch_s(32) == pytest.approx(t32) and ST.worker_batch_s(256) == pytest.approx(t256)
    assert ST.worker_batch_s(128) == pytest.approx(t64 + 64 * (t256 - t64) / 192)
    assert ST.worker_batch_s(10) == pytest.approx(t32 - 22 * (t64 - t32) / 32)     # the first segment, extended
    assert ST.step_loader_s(256, 4) == pytest.approx(t256 / 4)
    # 106.4 ms per batch of 256 against the A100's 103.6 ms step: one worker is not enough, two are
    assert ST.workers_needed(JUWELS, 256) == math.ceil(t256 / (256 / 2470)) == 2


def test_the_file_system_serves_the_smaller_of_its_aggregate_and_the_nodes_links():
    assert ST.read_GBps(ALPS, 2) == 200 and ST.read_GBps(ALPS, 200) == 782
    assert ST.read_GBps(JUWELS, 200) is None                 # JUST publishes no aggregate
    assert ST.step_file_system_s(ALPS, 800, 32, 69120) == pytest.approx(800 * 32 * 69120 / 782e9)


def test_a_start_before_read_the_split_once_per_node_while_it_fits_the_page_cache():
    assert ST.start_before_bytes(ALPS, 88e9, 800) == 200 * 88e9            # ImageNet: 88 GB < 480 GB a node
    assert ST.start_before_bytes(ALPS, 500e9, 800) == 800 * 500e9          # more than a node's memory
    imagenet = SC.DATASETS["ImageNet 256 px"]
    start = ST.start_terms(ALPS, imagenet, 800, INPUTS)
    split = (1_281_167 + 50_000) * 69120
    assert start["before_bytes"] == pytest.approx(200 * split)             # 18.4 TB, not 800 x 92 GB
    assert start["before_read_s"] == pytest.approx(200 * split / 782e9)
    assert start["before_hash_s"] == pytest.approx(split / (INPUTS["sha256_MBps_core"] * 1e6))


def test_every_rank_opens_and_stats_every_shard_once_per_start():
    """ImageNet at 2,000 samples per shard: 641 train + 25 val shards; x 800 ranks x 2 operations."""
    imagenet = SC.DATASETS["ImageNet 256 px"]
    assert ST.split_shards(imagenet) == 666
    assert ST.metadata_operations(imagenet, 800) == 1_065_600
    assert ST.start_terms(ALPS, imagenet, 800, INPUTS)["metadata_s"] == pytest.approx(1_065_600 / 214_000)


def test_young_daly_interval_and_its_overhead():
    """800 GPUs fail every 54 x 24 x 16,384 / 419 / 800 h = 63.35 h; a 0.75 s write: sqrt(2 x 0.75 x
    228,048 s) = 584.9 s, where the write's share and half an interval redone are equal."""
    mtbf = ST.job_mtbf_s(ALPS, 800)
    assert mtbf == pytest.approx(54 * 24 * 16384 / 419 / 800 * 3600)
    interval = ST.young_daly_s(0.75, mtbf)
    assert interval == pytest.approx(math.sqrt(1.5 * mtbf))
    assert ST.checkpoint_overhead(0.75, interval, mtbf) == pytest.approx(math.sqrt(2 * 0.75 / mtbf))
    assert ST.checkpoint_overhead(0.75, 10.0, mtbf) == pytest.approx(0.075 + 10 / (2 * mtbf))


def test_an_epoch_shorter_than_the_interval_sets_it():
    """The trainer writes at every epoch's end: 160 steps of 27.9 ms (4.5 s) instead of 585 s."""
    mtbf = 228_000.0
    terms = ST.checkpoint_terms(mtbf, 0.0279, 160, 0.75)
    assert terms["interval_steps"] == 160
    assert terms["overhead"] == pytest.approx(0.75 / (160 * 0.0279) + 160 * 0.0279 / (2 * mtbf))
    assert terms["overhead_every_steps"] == pytest.approx(0.75 / (50 * 0.0279) + 50 * 0.0279 / (2 * mtbf))
    long_epoch = ST.checkpoint_terms(mtbf, 0.1, 100_000, 0.75)
    assert long_epoch["interval_steps"] == round(ST.young_daly_s(0.75, mtbf) / 0.1)


def test_the_step_is_bound_by_its_longest_term_and_unknown_terms_are_left_out():
    assert ST.bound({"GPU": 0.03, "network": 0.01, "loader": None, "file system": 0.02}) == ("GPU", 0.03, 1.5)
    row = ST.model_row(ALPS, SC.DATASETS["ImageNet 256 px"], 800, 10, INPUTS)
    assert row["global_batch"] == 8000 and row["steps_per_epoch"] == 1_281_167 // 8000
    assert row["bound"] == "GPU" and row["step_s"] == pytest.approx(32 / 1148.2)
    none = ST.model_row(ALPS, SC.DATASETS["NIH 1024->256 px"], 800, 256, INPUTS)
    assert none["steps_per_epoch"] == 0 and "terms" not in none


def test_the_model_checks_itself_against_cscs_measured_allreduce():
    """all_reduce_perf, 128 MiB over 2 GH200 nodes: 1,916.4 us measured; the model within a factor 1.5."""
    model = ST.allreduce_s(ALPS, 128 * 2 ** 20, 8)
    assert 1 < model / 1916.4e-6 < 1.5


def test_the_script_prints_the_committed_model_with_no_argument_and_given_inputs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale_model.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for cluster in SC.CLUSTERS:
        for name in cluster.figures:
            assert f"| {name} |" in out
        assert f"NCCL {cluster.nccl.version}" in out
    assert "| CSCS Alps (GH200) | ImageNet 256 px | 800 (200) | 10 | SGD (8,000: Goyal et al.) | 160 |" in out
    assert "| JUWELS Booster | ImageNet 256 px | 800 (200) | 666 |" in out and "1,065,600" in out
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({**INPUTS, "sha256_MBps_core": 1e9}))
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "scale_model.py"), "--inputs", str(inputs)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "sha256: 1000000000 MB/s" in again.stdout
