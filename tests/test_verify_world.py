"""What each rank reads before its first step, counted in bytes (``rchar`` of /proc/<pid>/io, as
the kernel counts every byte read(2) returns), on real ranks: 4 Horovod or DDP ranks started by
`chexflow launch`, training on the demo's shards with a stamp store. Each shard is hashed by one
rank of the world, the one that reads it first, so no rank reads more than its own first epoch's
shards (plus those no rank reads in the first epoch); a requeue hashes nothing: only rank 0 reads,
the checkpoint and the stamps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chexflow.data import epoch_plan as EP
from chexflow.data import manifest as MF
from chexflow.data.stamps import StampStore
from chexflow.train.checkpoint import load_pt
from conftest import REPO, checkpoint_step, cli_env, horovod_available
from test_distributed import train_cfg
from test_stamps import rchar

pytestmark = pytest.mark.slow

BACKENDS = [pytest.param("horovod", marks=pytest.mark.skipif(not horovod_available(), reason="horovod not built")),
            "ddp"]
WORLD = 4
# what a rank may read besides shards, manifest and checkpoint: /proc/self/io itself (~110 bytes a look),
# a module torch imports when it first unpickles (~2.5 KiB); rank 0 also /proc/stat (the lease's psutil
# reads it for the boot time: ~150 bytes per core) and its own /proc/<pid>/stat
SLACK = 8192
LEASE = len(Path("/proc/stat").read_bytes()) + 1024
MANIFEST_READS = 4      # TrainData.build reads it three times (read_manifest, two split_shards), the run id once


def launch(backend: str, manifest: Path, work: Path, tag: str, max_steps: int) -> tuple[list[dict], str]:
    cfg = train_cfg(backend, epochs=1, max_steps=max_steps)
    cmd = [sys.executable, "-m", "chexflow", "launch", "--backend", backend, "-n", str(WORLD), "--",
           sys.executable, str(REPO / "bench/first_step.py"), "--config-json", json.dumps(cfg),
           "--manifest", str(manifest), "--out-dir", str(work / "out"), "--ckpt-dir", str(work / "ckpt"),
           "--verified", str(work / "verified"), "--record", str(work / tag)]
    # warnings off: Python reads a warning's source file to show its line, bytes that are not this test's
    proc = subprocess.run(cmd, env={**cli_env(), "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                          timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    return [json.loads((work / tag / f"rank{r}.json").read_text()) for r in range(WORLD)], log


def first_epoch_shares(manifest: Path) -> tuple[list[set[str]], set[str], dict[str, int]]:
    """The shard files each rank reads in its first epoch (training as train_cfg plans it, then its
    slice of validation), the files no rank reads then, and every file's size."""
    train, val = MF.split_shards(manifest, "train"), MF.split_shards(manifest, "val")
    cfg = train_cfg("ddp")
    shares = []
    for r in range(WORLD):
        runs = EP.plan_epoch(train, rank=r, world=WORLD, epoch=0, seed=cfg["seed"], batch_size=cfg["batch_size"]) + \
            EP.plan_epoch(val, rank=r, world=WORLD, epoch=0, seed=cfg["seed"], batch_size=cfg["batch_size"],
                         shuffle=False)
        shares.append({path for run in runs for path, _, _ in run.pieces})
    sizes = {s.path: os.path.getsize(s.path) for s in train + val}
    return shares, set(sizes) - set().union(*shares), sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_shard_is_hashed_once_in_the_world_and_a_requeue_hashes_none(demo_manifest, tmp_path, backend):
    shares, unread, sizes = first_epoch_shares(demo_manifest)
    total, n = sum(sizes.values()), len(sizes)
    assert WORLD * max(sum(sizes[p] for p in share) for share in shares) < WORLD * total   # (a share is not the split)

    first, log = launch(backend, demo_manifest, tmp_path, "first", max_steps=1)
    assert f"{n} shards checked against the manifest's sha256: {n} hashed ({total / 2**20:.1f} MiB, each by one " \
           "rank), 0 unchanged since their stamps" in log
    for r, rec in enumerate(first):
        bound = sum(sizes[p] for p in shares[r] | unread) + (LEASE if r == 0 else 0)
        assert rec["fit"] <= bound + SLACK, (r, rec, bound)
        assert rec["trainer"] <= bound + MANIFEST_READS * demo_manifest.stat().st_size + SLACK, (r, rec)
    # every shard hashed, by one rank only: the world read the split once, not WORLD times
    assert total <= sum(rec["fit"] for rec in first) <= total + WORLD * SLACK + LEASE

    again, log = launch(backend, demo_manifest, tmp_path, "requeue", max_steps=2)
    assert "resuming from" in log
    assert f"{n} shards checked against the manifest's sha256: 0 hashed (0.0 MiB, each by one rank), {n} unchanged " \
           "since their stamps" in log
    smallest = min(sizes.values())
    for rec in again[1:]:
        assert rec["fit"] <= SLACK < smallest, rec
    # rank 0 reads the stamps and the checkpoint, what loading it costs here (its data once, its zip
    # directory and entry headers again: measured by loading it in this process)
    ckpt = next(p for p in (tmp_path / "ckpt").glob("step-*.pt") if checkpoint_step(p) == 1)
    load_pt(ckpt)
    before = rchar()
    load_pt(ckpt)
    loading = rchar() - before
    assert ckpt.stat().st_size <= loading
    stamps = StampStore(tmp_path / "verified", demo_manifest).path
    assert again[0]["fit"] <= loading + stamps.stat().st_size + LEASE + SLACK, again[0]
