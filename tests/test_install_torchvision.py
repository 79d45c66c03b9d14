"""chexflow_install.torchvision_dynamo (envs/): torchvision 0.29.1 imported without TorchDynamo. What it
saves is measured in envs/patches/torchvision-dynamo-import.md; here: that it is applied, exact, changes
nothing else torchvision does, and never fails an installation."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import torch

from chexflow_install import torchvision_dynamo as P
from conftest import cli_env

ORIGINAL, REPLACEMENT = P.ORIGINAL, P.REPLACEMENT


def installed_text() -> str:
    return P.module_file().read_text(encoding="utf-8")


def test_installed_torchvision_is_the_pinned_release_patched_and_imports_without_dynamo():
    """envs/setup.sh applies the patch: neither torchvision nor a chexflow process that builds a model and
    validates imports torch._dynamo; a run that compiles still does (torch.compile imports it)."""
    assert importlib.metadata.version(P.DIST) == P.VERSION
    assert P.is_patched(installed_text()), "run `bash envs/setup.sh` (it runs chexflow_install.torchvision_dynamo)"
    assert P.main(["--check"]) == 0
    probe = ("import sys; from chexflow.train import trainer; from chexflow.evaluate import run; "
             "from chexflow.train.models import build_model; build_model('resnet18', in_channels=1, num_outputs=14); "
             "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], env=cli_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]


def test_roi_align_and_its_compile_check_answer_as_before():
    """The patched module's op gives torchvision's numbers, and its compile check is dynamo's own answer."""
    from torch._dynamo.utils import is_compile_supported
    from torchvision.ops import roi_align
    module = sys.modules["torchvision.ops.roi_align"]
    for device in ("cpu", "cuda", "mps"):
        assert module.is_compile_supported(device) == is_compile_supported(device)
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    boxes = torch.tensor([[0, 0.0, 0.0, 4.0, 4.0], [1, 1.5, 2.0, 9.0, 7.5]])
    out = roi_align(x, boxes, (3, 2), spatial_scale=1.0, sampling_ratio=2, aligned=True)
    # the C++ op against torchvision's own Python implementation (its compiled fallback's source)
    ref = module._roi_align.__wrapped__(x, boxes, 1.0, 3, 2, 2, True)       # eager, not compiled
    assert out.shape == (2, 3, 3, 2) and torch.allclose(out, ref, atol=1e-6)


def test_patch_is_exact_and_idempotent():
    """Undone, the installed file is 0.29.1's text: patching that gives the installed file again, and
    patching twice changes nothing."""
    patched = installed_text()
    original = patched.replace(REPLACEMENT, ORIGINAL)
    assert not P.is_patched(original) and original.count(ORIGINAL) == 1
    assert P.patch_text(original) == patched
    assert P.patch_text(patched) == patched


def test_other_release_or_changed_code_is_left_alone_and_never_fails_the_install(tmp_path):
    original = installed_text().replace(REPLACEMENT, ORIGINAL)
    path = tmp_path / "roi_align.py"
    path.write_text(original)
    done, said = P.apply_to(path, "0.30.0")
    assert done and "0.30.0: left as it is (the patch is written for 0.29.1" in said
    assert path.read_text() == original
    changed = original.replace(ORIGINAL, "from torch._dynamo.utils import is_compile_supported, counters\n")
    path.write_text(changed)
    done, said = P.apply_to(path, P.VERSION)
    assert done and "torchvision's code changed; left as it is" in said and path.read_text() == changed
    path.write_text(original)
    assert P.apply_to(path, P.VERSION, check=True) == (False, f"{path}: torchvision 0.29.1 is not patched "
                                                              "(run `bash envs/setup.sh`)")
    assert path.read_text() == original
    done, said = P.apply_to(path, P.VERSION)
    assert done and said.endswith("patched torchvision 0.29.1 (envs/patches/torchvision-dynamo-import.md)")
    assert P.is_patched(path.read_text()) and P.apply_to(path, P.VERSION)[1].endswith("is patched")
    compile(path.read_text(), str(path), "exec")
