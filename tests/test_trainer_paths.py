"""The trainer's GPU-path branches and resume rules, exercised in one CPU process (backend single):
device placement of a restored optimizer state, channels_last/bf16/compile forced on CPU, LR scaling
with accumulated backward passes, frozen BatchNorm statistics, host checks every N steps, and a
resume on another world size. Multi-rank behaviour is in test_distributed.py; CUDA in test_gpu.py.
"""
from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from chexflow import host
from chexflow.data.manifest import split_shards
from chexflow.data.stamps import StampStore
from chexflow.settings import from_dict
from chexflow.train.config import TrainConfig
from chexflow.train import checkpoint as ckpt
from chexflow.train import identity
from chexflow.train import trainer as T
from chexflow.train.backends import Backend
from chexflow.train.schedule import lr_at
from conftest import horovod_available
from test_distributed import train_cfg

# the meta device stands in for a GPU; loading real tensors into it warns per tensor
pytestmark = pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter:UserWarning")


def cfg_of(**over) -> TrainConfig:
    """The multi-rank tests' config on one process, with the CPU defaults (no GPU branch forced), on the
    product's model (ResNet-18: its stages, its compiled graph, its learning)."""
    base = {"seed": 3, "channels_last": "auto", "check_every_steps": 20, "checkpoint": {"every_steps": 2, "keep": 5},
            "model": {"arch": "resnet18"}}
    return from_dict(TrainConfig, train_cfg("single", **{**base, **over}))


def trainer(cfg, manifest, tmp_path, device=None, backend=None) -> T.Trainer:
    paths = T.TrainPaths(manifest=manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt")
    return T.Trainer(cfg, paths, backend or Backend(), device=device)


@pytest.mark.slow
def test_restored_optimizer_state_lives_on_the_parameters_device(demo_manifest, tmp_path):
    """Resume on GPU failed: the state was loaded while the parameters were still on the CPU. The
    model is now placed first; the 'meta' device stands in for a second device on this machine."""
    cfg = cfg_of(max_steps=2, epochs=1)
    assert trainer(cfg, demo_manifest, tmp_path).fit() == 0
    assert ckpt.list_checkpoints(tmp_path / "ckpt"), "no checkpoint to resume from"
    t = trainer(cfg, demo_manifest, tmp_path, device=torch.device("meta"))
    model, opt, sched = t._build()
    prog = t._restore(model, opt, sched)
    assert prog.step == 2
    states = [opt.state[p] for g in opt.param_groups for p in g["params"] if opt.state[p]]
    assert states, "SGD with momentum must have a state after two steps"
    for g in opt.param_groups:
        for p in g["params"]:
            assert p.device.type == "meta"
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor) and v.dim():
                    assert v.device == p.device


@pytest.mark.slow
def test_channels_last_bf16_forced_on_cpu_train_and_save_standard_layout(demo_manifest, tmp_path):
    cfg = cfg_of(max_steps=3, epochs=1, channels_last="always", precision="bf16")
    t = trainer(cfg, demo_manifest, tmp_path)
    assert t.channels_last and t.bf16
    assert t.fit() == 0
    conv = t.model.layer1[0].conv1.weight          # 64 input channels: the layouts differ
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)["state_dict"]["layer1.0.conv1.weight"]
    assert saved.is_contiguous(), "model files hold the standard layout"
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["train_loss"] == row["train_loss"] and row["train_loss"] > 0    # finite
    # where it was measured: this process's host, in the epoch's row and in the model file
    assert row["host"] == host.describe(backend="single", world_size=1)
    assert torch.load(tmp_path / "out" / "model.pt", weights_only=True)["host"] == row["host"]
    # auto keeps CPU runs in the standard format and fp32
    auto = trainer(cfg_of(), demo_manifest, tmp_path / "auto")
    assert not auto.channels_last and not auto.bf16


@pytest.mark.slow
def test_lr_scaled_for_accumulated_backward_passes(demo_manifest, tmp_path):
    """LR follows the global batch batch x passes x ranks (the log printed it, the schedule ignored it)."""
    one = trainer(cfg_of(), demo_manifest, tmp_path / "a")
    two = trainer(cfg_of(horovod={"backward_passes_per_step": 2}), demo_manifest, tmp_path / "b")
    assert two.global_batch == 2 * one.global_batch == 16
    _, opt, sched = two._build()
    warm = int(round(0.5 * two.steps_per_epoch))
    for _ in range(warm):
        opt.step()
        sched.step()
    # 0.05 x (8 x 2 passes x 1 rank) / 16 = 0.05 at the end of warmup (0.025 without the passes)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.param_groups[0]["lr"] == pytest.approx(
        lr_at(warm, optim=two.cfg.optim, sched=two.cfg.schedule, batch_size=16, world=1,
              steps_per_epoch=two.steps_per_epoch, epochs=2))


@pytest.mark.slow
def test_frozen_stages_keep_weights_and_batchnorm_statistics(demo_manifest, tmp_path):
    cfg = cfg_of(max_steps=4, epochs=1, freeze=2)        # conv1, bn1
    t = trainer(cfg, demo_manifest, tmp_path)
    torch.manual_seed(cfg.seed)
    assert t.fit() == 0
    init = trainer(cfg, demo_manifest, tmp_path / "init")
    model, _, _ = init._build()
    trained = t.model
    assert torch.equal(trained.conv1.weight, model.conv1.weight)
    assert torch.equal(trained.bn1.running_mean, model.bn1.running_mean)
    assert torch.equal(trained.bn1.running_var, model.bn1.running_var)
    assert int(trained.bn1.num_batches_tracked) == 0
    # unfrozen stages did train and update their statistics
    assert not torch.equal(trained.layer1[0].bn1.running_mean, model.layer1[0].bn1.running_mean)
    assert int(trained.layer1[0].bn1.num_batches_tracked) == 4


@pytest.mark.slow
def test_compile_forced_on_cpu(demo_manifest, tmp_path):
    """torch.compile with channels_last and bf16 forced on CPU. Two graphs, training's and validation's
    (no_grad): the validation split's last batch is partial and is padded to the others' shape, where
    it made a third graph with dynamic shapes (alone, with Inductor's cache empty: 141 CPU s, now 132)."""
    from torch._dynamo.utils import counters

    cfg = cfg_of(max_steps=2, epochs=1, compile=True, channels_last="always", precision="bf16")
    t = trainer(cfg, demo_manifest, tmp_path)
    n_val = sum(s.count for s in split_shards(demo_manifest, "val"))
    assert n_val % cfg.batch_size, f"{n_val} validation images fill every batch: no partial batch to pad"
    counters.clear()
    assert t.fit() == 0
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)["state_dict"]
    assert "conv1.weight" in saved and not any(k.startswith("_orig_mod") for k in saved)


class CountingTrainer(T.Trainer):
    checks: list[int]

    def _agree(self, nonfinite):
        self.checks.append(self._step_now)
        return super()._agree(nonfinite)

    def train_step(self, model, opt, batches, prog):
        self._step_now = prog.step + 1
        return super().train_step(model, opt, batches, prog)


@pytest.mark.slow
def test_host_checks_every_n_steps_and_at_checkpoints_and_epoch_end(demo_manifest, tmp_path):
    cfg = cfg_of(epochs=1, check_every_steps=5, checkpoint={"every_steps": 7, "keep": 5})
    paths = T.TrainPaths(manifest=demo_manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt")
    t = CountingTrainer(cfg, paths, Backend())
    t.checks = []
    assert t.fit() == 0
    n = t.steps_per_epoch
    # and at the run's first step: a signal received before training is honoured there (issue 18.2)
    expected = sorted({s for s in range(1, n + 1) if s % 5 == 0 or s % 7 == 0} | {1, n})
    assert t.checks == expected, f"{n} steps per epoch"
    assert len(t.checks) < n


@pytest.mark.slow
def test_divergence_detected_at_the_next_check_and_nothing_written(demo_manifest, tmp_path):
    cfg = cfg_of(epochs=1, check_every_steps=3, optim={"lr": 1e30}, checkpoint={"every_steps": 0, "keep": 5})
    t = trainer(cfg, demo_manifest, tmp_path)
    assert t.fit() == T.EXIT_DIVERGED
    info = json.loads((tmp_path / "out" / "diverged.json").read_text())
    assert info["step"] % 3 == 0 or info["step"] == t.steps_per_epoch
    assert not (tmp_path / "out" / "model.pt").exists()
    assert not ckpt.list_checkpoints(tmp_path / "ckpt"), "no checkpoint of a diverged model"


def _written_by_other_world(demo_manifest, tmp_path, world: int):
    """A real mid-epoch checkpoint of this run (step 3), marked as written by ``world`` ranks."""
    cfg = cfg_of(max_steps=4, epochs=2, checkpoint={"every_steps": 3, "keep": 5})
    assert trainer(cfg, demo_manifest, tmp_path).fit() == 0
    path, newer = ckpt.list_checkpoints(tmp_path / "ckpt")
    newer.unlink()                              # the end-of-run checkpoint at step 4
    state = torch.load(path, weights_only=True)      # checkpoints hold tensors and plain types only
    state["world_size"] = world
    torch.save(state, path)
    return path


@pytest.mark.slow
def test_resume_on_another_world_size_is_refused_by_default(demo_manifest, tmp_path):
    path = _written_by_other_world(demo_manifest, tmp_path, 4)
    cfg = cfg_of(max_steps=4, epochs=2, checkpoint={"every_steps": 3, "keep": 5})
    with pytest.raises(T.ResumeError, match=r"world of 4 ranks, this run has 1") as err:
        trainer(cfg, demo_manifest, tmp_path).fit()
    assert str(path) in str(err.value) and "on_world_change: remap" in str(err.value)


@pytest.mark.slow
def test_resume_on_another_world_size_remaps_position_and_lr(demo_manifest, tmp_path):
    _written_by_other_world(demo_manifest, tmp_path, 2)
    # checkpoint.* is not part of the run's identity: switching the policy keeps the checkpoint
    cfg = cfg_of(max_steps=4, epochs=2, checkpoint={"every_steps": 3, "keep": 5, "on_world_change": "remap"})
    t = trainer(cfg, demo_manifest, tmp_path)
    model, opt, sched = t._build()
    prog = t._restore(model, opt, sched)
    # 3 steps of 8 x 2 ranks = 48 samples -> step 6 of this 1-rank run, LR of step 6 on 1 rank
    assert (prog.epoch, prog.in_epoch, prog.step) == (0, 6, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(6, **t._schedule_args()))


def test_run_id_ignores_how_a_run_is_checkpointed_not_what_it_computes(demo_manifest):
    def rid(cfg):
        return identity.run_id(cfg, demo_manifest, None)
    a = rid(cfg_of())
    assert rid(cfg_of(checkpoint={"every_steps": 9, "keep": 1, "on_world_change": "remap"},
                      check_every_steps=1, ddp={"timeout_s": 5}, data={"stage_to": "/tmp/x"})) == a
    assert rid(cfg_of(optim={"lr": 0.5})) != a
    assert rid(cfg_of(data={"crop": 48})) != a


@pytest.mark.skipif(not horovod_available(), reason="horovod not built")
@pytest.mark.parametrize("fp16", [False, True], ids=["none", "fp16"])
def test_horovod_gets_dense_gradients_and_gives_back_channels_last(fp16):
    """horovod#3491: channels_last gradients are not contiguous and Horovod refuses them."""
    import horovod.torch as hvd
    from chexflow.train.backends.horovod import dense_layout_compression
    comp = dense_layout_compression(hvd.Compression.fp16 if fp16 else hvd.Compression.none)
    grad = torch.randn(8, 16, 3, 3).contiguous(memory_format=torch.channels_last)
    assert not grad.is_contiguous()
    sent, ctx = comp.compress(grad)
    assert sent.is_contiguous() and sent.dtype == (torch.float16 if fp16 else torch.float32)
    back = comp.decompress(sent, ctx)
    assert back.is_contiguous(memory_format=torch.channels_last) and back.dtype == torch.float32
    assert torch.allclose(back, grad, atol=1e-2 if fp16 else 0)
    flat = torch.randn(10)
    sent, ctx = comp.compress(flat)
    assert (sent is flat) != fp16 and comp.decompress(sent, ctx).is_contiguous()


class NoCollectives(Backend):
    """A world whose every collective is an error (before fit): what a Trainer may do at construction."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def _called(self, name: str) -> None:
        self.calls.append(name)

    def barrier(self) -> None:
        self._called("barrier")

    def broadcast_object(self, obj):
        self._called("broadcast_object")
        return obj

    def allreduce_max(self, value):
        self._called("allreduce_max")
        return value

    def allgather_object(self, obj):
        self._called("allgather_object")
        return [obj]


@pytest.mark.slow
def test_construction_runs_no_collective_and_staging_happens_in_fit(demo_manifest, tmp_path):
    """A Trainer is built without any communication (ranks may construct at different times); the
    node-local staging copy and the ranks' agreement on it happen at the start of fit, before the
    model exists."""
    backend = NoCollectives()
    local = tmp_path / "node-local"
    t = trainer(cfg_of(max_steps=1, epochs=1, data={"stage_to": str(local)}), demo_manifest, tmp_path,
                backend=backend)
    assert backend.calls == []
    assert t.steps_per_epoch == t.data.steps_per_epoch > 0
    assert not local.exists()
    assert t.fit() == 0
    # whether rank 0 holds the checkpoint directory (its lease), this start's token (the copies' stamps
    # carry it), then every node's staging outcome (a refusal on one stops all, a barrier as well)
    assert backend.calls[:3] == ["broadcast_object", "broadcast_object", "allgather_object"]
    staged = {p.name for p in (local / "chexflow-shards").iterdir()}
    # the copies, and their stamps beside them (they live and die with the copies)
    stamps = StampStore(local / "chexflow-shards", demo_manifest).path.name
    assert stamps in staged and len(staged - {stamps}) == len(t.data.train_shards) + len(t.data.val_shards)
    assert all(str(s.path).startswith(str(local)) for s in t.data.train_shards + t.data.val_shards)


@pytest.mark.slow
def test_the_trainer_learns_a_learnable_task(fashion_manifest, tmp_path):
    """What the tiny end-to-end chain is too short to show (its 26 pretraining steps leave the
    validation AUROC at chance): the training loop learns. One epoch of 3,200 Fashion-MNIST
    images, 50 Adam steps (fused kernels, the default) of 64 on one process: validation accuracy
    far above chance (0.1), the loss far below log(10)."""
    cfg = from_dict(TrainConfig, train_cfg(
        "single", stage="pretrain", dataset="fashion_mnist", epochs=1, batch_size=64, seed=0, channels_last="auto",
        model={"arch": "resnet18"},
        data={"crop": 32, "samples_per_epoch": 3200, "workers": 0, "shuffle_buffer": 500},
        optim={"name": "adam", "lr": 1e-3, "reference_batch": 64}, schedule={"warmup_epochs": 0.1},
        checkpoint={"every_steps": 0, "keep": 1}))
    assert trainer(cfg, fashion_manifest, tmp_path).fit() == 0
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"val accuracy {row['val_metric']:.3f}, val loss {row['val_loss']:.3f}")     # shown with -rP
    assert row["val_metric_name"] == "accuracy" and row["step"] == 50
    assert row["val_metric"] > 0.6 and row["val_loss"] < 1.2


class WorkerWatch(T.Trainer):
    """Records the training and validation loaders' worker processes after each epoch."""

    def _end_epoch(self, *args, **kwargs):
        out = super()._end_epoch(*args, **kwargs)
        self.seen.append(tuple(frozenset(w.pid for w in loader._iterator._workers)
                               for loader in (self.train_loader, self.val_loader)))
        return out


@pytest.mark.slow
@pytest.mark.parametrize("lr", [0.05, 1e30])
def test_loader_workers_start_once_per_run_and_stop_with_it(demo_manifest, tmp_path, lr):
    """One set of workers serves every epoch's pass and another every validation; both are gone when
    fit() returns, after a finished run and after a stop (here: divergence) alike."""
    cfg = cfg_of(epochs=3, data={"workers": 1, "samples_per_epoch": 64}, optim={"lr": lr},
                 check_every_steps=2 if lr > 1 else 20)
    paths = T.TrainPaths(manifest=demo_manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt")
    t = WorkerWatch(cfg, paths, Backend())
    t.seen = []
    assert t.fit() == (0 if lr < 1 else T.EXIT_DIVERGED)
    if lr < 1:
        assert len(t.seen) == 3 and len(set(t.seen)) == 1, t.seen
        train_pids, val_pids = t.seen[0]
        assert len(train_pids) == len(val_pids) == 1 and not train_pids & val_pids
    assert t.train_loader._iterator is None and t.val_loader._iterator is None
    assert not multiprocessing.active_children()
