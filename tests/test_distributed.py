"""Real multi-process training on CPU (gloo): Horovod and DDP ranks started by `chexflow launch`.

Covers: identical weights across ranks, Horovod == DDP loss curve for the same seed, kill -TERM /
kill -9 then rerun == uninterrupted run (bit-identical), a dead rank failing the job quickly,
rank 0 alone writing.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chexflow.train import checkpoint as ckpt
from conftest import REPO, checkpoint_step, cli_env, horovod_available, module_scratch, requires_horovod

pytestmark = pytest.mark.slow

BACKENDS = [pytest.param("horovod", marks=pytest.mark.skipif(not horovod_available(), reason="horovod not built")),
            "ddp"]


def train_cfg(backend: str, **over) -> dict:
    # the GPU path's branches forced on CPU: channels_last (Horovod refuses non-contiguous gradients;
    # the backend hands it dense copies) and DDP's per-device process group (NCCL needs a GPU, so
    # its CUDA half is gloo here); checks every 2 steps, at the checkpoints. The model: torchvision's
    # ShuffleNet v2 x0.5 (0.36 M parameters, 2 MiB checkpoints; ResNet-18's are 85 MiB), since ranks,
    # resume, checkpoints and hashing are the same code for every architecture; the tests of the
    # product's model itself (its stages, compile, learning, the GPU tests) pin resnet18
    cfg = {"stage": "finetune", "dataset": "nih_demo", "backend": backend, "epochs": 2, "batch_size": 8,
           "seed": 5, "init": "random", "model": {"arch": "shufflenet_v2_x0_5", "in_channels": 1},
           "channels_last": "always", "check_every_steps": 2,
           "ddp": {"process_group": "cpu:gloo,cuda:gloo", "timeout_s": 300},
           "horovod": {"stage_through_cpu": backend == "horovod"},
           "data": {"crop": 32, "workers": 0, "shuffle_buffer": 16},
           "optim": {"name": "sgd", "lr": 0.05, "reference_batch": 16},
           "schedule": {"warmup_epochs": 0.5, "decay": "cosine"},
           "checkpoint": {"every_steps": 2, "keep": 2}}
    for k, v in over.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and k in cfg else v
    return cfg


def start(backend, n, cfg, manifest, work: Path, tag: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "chexflow", "launch", "--backend", backend, "-n", str(n), "--",
           sys.executable, str(REPO / "tests/dist/train_dump.py"), "--config-json", json.dumps(cfg),
           "--manifest", str(manifest), "--out-dir", str(work / "out"), "--ckpt-dir", str(work / "ckpt"),
           "--dump", str(work / f"dump-{tag}")]
    log = open(work / f"{tag}.log", "w")
    return subprocess.Popen(cmd, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)


def run(backend, n, cfg, manifest, work: Path, tag: str = "run", timeout: float = 400) -> int:
    work.mkdir(parents=True, exist_ok=True)
    proc = start(backend, n, cfg, manifest, work, tag)
    code = proc.wait(timeout=timeout)
    return code


def weights(work: Path, tag: str, rank: int) -> dict:
    return torch.load(work / f"dump-{tag}" / f"rank{rank}.pt", weights_only=True)


def history(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_runs(demo_manifest, tmp_path_factory, request):
    """One uninterrupted 2-rank run per available backend (shared by several tests)."""
    with module_scratch(tmp_path_factory, request, "reference") as root:
        out = {}
        for backend in ("horovod", "ddp"):
            if backend == "horovod" and not horovod_available():
                continue
            work = root / backend
            work.mkdir()
            # the DDP run reads node-locally staged copies of the shards: same data, same curve
            over = {"data": {"stage_to": str(work / "node-local")}} if backend == "ddp" else {}
            code = run(backend, 2, train_cfg(backend, **over), demo_manifest, work)
            assert code == 0, (work / "run.log").read_text()[-3000:]
            out[backend] = work
        yield out


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_identical_across_ranks_and_rank0_alone_writes(reference_runs, backend):
    work = reference_runs[backend]
    w0, w1 = weights(work, "run", 0), weights(work, "run", 1)
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    info0 = json.loads((work / "dump-run" / "rank0.json").read_text())
    info1 = json.loads((work / "dump-run" / "rank1.json").read_text())
    assert info0["world"] == info1["world"] == 2
    assert info1["writes"] == [], "rank 1 must not write files"
    assert any(p.endswith("model.pt") for p in info0["writes"])
    h = history(work)
    assert [r["epoch"] for r in h] == [1, 2] and all(r["world_size"] == 2 for r in h)
    # every rank got rank 0's validation AUROC, which rank 0 alone computed: the other ranks never
    # import scikit-learn (1.7 CPU-s and 110 MiB each)
    assert info0["validations"] == info1["validations"] and len(info0["validations"]) == 2
    assert [v[1:] for v in info0["validations"]] == [[r["val_metric"], "mean_auroc"] for r in h]
    assert (info0["sklearn_imported"], info1["sklearn_imported"]) == (True, False)
    # a run that does not compile never imports TorchDynamo or Inductor on any rank (envs/patches/
    # torch-dynamo-import.md: torch.optim's wrappers; the trainer's deterministic flag), and is deterministic
    assert [info0["compiler_imported"], info1["compiler_imported"]] == [[], []]
    assert info0["deterministic"] and info1["deterministic"]
    # the saved model is rank 0's, selected on validation
    model = torch.load(work / "out" / "model.pt", weights_only=True)
    assert model["val_metric_name"] == "mean_auroc" and model["epoch"] in (1, 2)


def test_ddp_run_read_shards_staged_once_per_node(reference_runs, demo_manifest):
    work = reference_runs["ddp"]
    splits = json.loads(demo_manifest.read_text())["splits"]
    staged = sorted(p.name.split("-", 1)[1] for p in (work / "node-local" / "chexflow-shards").glob("*.tar"))
    expected = sorted(Path(s["path"]).name for split in ("train", "val") for s in splits[split]["shards"])
    assert staged == expected
    assert not list((work / "node-local").rglob("*.part"))
    assert "staged" in (work / "run.log").read_text()


def test_horovod_and_ddp_same_loss_curve(reference_runs):
    if "horovod" not in reference_runs:
        pytest.skip("horovod not built")
    h, d = history(reference_runs["horovod"]), history(reference_runs["ddp"])
    for a, b in zip(h, d):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4, abs=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-4, abs=1e-5)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    wh, wd = weights(reference_runs["horovod"], "run", 0), weights(reference_runs["ddp"], "run", 0)
    for k in wh:
        assert torch.allclose(wh[k], wd[k], rtol=1e-4, atol=1e-5), k


def rank_pids(work: Path) -> list[int]:
    """PIDs of the rank processes (not the launchers) of the run in ``work``."""
    out = subprocess.run(["pgrep", "-f", f"^\\S*python\\S* \\S*train_dump.py .*{work}"], capture_output=True,
                         text=True).stdout.split()
    return [int(p) for p in out]


def rank_pid(work: Path, rank: int) -> int:
    """PID of rank ``rank`` of the run in ``work`` (from the launcher's RANK/HOROVOD_RANK)."""
    for pid in rank_pids(work):
        env = dict(item.split("=", 1) for item in
                   Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        if env.get("HOROVOD_RANK", env.get("RANK")) == str(rank):
            return pid
    raise AssertionError(f"no process of rank {rank} in {work}")


def _ckpt_steps(work: Path) -> list[int]:
    d = work / "ckpt"
    return sorted(checkpoint_step(p) for p in ckpt.list_checkpoints(d))


def _wait_for_checkpoint(proc: subprocess.Popen, work: Path, step: int, log: str) -> None:
    """Until the run in ``work`` has a checkpoint at ``step`` or later (it must still be running then)."""
    deadline = time.time() + 300
    while time.time() < deadline and (not _ckpt_steps(work) or _ckpt_steps(work)[-1] < step):
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "run finished before it could be interrupted:\n" + (work / log).read_text()[-2000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_interrupted_twice_then_rerun_equals_uninterrupted(reference_runs, demo_manifest, tmp_path, backend):
    """A run stopped twice and rerun each time ends bit-identical to the uninterrupted one.

    1. kill -TERM to rank 1 (not rank 0): the ranks agree at the next check and all stop at one step,
       rank 0 writing the checkpoint although it never received the signal itself;
    2. the rerun resumes there; kill -9 to rank 0 (no checkpoint on the way out): the launcher fails
       the job quickly instead of hanging in a collective, and no rank outlives it;
    3. the second rerun resumes from the last periodic checkpoint and finishes."""
    seed = int(os.environ.get("CHEXFLOW_KILL_SEED") or time.time_ns() % 2**32)
    print(f"kill steps drawn with seed {seed} (rerun: CHEXFLOW_KILL_SEED={seed})")   # shown on failure
    first_at = random.Random(seed).choice([3, 5])
    work = tmp_path / "w"
    work.mkdir()
    proc = start(backend, 2, train_cfg(backend), demo_manifest, work, "first")
    _wait_for_checkpoint(proc, work, first_at - 2, "first.log")
    os.kill(rank_pid(work, 1), signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    assert not (work / "out" / "model.pt").exists(), "an interrupted run must not leave the declared output"
    assert "SIGTERM received: checkpoint written" in (work / "first.log").read_text()
    stopped = _ckpt_steps(work)[-1]

    proc = start(backend, 2, train_cfg(backend), demo_manifest, work, "second")
    _wait_for_checkpoint(proc, work, stopped + 4, "second.log")
    assert f"at step {stopped}" in (work / "second.log").read_text()            # resumed where TERM stopped it
    pids = rank_pids(work)
    assert len(pids) == 2
    t0 = time.time()
    os.kill(rank_pid(work, 0), signal.SIGKILL)
    code = proc.wait(timeout=90)
    elapsed = time.time() - t0
    assert code != 0 and not (work / "out" / "model.pt").exists()
    assert elapsed < 60, f"job took {elapsed:.0f}s to fail after a rank died"
    time.sleep(1)
    assert rank_pids(work) == [], "no rank may outlive the job"

    code = run(backend, 2, train_cfg(backend), demo_manifest, work, "third")
    log3 = (work / "third.log").read_text()
    assert code == 0, log3[-3000:]
    assert "resuming from" in log3
    ref = weights(reference_runs[backend], "run", 0)
    got = weights(work, "third", 0)
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs after kill -TERM, kill -9 and the reruns"
    hr, hw = history(reference_runs[backend]), history(work)
    assert [r["train_loss"] for r in hw] == pytest.approx([r["train_loss"] for r in hr], rel=1e-6)
    assert [r["val_loss"] for r in hw] == [r["val_loss"] for r in hr]


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_auroc_is_rank0s_on_every_rank_and_a_refusal_reaches_every_rank(tmp_path, backend):
    """Two real ranks validate hand-made scores: rank 0 alone computes the AUROC (the only rank that
    imports scikit-learn) and every rank returns it, equal to scikit-learn's over all 16 images; NaN
    scores on rank 1 are refused by rank 0 and every rank raises the same refusal (none is left waiting)."""
    from sklearn.metrics import roc_auc_score
    import numpy as np
    cmd = [sys.executable, "-m", "chexflow", "launch", "--backend", backend, "-n", "2", "--",
           sys.executable, str(REPO / "tests/dist/validate_ranks.py"), "--backend", backend, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert [r["sklearn_imported"] for r in ranks] == [True, False]
    assert ranks[0]["passes"] == ranks[1]["passes"]
    finite, nan = ranks[0]["passes"]
    rng = np.random.default_rng(7)                  # the rank script's scores, made again
    targets = (rng.random((16, 4)) < 0.4).astype(np.float32)
    scores = targets + rng.normal(0, 0.8, targets.shape).astype(np.float32)
    expected = np.mean([roc_auc_score(targets[:, j], scores[:, j]) for j in range(4)])
    assert finite["name"] == "mean_auroc" and finite["metric"] == pytest.approx(expected, abs=1e-12)
    assert nan == {"refused": "y_score is NaN where y_true is known"}


@requires_horovod
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks only: GPU ranks keep Horovod's own wait")
def test_a_horovod_rank_waiting_for_another_polls_instead_of_spinning(tmp_path):
    """Horovod's wait for a collective spins (its C++ loop polls the handle and only yields): a rank waiting
    while rank 0 was busy alone (hashing shards, writing a checkpoint, scoring validation) kept a core busy,
    the one rank 0 needed where CPU ranks share cores (a world of 4 on 2 cores hashing shards: 117 CPU s,
    59 with the polling). On the CPU chexflow's Horovod backend polls with sleeps in between
    (poll_while_waiting): the same results, and the waiting rank's thread uses a small part of the CPU
    Horovod's own wait uses (both measured here, in this run)."""
    keys = ("allreduce_cpu_s", "broadcast_cpu_s", "barrier_cpu_s")

    def run(tag: str, *extra: str) -> list[dict]:
        out = tmp_path / tag
        out.mkdir()
        cmd = [sys.executable, "-m", "chexflow", "launch", "--backend", "horovod", "-n", "2", "--", sys.executable,
               str(REPO / "tests/dist/wait_ranks.py"), "--out", str(out), "--wait", "1.0", *extra]
        proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]

    polled, spun = run("polled"), run("spun", "--spin")
    for ranks in (polled, spun):
        assert [r["mean"] for r in ranks] == [0.5, 0.5] and [r["object"] for r in ranks] == [{"from": 0}] * 2
    polling, spinning = (sum(ranks[1][k] for k in keys) for ranks in (polled, spun))
    print(f"rank 1's CPU in 3 waits of 1 s: {polling:.3f} s polling, {spinning:.3f} s in Horovod's own wait")
    assert polling < 0.25 * spinning
