"""The GPU path on a real GPU (marker ``gpu``; skipped where CUDA is not available).

Run by ``bench/gpu_check.sh`` on a GPU machine (``pytest -m gpu tests/test_gpu.py``). What runs on
CPU is proven by test_trainer_paths.py and test_distributed.py with the GPU branches forced; this
module covers what only a GPU shows:

* a CUDA run with channels_last + bf16 that resumes: the optimizer state lands on the GPU;
* torch.compile on CUDA;
* two ranks sharing the one GPU, per backend, with a kill -9 of one rank and a resume: DDP over a
  per-device gloo group (NCCL refuses two ranks on one device), Horovod with its allreduce
  staged through host memory (same reason);
* one rank through NCCL (DDP's auto group ``cpu:gloo,cuda:nccl``): CUDA parameters broadcast by
  NCCL, CPU flags and objects by gloo;
* ``init: file`` on CUDA: a torchvision-format file (read on the CPU, folded) loaded into a
  channels_last bf16 model on the GPU, which trains from it.
On one GPU the results are not bit-identical across a resume (cuDNN kernels are not deterministic),
so these tests check placement, exit codes, the resume point, agreement between ranks and finite,
close losses.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch
import torchvision

from chexflow.settings import from_dict
from chexflow.train.config import TrainConfig
from chexflow.train import checkpoint as ckpt
from chexflow.train import trainer as T
from chexflow.train.backends import Backend
from conftest import horovod_available
from test_distributed import _ckpt_steps, history, rank_pid, run, start, weights
from test_distributed import train_cfg as _train_cfg
from test_init_file import _torchvision_file

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def train_cfg(backend: str, **over) -> dict:
    """The distributed tests' run on the product's model, ResNet-18 (theirs is a smaller one): the GPU
    path as it ran on an H200."""
    return _train_cfg(backend, **{"model": {"arch": "resnet18"}, **over})


def _cfg(**over) -> TrainConfig:
    gpu = {"epochs": 2, "channels_last": "always", "precision": "bf16", "checkpoint": {"every_steps": 3, "keep": 5}}
    return from_dict(TrainConfig, train_cfg("single", **{**gpu, **over}))


def _trainer(cfg, manifest, tmp_path) -> T.Trainer:
    return T.Trainer(cfg, T.TrainPaths(manifest=manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt"),
                     Backend())


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_cuda_resume_puts_optimizer_state_on_the_gpu_and_finishes(demo_manifest, tmp_path, optim):
    """With the fused kernels (the default; Adam's fused step also keeps its step count on the GPU)."""
    over = {"optim": {"name": optim, "lr": 0.05 if optim == "sgd" else 1e-3}}
    first = _trainer(_cfg(max_steps=3, **over), demo_manifest, tmp_path)
    assert first.device.type == "cuda" and first.channels_last and first.bf16
    assert first.fit() == 0
    assert first.model.layer1[0].conv1.weight.is_contiguous(memory_format=torch.channels_last)
    for f in (tmp_path / "out").iterdir():
        f.unlink()
    t = _trainer(_cfg(max_steps=6, **over), demo_manifest, tmp_path)
    model, opt, sched = t._build()
    prog = t._restore(model, opt, sched)
    assert prog.step == 3 or prog.epoch == 1
    for group in opt.param_groups:
        assert group["fused"] is True
        for p in group["params"]:
            assert p.device.type == "cuda"
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor) and v.dim():
                    assert v.device == p.device, "optimizer state must live next to its parameter"
    # and the step that failed before (device mismatch in opt.step) now runs to the end
    assert _trainer(_cfg(max_steps=6, **over), demo_manifest, tmp_path).fit() == 0
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 6 and row["train_loss"] == row["train_loss"]


def test_compile_on_cuda(demo_manifest, tmp_path):
    t = _trainer(_cfg(max_steps=4, epochs=1, compile=True), demo_manifest, tmp_path)
    assert t.fit() == 0
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert not any(k.startswith("_orig_mod") for k in saved["state_dict"]), "saved without the compile wrapper"


def _why(log) -> str:
    """A failed multi-rank run's log, shortened: every rank's error lines, then the tail (one rank's
    traceback alone hides the rank that died first)."""
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if re.search(r"(Error|error|exitcode)", line)]
    return "\n".join(errors[-30:]) + "\n--- tail ---\n" + text[-2000:]


def _two_rank_cfg(backend: str) -> dict:
    # two ranks on one GPU: DDP over gloo for both devices, Horovod staged through host memory
    return train_cfg(backend, precision="auto", horovod={"stage_through_cpu": True},
                     ddp={"process_group": "cpu:gloo,cuda:gloo", "timeout_s": 300})


@pytest.mark.parametrize("backend", [
    pytest.param("horovod", marks=pytest.mark.skipif(not horovod_available(), reason="horovod not built")),
    "ddp"])
def test_two_ranks_share_the_gpu_kill9_and_resume(demo_manifest, tmp_path, backend):
    ref = tmp_path / "ref"
    assert run(backend, 2, _two_rank_cfg(backend), demo_manifest, ref) == 0, _why(ref / "run.log")
    w0, w1 = weights(ref, "run", 0), weights(ref, "run", 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks disagree"
    work = tmp_path / "w"
    work.mkdir()
    proc = start(backend, 2, _two_rank_cfg(backend), demo_manifest, work, "first")
    deadline = time.time() + 300
    while time.time() < deadline and (not _ckpt_steps(work) or _ckpt_steps(work)[-1] < 4) and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, (work / "first.log").read_text()[-2000:]
    os.kill(rank_pid(work, 1), signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    assert run(backend, 2, _two_rank_cfg(backend), demo_manifest, work, "second") == 0, _why(work / "second.log")
    log = (work / "second.log").read_text()
    assert "resuming from" in log and "device cuda" in log and "channels_last" in log
    g0, g1 = weights(work, "second", 0), weights(work, "second", 1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0), "ranks disagree after the resume"
    assert g0["conv1.weight"].device.type == "cpu"       # dumped to CPU by the test rank script
    h_ref, h = history(ref), history(work)
    assert [r["epoch"] for r in h] == [1, 2]
    assert h[-1]["train_loss"] == pytest.approx(h_ref[-1]["train_loss"], rel=0.1)


def test_ddp_nccl_group_carries_cuda_and_cpu_tensors(demo_manifest, tmp_path):
    cfg = train_cfg("ddp", epochs=1, precision="auto", ddp={"process_group": "auto", "timeout_s": 300})
    assert run("ddp", 1, cfg, demo_manifest, tmp_path) == 0, _why(tmp_path / "run.log")
    assert [r["epoch"] for r in history(tmp_path)] == [1]
    assert ckpt.list_checkpoints(tmp_path / "ckpt")


def test_init_file_on_cuda_trains_from_the_files_weights(demo_manifest, tmp_path, capfd):
    path = tmp_path / "resnet18-imagenet.pth"
    sd = _torchvision_file(path, "resnet18", drop_counts=True)
    t = _trainer(_cfg(max_steps=2, epochs=1, init="file", init_file=str(path)), demo_manifest, tmp_path)
    assert t.device.type == "cuda" and t.channels_last and t.bf16
    assert t.fit() == 0
    assert f"initialised 120 backbone tensors from {path} (of its 122;" in "".join(capfd.readouterr())
    trained = ckpt.load_model_file(tmp_path / "out" / "model.pt")["state_dict"]["layer4.1.conv2.weight"].cpu()
    start_w = sd["layer4.1.conv2.weight"]
    torch.manual_seed(123)
    fresh = torchvision.models.resnet18(weights=None).state_dict()["layer4.1.conv2.weight"]
    assert (trained.float() - start_w).norm() < 0.1 * (fresh - start_w).norm()
