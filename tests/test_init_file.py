"""Starting weights from a torchvision-format file (``init: file``): the file's backbone loaded
weights-only through the one fits-the-model check, its RGB stem folded into the grey stem, its head
replaced, its bytes part of the run id. The files are built here in torchvision's exact key layout
(``torchvision.models.<arch>(weights=None).state_dict()``), as torchvision's published ImageNet
weights are laid out; no network."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from chexflow.settings import from_dict
from chexflow.train import checkpoint as ckpt
from chexflow.train import identity
from chexflow.train.config import TrainConfig, check
from chexflow.train.init_file import InitFileError, load_init_file, torchvision_keys
from chexflow.train.models import build_model
from conftest import cli_env
from test_distributed import train_cfg


def _torchvision_file(path: Path, arch: str, *, seed: int = 0, old_style: bool = False,
                      drop_counts: bool = False) -> dict[str, torch.Tensor]:
    """A torchvision model's state dict (random weights: seeded), saved as torchvision saves its weights.
    ``old_style``: DenseNet keys as torchvision's published file has them (``norm.1`` for ``norm1``);
    ``drop_counts``: without ``num_batches_tracked`` (files older than BatchNorm's counter)."""
    torch.manual_seed(seed)
    sd = torchvision.models.get_model(arch, weights=None).state_dict()
    saved = {}
    for k, v in sd.items():
        if drop_counts and k.endswith("num_batches_tracked"):
            continue
        if old_style:
            k = re.sub(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.", r"\1.\2.", k)
        saved[k] = v
    torch.save(saved, path)
    return sd


def test_the_folded_stem_sees_a_grey_image_as_the_rgb_stem_sees_it_in_three_channels(tmp_path):
    sd = _torchvision_file(tmp_path / "r18.pth", "resnet18")
    rgb = torchvision.models.resnet18(weights=None)
    rgb.load_state_dict(sd)
    grey = build_model("resnet18", in_channels=1, num_outputs=14)
    load_init_file(grey, tmp_path / "r18.pth")
    # folded: the sum over the input-channel axis (computed here independently of chexflow)
    assert torch.equal(grey.conv1.weight, sd["conv1.weight"].sum(dim=1, keepdim=True))
    torch.manual_seed(1)
    x = torch.randn(2, 1, 40, 40)          # a normalised grey batch: every channel normalised alike
    with torch.no_grad():
        ours, theirs = grey.conv1(x), rgb.conv1(x.repeat(1, 3, 1, 1))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # a mean instead of the sum would be a third of it
    with torch.no_grad():
        meaned = torch.nn.functional.conv2d(x, sd["conv1.weight"].mean(dim=1, keepdim=True), stride=2, padding=3)
    torch.testing.assert_close(meaned * 3, theirs, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(meaned, theirs, atol=1e-3)


def test_every_backbone_tensor_is_the_files_from_torchvisions_published_layout(tmp_path):
    """A DenseNet-121 file as torchvision publishes it (old-style keys, no batch counters)."""
    path = tmp_path / "densenet121.pth"
    sd = _torchvision_file(path, "densenet121", old_style=True, drop_counts=True)
    assert any(".norm.1." in k for k in torch.load(path, weights_only=True))     # the old layout was written
    model = build_model("densenet121", in_channels=1, num_outputs=14)
    head_before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("classifier.")}
    loaded, held = load_init_file(model, path)
    own = model.state_dict()
    assert held == len(sd)          # the file's tensors, its missing batch counters filled in
    backbone = [k for k in sd if not k.startswith("classifier.")]
    assert sorted(loaded) == sorted(backbone)
    for k in backbone:
        if k == "features.conv0.weight":
            assert torch.equal(own[k], sd[k].sum(dim=1, keepdim=True))
        elif k.endswith("num_batches_tracked"):
            assert own[k].item() == 0
        else:
            assert torch.equal(own[k], sd[k]), k
    # the head is new: 14 outputs, its initial weights untouched by the file's 1000-class classifier
    assert own["classifier.1.weight"].shape == (14, 1024)
    assert all(torch.equal(own[k], v) for k, v in head_before.items())
    assert torchvision_keys({"features.denseblock1.denselayer1.norm.1.weight": sd["features.norm0.weight"]}) == {
        "features.denseblock1.denselayer1.norm1.weight": sd["features.norm0.weight"]}


def test_a_file_that_does_not_fit_is_refused_naming_it(tmp_path):
    r34 = tmp_path / "resnet34.pth"
    _torchvision_file(r34, "resnet34")
    with pytest.raises(InitFileError, match=re.escape(str(r34)) + r".*refused.*missing|" + re.escape(str(r34))
                       + r".*does not have"):
        load_init_file(build_model("resnet18", in_channels=1, num_outputs=3), r34)
    sd = torchvision.models.resnet18(weights=None).state_dict()
    sd["layer1.0.conv1.weight"] = torch.zeros(64, 64, 1, 1)
    bad = tmp_path / "shape.pth"
    torch.save(sd, bad)
    with pytest.raises(InitFileError, match=re.escape(str(bad)) + r".*layer1\.0\.conv1\.weight: \(64, 64, 1, 1\)"):
        load_init_file(build_model("resnet18", in_channels=1, num_outputs=3), bad)
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"state_dict": sd, "epoch": 3}, wrapped)
    with pytest.raises(InitFileError, match=re.escape(str(wrapped)) + r": refused: not a torchvision-format"):
        load_init_file(build_model("resnet18", in_channels=1, num_outputs=3), wrapped)
    with pytest.raises(InitFileError, match=re.escape(str(tmp_path / "nope.pth")) + ".*cannot be read"):
        load_init_file(build_model("resnet18", in_channels=1, num_outputs=3), tmp_path / "nope.pth")
    with pytest.raises(InitFileError, match=re.escape(str(tmp_path)) + ": refused"):
        load_init_file(build_model("resnet18", in_channels=1, num_outputs=3), tmp_path)    # a directory


def _cfg(path: Path | None, **over) -> TrainConfig:
    return from_dict(TrainConfig, train_cfg("single", init="file", init_file=None if path is None else str(path),
                                            **over))


def test_the_files_bytes_not_its_path_are_part_of_the_run_id(demo_manifest, tmp_path):
    a = tmp_path / "a.pth"
    _torchvision_file(a, "resnet18", seed=0)
    rid = identity.run_id(_cfg(a), demo_manifest, None)
    assert rid != identity.run_id(from_dict(TrainConfig, train_cfg("single")), demo_manifest, None)   # random
    same = tmp_path / "elsewhere" / "same.pth"
    same.parent.mkdir()
    shutil.copyfile(a, same)
    assert identity.run_id(_cfg(same), demo_manifest, None) == rid
    _torchvision_file(a, "resnet18", seed=1)        # other bytes under the same name
    assert identity.run_id(_cfg(a), demo_manifest, None) != rid
    assert identity.identity(_cfg(a), demo_manifest, None).weights == hashlib.sha256(a.read_bytes()).hexdigest()


def test_the_settings_check_names_the_key(tmp_path):
    assert check(_cfg(None), "finetune") == [
        "finetune.init_file: missing: init: file loads the starting weights from it (a torchvision-format state "
        "dict, e.g. torchvision's ImageNet densenet121 weights)"]
    (msg,) = check(_cfg(tmp_path / "absent.pth"), "finetune")
    assert msg.startswith(f"finetune.init_file: {tmp_path / 'absent.pth'} does not exist")
    (msg,) = check(_cfg(tmp_path), "pretrain")
    assert msg.startswith(f"pretrain.init_file: {tmp_path} is not a regular file")
    present = tmp_path / "w.pth"
    present.write_bytes(b"x")
    assert check(_cfg(present), "finetune") == []
    (msg,) = check(from_dict(TrainConfig, train_cfg("single", stage="pretrain", init="pretrained")), "pretrain")
    assert msg.startswith("pretrain.init: pretrained is for fine-tuning")


@pytest.mark.slow
def test_a_fine_tune_from_a_file_through_the_cli(demo_manifest, tmp_path):
    path = tmp_path / "resnet18-imagenet.pth"
    sd = _torchvision_file(path, "resnet18", drop_counts=True)
    cfg = train_cfg("single", init="file", init_file=str(path), epochs=1, max_steps=2,
                    data={"samples_per_epoch": 32})
    cmd = [sys.executable, "-m", "chexflow", "train", "--config-json", json.dumps(cfg), "--manifest",
           str(demo_manifest), "--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"initialised 120 backbone tensors from {path} (of its 122;" in proc.stdout + proc.stderr
    model = ckpt.load_model_file(tmp_path / "out" / "model.pt")
    assert model["run_id"] == identity.run_id(from_dict(TrainConfig, cfg), demo_manifest, None)
    # after 2 steps at a small LR the deepest block is still near the file's, far from a fresh random init
    trained, start = model["state_dict"]["layer4.1.conv2.weight"], sd["layer4.1.conv2.weight"]
    torch.manual_seed(123)
    fresh = torchvision.models.resnet18(weights=None).state_dict()["layer4.1.conv2.weight"]
    assert (trained - start).norm() < 0.1 * (fresh - start).norm()
