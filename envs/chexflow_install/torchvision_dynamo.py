"""Patch torchvision 0.29.1 so that ``import torchvision`` no longer imports torch._dynamo (2.4 CPU-s a process).

``torchvision/ops/roi_align.py`` imports ``torch._dynamo.utils.is_compile_supported`` at its top, and
``import torchvision`` imports every op: every process that builds a model imports TorchDynamo and Inductor's
configuration, 2.4 CPU-s and 140 MiB on this machine kind, before its first line of work. An evaluation,
prediction or report job never needs them; nor does a training rank that does not compile, once torch.optim
no longer imports them either (``chexflow_install.torch_dynamo``). The same file
wraps its compiled fallback in ``lazy_compile``, whose docstring gives the reason: to avoid "eagerly importing
dynamo" (upstream pytorch/vision#8436: "importing dynamo has undesirable side effects for eager mode only
users"). The one eager import left is the function that decides whether the fallback may compile, used only
when torchvision's C++ ops are missing or deterministic algorithms run on a GPU. The patch imports it when
that call is made. Nothing else changes; a run that compiles (``compile: true``) imports dynamo as before.
Written up, with its measurement, in envs/patches/torchvision-dynamo-import.md.

Applied by ``envs/setup.sh`` (``python -m chexflow_install.torchvision_dynamo``) like the SLURM plugin's fix:
idempotent (a marker), only to the release it was written for. It only saves time, so unlike that fix it never
fails an installation (``chexflow_install.source_patch``). ``--check`` only reports (exit 1 when the installed
release 0.29.1 is not patched).
"""
from __future__ import annotations

import sys

from chexflow_install.source_patch import PatchError, SourcePatch, main as _main

__all__ = ["PATCH", "PatchError", "apply_to", "is_patched", "main", "module_file", "patch_text"]

DIST = "torchvision"
VERSION = "0.29.1"                   # the release this patch is written for (envs/requirements.txt)
WRITEUP = "envs/patches/torchvision-dynamo-import.md"
MARKER = f"# chexflow patch: dynamo imported when used ({WRITEUP})"

# the eager import, replaced by a function of the same name (its one call site stays as it is)
ORIGINAL = "from torch._dynamo.utils import is_compile_supported\n"
REPLACEMENT = (f"{MARKER}\n"
               "def is_compile_supported(device_type):\n"
               "    from torch._dynamo.utils import is_compile_supported as supported\n"
               "\n"
               "    return supported(device_type)\n")

PATCH = SourcePatch(dist=DIST, version=VERSION, module="torchvision.ops.roi_align", original=ORIGINAL,
                    replacement=REPLACEMENT, marker=MARKER, writeup=WRITEUP)
is_patched, patch_text, module_file, apply_to = PATCH.is_patched, PATCH.patch_text, PATCH.module_file, PATCH.apply_to


def main(argv: list[str] | None = None) -> int:
    return _main((PATCH,), "python -m chexflow_install.torchvision_dynamo", "torchvision-patch:",
                 __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
