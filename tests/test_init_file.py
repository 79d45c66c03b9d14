"""Starting weights from a torchvision-format file (``init: file``): the file's backbone loaded
weights-only through the one fits-the-model check, its RGB stem folded exactly from ImageNet's
per-channel normalisation into the grey stem, its head replaced, its bytes part of the run id. The
files are built here in torchvision's exact key layout (``torchvision.models.<arch>(weights=None)``,
seeded, BatchNorm statistics drawn at random as trained ones would be), as torchvision's published
ImageNet weights are laid out; no network."""
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
from chexflow.train import init_file as train_init
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
    model = torchvision.models.get_model(arch, weights=None)
    for m in model.modules():           # statistics as training leaves them, not the init's 0 and 1
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_(0.0, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    sd = model.state_dict()
    saved = {}
    for k, v in sd.items():
        if drop_counts and k.endswith("num_batches_tracked"):
            continue
        if old_style:
            k = re.sub(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.", r"\1.\2.", k)
        saved[k] = v
    torch.save(saved, path)
    return sd


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)     # torchvision's presets


def _fold_by_hand(weight: torch.Tensor, running_mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact fold, written out: grey input g = (x - 0.5) / 0.25, channel c of the original
    (x - m_c) / s_c = (0.25 / s_c) g + (0.5 - m_c) / s_c."""
    w = weight.double()
    grey = sum(w[:, c:c + 1] * 0.25 / IMAGENET_STD[c] for c in range(3))
    offset = sum(w[:, c].sum(dim=(1, 2)) * (0.5 - IMAGENET_MEAN[c]) / IMAGENET_STD[c] for c in range(3))
    return grey.float(), (running_mean.double() - offset).float()


def test_a_grey_image_through_the_folded_model_is_the_imagenet_normalised_rgb_image_through_the_original(tmp_path):
    """The issue's test: pixels x, chexflow's input (x - 0.5) / 0.25 through the folded model, against
    (x, x, x) normalised with ImageNet's per-channel mean and std through the original, BatchNorm in
    eval mode (freeze, evaluation): equal within 1e-5 wherever no window reached the stem's zero padding."""
    assert train_init.published_normalisation("resnet18") == (IMAGENET_MEAN, IMAGENET_STD)
    sd = _torchvision_file(tmp_path / "r18.pth", "resnet18")
    rgb = torchvision.models.resnet18(weights=None)
    rgb.load_state_dict(sd)
    grey = build_model("resnet18", in_channels=1, num_outputs=14)
    load_init_file(grey, tmp_path / "r18.pth", arch="resnet18")
    weight, running_mean = _fold_by_hand(sd["conv1.weight"], sd["bn1.running_mean"])
    torch.testing.assert_close(grey.conv1.weight, weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grey.bn1.running_mean, running_mean, rtol=1e-6, atol=1e-6)
    rgb.eval(), grey.eval()
    torch.manual_seed(1)
    x = torch.rand(2, 1, 64, 64)                          # pixels / 255
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)

    def stem_and_layer1(net, z):
        stem = net.bn1(net.conv1(z))
        return stem, net.layer1(net.maxpool(net.relu(stem)))

    with torch.no_grad():
        ours = stem_and_layer1(grey, (x - 0.5) / 0.25)
        theirs = stem_and_layer1(rgb, (x.repeat(1, 3, 1, 1) - mean) / std)
    # conv1 (7 x 7, stride 2, padding 3) on 64 px: output i reads input rows 2i-3..2i+3, inside for i in 2..30;
    # the max pool (3, 2, 1) and layer1's four 3 x 3 convolutions widen that to 6..10 of layer1's 16
    torch.testing.assert_close(ours[0][..., 2:31, 2:31], theirs[0][..., 2:31, 2:31], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1][..., 6:11, 6:11], theirs[1][..., 6:11, 6:11], rtol=1e-5, atol=1e-5)
    # where a window reaches into the padding the two differ: the original pads each channel at its own mean
    assert (ours[0][..., 0, :] - theirs[0][..., 0, :]).abs().max() > 1e-2
    # the old fold (kernels summed, as if the weights had seen chexflow's normalisation) is off inside too
    with torch.no_grad():
        summed = torch.nn.functional.conv2d((x - 0.5) / 0.25, sd["conv1.weight"].sum(dim=1, keepdim=True),
                                            stride=2, padding=3)
        old = torch.nn.functional.batch_norm(summed, sd["bn1.running_mean"], sd["bn1.running_var"],
                                             sd["bn1.weight"], sd["bn1.bias"])
    assert (old - theirs[0])[..., 2:31, 2:31].abs().max() > 0.1


def test_every_backbone_tensor_is_the_files_from_torchvisions_published_layout(tmp_path):
    """A DenseNet-121 file as torchvision publishes it (old-style keys, no batch counters)."""
    path = tmp_path / "densenet121.pth"
    sd = _torchvision_file(path, "densenet121", old_style=True, drop_counts=True)
    assert any(".norm.1." in k for k in torch.load(path, weights_only=True))     # the old layout was written
    model = build_model("densenet121", in_channels=1, num_outputs=14)
    head_before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("classifier.")}
    loaded, held = load_init_file(model, path, arch="densenet121")
    own = model.state_dict()
    assert held == len(sd)          # the file's tensors, its missing batch counters filled in
    backbone = [k for k in sd if not k.startswith("classifier.")]
    assert sorted(loaded) == sorted(backbone)
    weight, running_mean = _fold_by_hand(sd["features.conv0.weight"], sd["features.norm0.running_mean"])
    for k in backbone:
        if k == "features.conv0.weight":
            torch.testing.assert_close(own[k], weight, rtol=1e-6, atol=1e-7)
        elif k == "features.norm0.running_mean":             # the stem's constant offset, folded in
            torch.testing.assert_close(own[k], running_mean, rtol=1e-6, atol=1e-6)
        elif k.endswith("num_batches_tracked"):
            assert own[k].item() == 0
        else:
            assert torch.equal(own[k], sd[k]), k
    # the head is new: 14 outputs, its initial weights untouched by the file's 1000-class classifier
    assert own["classifier.1.weight"].shape == (14, 1024)
    assert all(torch.equal(own[k], v) for k, v in head_before.items())
    assert torchvision_keys({"features.denseblock1.denselayer1.norm.1.weight": sd["features.norm0.weight"]}) == {
        "features.denseblock1.denselayer1.norm1.weight": sd["features.norm0.weight"]}


def _load_r18(path: Path):
    return load_init_file(build_model("resnet18", in_channels=1, num_outputs=3), path, arch="resnet18")


def test_a_file_that_does_not_fit_is_refused_naming_it(tmp_path):
    r34 = tmp_path / "resnet34.pth"
    _torchvision_file(r34, "resnet34")
    with pytest.raises(InitFileError, match=re.escape(str(r34)) + r".*refused.*missing|" + re.escape(str(r34))
                       + r".*does not have"):
        _load_r18(r34)
    sd = torchvision.models.resnet18(weights=None).state_dict()
    sd["layer1.0.conv1.weight"] = torch.zeros(64, 64, 1, 1)
    bad = tmp_path / "shape.pth"
    torch.save(sd, bad)
    with pytest.raises(InitFileError, match=re.escape(str(bad)) + r".*layer1\.0\.conv1\.weight: \(64, 64, 1, 1\)"):
        _load_r18(bad)
    grey = tmp_path / "grey.pth"                     # a stem that never saw ImageNet's three channels
    torch.save({**torchvision.models.resnet18(weights=None).state_dict(), "conv1.weight": torch.zeros(64, 1, 7, 7)},
               grey)
    with pytest.raises(InitFileError, match=re.escape(str(grey)) + r": refused: its stem conv1.weight is "
                       r"\(64, 1, 7, 7\), not the 3-channel \(RGB\) stem"):
        _load_r18(grey)
    other = tmp_path / "shufflenet.pth"              # another architecture's file: its stem has another name
    torch.save(torchvision.models.shufflenet_v2_x0_5(weights=None).state_dict(), other)
    with pytest.raises(InitFileError, match=re.escape(str(other)) + r": refused: it holds no conv1.weight, the stem "
                       r"torchvision's weights of this architecture have \(a file of another architecture\?\)"):
        _load_r18(other)
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"state_dict": sd, "epoch": 3}, wrapped)
    with pytest.raises(InitFileError, match=re.escape(str(wrapped)) + r": refused: not a torchvision-format"):
        _load_r18(wrapped)
    with pytest.raises(InitFileError, match=re.escape(str(tmp_path / "nope.pth")) + ".*cannot be read"):
        _load_r18(tmp_path / "nope.pth")
    with pytest.raises(InitFileError, match=re.escape(str(tmp_path)) + ": refused"):
        _load_r18(tmp_path)    # a directory


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
    cfg = train_cfg("single", init="file", init_file=str(path), model={"arch": "resnet18"}, epochs=1, max_steps=2,
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
