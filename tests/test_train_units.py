"""Pure pieces of training: masked BCE, LR schedule values, checkpoints, backbone loading."""

import pytest
import torch

from chexflow.train.config import OptimConfig, ScheduleConfig
from chexflow.train import checkpoint as ckpt
from chexflow.train.losses import masked_bce
from chexflow.train.models import build_model, load_backbone
from chexflow.train.schedule import lr_at, make_scheduler, scaled_lr, set_scheduler_step
from conftest import checkpoint_step


def test_masked_bce_ignores_nan_labels():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, -2.0]])
    targets = torch.tensor([[1.0, float("nan"), 0.0], [float("nan"), 1.0, float("nan")]])
    known = ~torch.isnan(targets)
    ref = torch.nn.functional.binary_cross_entropy_with_logits(logits[known], targets[known])
    assert torch.allclose(masked_bce(logits, targets), ref)
    # changing a logit where the label is unknown changes nothing
    logits2 = logits.clone()
    logits2[0, 1] = -50.0
    assert torch.equal(masked_bce(logits2, targets), masked_bce(logits, targets))


def test_masked_bce_all_unknown_is_zero_not_nan():
    out = masked_bce(torch.zeros(2, 3), torch.full((2, 3), float("nan")))
    assert out.item() == 0.0


def test_lr_linear_scaling_and_warmup_values():
    optim = OptimConfig(lr=0.1, reference_batch=256)
    sched = ScheduleConfig(warmup_epochs=2, decay="cosine")
    kw = dict(optim=optim, sched=sched, batch_size=64, steps_per_epoch=10, epochs=10)
    assert scaled_lr(optim, batch_size=64, world=4) == pytest.approx(0.1)   # 64*4 = 256
    assert scaled_lr(optim, batch_size=64, world=8) == pytest.approx(0.2)
    # warmup from the single-worker LR (0.025) to the 4-rank LR (0.1) over 20 steps
    assert lr_at(0, world=4, **kw) == pytest.approx(0.025)
    assert lr_at(10, world=4, **kw) == pytest.approx(0.0625)
    assert lr_at(20, world=4, **kw) == pytest.approx(0.1)
    # cosine to zero at the end
    assert lr_at(60, world=4, **kw) == pytest.approx(0.05)
    assert lr_at(100, world=4, **kw) == pytest.approx(0.0, abs=1e-12)


def test_step_decay_and_scheduler_matches_function():
    optim = OptimConfig(lr=0.1, reference_batch=128)
    sched = ScheduleConfig(warmup_epochs=0, decay="step", step_epochs=(3, 6))
    kw = dict(optim=optim, sched=sched, batch_size=64, world=2, steps_per_epoch=5, epochs=8)
    assert lr_at(14, **kw) == pytest.approx(0.1)
    assert lr_at(15, **kw) == pytest.approx(0.01)
    assert lr_at(30, **kw) == pytest.approx(0.001)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=123.0)
    s = make_scheduler(opt, **kw)
    for step in range(20):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, **kw))
        opt.step()
        s.step()


def _state(step, run_id="r1"):
    return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {}, "scheduler": {},
            "step": step, "epoch": 0, "step_in_epoch": step, "run_id": run_id}


def test_checkpoint_newest_valid_skips_corrupt_and_foreign(tmp_path):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=5)
    # corrupt the newest: truncated file
    newest = ckpt.checkpoint_path(tmp_path, 30, "r1")
    newest.write_bytes(newest.read_bytes()[:100])
    logs = []
    path, state = ckpt.load_newest_valid(tmp_path, run_id="r1", log=logs.append)
    assert state["step"] == 20 and path.name == "step-000000020-r1.pt"
    assert any("step-000000030-r1.pt refused: not a torch zip archive (truncated" in m for m in logs), logs
    # set aside, out of the resume and of pruning
    assert not newest.exists() and newest.with_name(newest.name + ".refused").exists()
    # a checkpoint of another configuration is never resumed
    assert ckpt.load_newest_valid(tmp_path, run_id="other", log=logs.append) is None
    assert any("belong to other runs" in m for m in logs)


def test_checkpoint_keep_and_atomic(tmp_path):
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-000000004-r1.pt", "step-000000005-r1.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_checkpoint_pruning_keeps_each_runs_own(tmp_path):
    """After a config change the old run's higher-numbered checkpoints must not outrank (and
    prune) the new run's: keep counts per run."""
    for step in (100, 200, 300):
        ckpt.save_checkpoint(tmp_path, step, _state(step, "old"), keep=2)
    new = ckpt.save_checkpoint(tmp_path, 5, _state(5, "new"), keep=2)
    assert new.exists(), "the new run's first checkpoint was pruned"
    ckpt.save_checkpoint(tmp_path, 10, _state(10, "new"), keep=2)
    ckpt.save_checkpoint(tmp_path, 15, _state(15, "new"), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path, run_id="new")] == \
        ["step-000000010-new.pt", "step-000000015-new.pt"]
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path, run_id="old")] == [200, 300]
    path, state = ckpt.load_newest_valid(tmp_path, run_id="new", log=lambda m: None)
    assert state["step"] == 15 and state["run_id"] == "new"


def test_scheduler_set_step_matches_stepping():
    optim = OptimConfig(lr=0.1, reference_batch=64)
    sched = ScheduleConfig(warmup_epochs=1, decay="cosine")
    kw = dict(optim=optim, sched=sched, batch_size=32, world=4, steps_per_epoch=10, epochs=5)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    s = make_scheduler(opt, **kw)
    set_scheduler_step(s, 17)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(17, **kw))
    opt.step()
    s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(18, **kw))
    assert s.get_last_lr()[0] == pytest.approx(lr_at(18, **kw))


def test_to_cpu_keeps_structure_and_detaches():
    w = torch.ones(2, requires_grad=True)
    st = {"state": {0: {"momentum_buffer": w * 2, "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1.0}]}
    out = ckpt.to_cpu(st)
    buf = out["state"][0]["momentum_buffer"]
    assert buf.device.type == "cpu" and not buf.requires_grad and torch.equal(buf, torch.full((2,), 2.0))
    assert out["param_groups"] == [{"lr": 1.0}] and out["state"][0]["step"].item() == 3.0


def test_load_backbone_keeps_new_head_and_adapts_stem():
    torch.manual_seed(0)
    pre = build_model("resnet18", in_channels=3, num_outputs=10)
    ft = build_model("resnet18", in_channels=1, num_outputs=14)
    head_before = ft.fc[1].weight.clone()
    loaded = load_backbone(ft, pre.state_dict())
    assert "fc.1.weight" not in loaded and "layer4.1.bn2.weight" in loaded
    assert torch.equal(ft.fc[1].weight, head_before)
    assert torch.equal(ft.layer1[0].conv1.weight, pre.layer1[0].conv1.weight)
    assert torch.allclose(ft.conv1.weight[:, 0], pre.conv1.weight.sum(dim=1))
    assert ft(torch.zeros(2, 1, 32, 32)).shape == (2, 14)


def test_load_backbone_wrong_arch_fails():
    pre = build_model("mobilenet_v3_small", in_channels=1, num_outputs=10)
    ft = build_model("resnet18", in_channels=1, num_outputs=14)
    with pytest.raises(ValueError, match=r"120 expected tensor\(s\) missing \(conv1.weight"):
        load_backbone(ft, pre.state_dict())


def test_param_groups_backbone_and_head_lr_at_given_steps():
    """A pretrained backbone at backbone_lr_mult x the schedule's LR, the new head at 1x, at every step."""
    from chexflow.train.models import head_prefix, param_groups
    model = build_model("resnet18", in_channels=1, num_outputs=14)
    groups = param_groups(model, backbone_lr_mult=0.1)
    assert [g["lr_mult"] for g in groups] == [0.1, 1.0]            # backbone, head
    head = [p for n, p in model.named_parameters() if n.startswith(head_prefix(model))]
    assert len(groups[1]["params"]) == len(head) == 2 and all(a is b for a, b in zip(groups[1]["params"], head))
    assert len(groups[0]["params"]) + 2 == len(list(model.parameters()))
    kw = dict(optim=OptimConfig(name="adam", lr=1e-3, reference_batch=32),
              sched=ScheduleConfig(warmup_epochs=1, decay="cosine"), batch_size=16, world=2,
              steps_per_epoch=10, epochs=4)
    opt = torch.optim.Adam(groups, lr=1.0)
    s = make_scheduler(opt, **kw)
    seen = {}
    for step in range(40):
        seen[step] = (opt.param_groups[0]["lr"], opt.param_groups[1]["lr"])
        opt.step()
        s.step()
    # warmup from 5e-4 (one rank's LR) to 1e-3 over 10 steps, then cosine to 0
    assert seen[0] == (pytest.approx(5e-5), pytest.approx(5e-4))
    assert seen[10] == (pytest.approx(1e-4), pytest.approx(1e-3))
    assert seen[25] == (pytest.approx(5e-5), pytest.approx(5e-4))
    # frozen stages are left out; a non-positive multiplier is refused by name
    from chexflow.train.models import freeze_backbone
    freeze_backbone(model, 6)
    only = param_groups(model, backbone_lr_mult=0.1)
    assert len(only) == 1 and only[0]["lr_mult"] == 1.0 and len(only[0]["params"]) == 2     # the head
    with pytest.raises(ValueError, match="backbone_lr_mult"):
        param_groups(model, backbone_lr_mult=0.0)


def test_load_backbone_transfer_stages_keeps_later_stages_random():
    pre = build_model("resnet18", in_channels=1, num_outputs=10)
    torch.manual_seed(1)
    ft = build_model("resnet18", in_channels=1, num_outputs=14)
    before = {k: v.clone() for k, v in ft.state_dict().items()}
    loaded = load_backbone(ft, pre.state_dict(), stages=3)       # conv1, bn1, layer1
    assert loaded and all(k.split(".")[0] in ("conv1", "bn1", "layer1") for k in loaded)
    sd = ft.state_dict()
    assert torch.equal(sd["layer1.0.conv1.weight"], pre.state_dict()["layer1.0.conv1.weight"])
    assert torch.equal(sd["layer2.0.conv1.weight"], before["layer2.0.conv1.weight"])
    assert not torch.equal(sd["layer2.0.conv1.weight"], pre.state_dict()["layer2.0.conv1.weight"])
    with pytest.raises(ValueError, match="transfer_stages: 7 is outside 1..6"):
        load_backbone(ft, pre.state_dict(), stages=7)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizer_implementations_agree_and_fused_is_the_default(name):
    """fused (the default), foreach and for-loop kernels take the same steps up to rounding, also
    with channels_last parameters (the GPU path's memory format, forced here on CPU)."""
    from chexflow.train.models import param_groups
    from chexflow.train.schedule import build_optimizer
    assert OptimConfig().implementation == "fused"
    results, grads = {}, []
    for impl in ("fused", "foreach", "for-loop"):
        torch.manual_seed(0)
        model = build_model("resnet18", in_channels=1, num_outputs=14).to(memory_format=torch.channels_last)
        opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=1e-4, implementation=impl),
                              param_groups(model, backbone_lr_mult=0.3))
        assert all(bool(g["fused"]) is (impl == "fused") for g in opt.param_groups), impl
        assert all(bool(g["foreach"]) is (impl == "foreach") for g in opt.param_groups), impl
        for g in opt.param_groups:
            g["lr"] = 1e-2 * g["lr_mult"]
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            if len(grads) == step:      # the same gradients for every implementation
                grads.append([torch.randn(p.shape, generator=gen) for p in model.parameters()])
            for p, g in zip(model.parameters(), grads[step]):
                p.grad = g.to(memory_format=torch.channels_last) if p.dim() == 4 else g.clone()
            opt.step()
        results[impl] = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(0)
    start = build_model("resnet18", in_channels=1, num_outputs=14).parameters()
    moved = max((a - b).abs().max().item() for a, b in zip(results["for-loop"], start))
    assert moved > 1e-3          # the steps did something (not: three untouched models agree)
    for impl in ("fused", "foreach"):
        for a, b in zip(results[impl], results["for-loop"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gpu_index_is_a_visible_device_for_every_local_rank():
    """Two ranks sharing one GPU, or one GPU per task (SLURM shows each task device 0 alone): local
    rank 1 has no device 1. DDP's device_ids took the local rank and rank 1 died in its first
    backward on the H200 (bench/results/gpu_tests-20261128-h200.log); set_device and device_ids
    now take this one index."""
    from chexflow.train.backends.base import DistributedError, gpu_index
    assert [gpu_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [gpu_index(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(DistributedError, match="no CUDA device"):
        gpu_index(0, 0)


def test_ieee_fp32_turns_tf32_off_inside_and_restores_the_flags():
    from chexflow.train.models import ieee_fp32
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        for conv, matmul in ((True, False), (True, True), (False, True)):
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
            with ieee_fp32():
                assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, False)
            assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (conv, matmul)
        with pytest.raises(RuntimeError, match="boom"), ieee_fp32():
            raise RuntimeError("boom")
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
