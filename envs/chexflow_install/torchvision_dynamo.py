"""Patch torchvision 0.29.1 so that ``import torchvision`` no longer imports torch._dynamo (2.4 CPU-s a process).

``torchvision/ops/roi_align.py`` imports ``torch._dynamo.utils.is_compile_supported`` at its top, and
``import torchvision`` imports every op: every process that builds a model imports TorchDynamo and Inductor's
configuration, 2.4 CPU-s and 140 MiB on this machine kind, before its first line of work. An evaluation,
prediction or report job never needs them; a training rank imports them anyway when torch.optim makes its
optimizer (torch 2.14), so for it the cost moves, it does not go. The same file
wraps its compiled fallback in ``lazy_compile``, whose docstring gives the reason: to avoid "eagerly importing
dynamo" (upstream pytorch/vision#8436: "importing dynamo has undesirable side effects for eager mode only
users"). The one eager import left is the function that decides whether the fallback may compile, used only
when torchvision's C++ ops are missing or deterministic algorithms run on a GPU. The patch imports it when
that call is made. Nothing else changes; a run that compiles (``compile: true``) imports dynamo as before.
Written up, with its measurement, in envs/patches/torchvision-dynamo-import.md.

Applied by ``envs/setup.sh`` (``python -m chexflow_install.torchvision_dynamo``) like the SLURM plugin's fix:
idempotent (a marker), only to the release it was written for. It only saves time, so unlike that fix it never
fails an installation: another torchvision, or code that is not what it expects, is left as it is with a line
that says so. ``--check`` only reports (exit 1 when the installed release 0.29.1 is not patched).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from chexflow.fsutil import write_text_atomic

DIST = "torchvision"
VERSION = "0.29.1"                   # the release this patch is written for (envs/requirements.txt)
MODULE = "torchvision.ops.roi_align"
WRITEUP = "envs/patches/torchvision-dynamo-import.md"
MARKER = f"# chexflow patch: dynamo imported when used ({WRITEUP})"
SAY = "torchvision-patch:"

# the eager import, replaced by a function of the same name (its one call site stays as it is)
ORIGINAL = "from torch._dynamo.utils import is_compile_supported\n"
REPLACEMENT = (f"{MARKER}\n"
               "def is_compile_supported(device_type):\n"
               "    from torch._dynamo.utils import is_compile_supported as supported\n"
               "\n"
               "    return supported(device_type)\n")


class PatchError(RuntimeError):
    """The installed file is not the code this patch was written for."""


def is_patched(text: str) -> bool:
    return MARKER in text


def patch_text(text: str, *, source: str = "torchvision/ops/roi_align.py") -> str:
    """``text`` (roi_align.py) with the patch applied; unchanged if it already is."""
    if is_patched(text):
        return text
    if text.count(ORIGINAL) != 1:
        raise PatchError(f"{source}: the line this patch replaces ({ORIGINAL.strip()!r}) is there "
                         f"{text.count(ORIGINAL)} times, not once: torchvision's code changed")
    return text.replace(ORIGINAL, REPLACEMENT)


def module_file() -> Path:
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise PatchError(f"{DIST} is not installed")
    return Path(spec.origin)


def apply_to(path: Path, version: str, *, check: bool = False) -> tuple[bool, str]:
    """Patch ``path``, roi_align.py of torchvision ``version``: (done or nothing to do, what happened)."""
    if version != VERSION:
        return True, f"{DIST} {version}: left as it is (the patch is written for {VERSION}; {WRITEUP})"
    text = path.read_text(encoding="utf-8")
    if is_patched(text):
        return True, f"{path}: {DIST} {version} is patched"
    try:
        new = patch_text(text, source=str(path))
    except PatchError as exc:
        return True, f"{exc}; left as it is (it only costs time: {WRITEUP})"
    if check:
        return False, f"{path}: {DIST} {version} is not patched (run `bash envs/setup.sh`)"
    compile(new, str(path), "exec")         # a patch that does not even compile is never written
    write_text_atomic(path, new)
    return True, f"{path}: patched {DIST} {version} ({WRITEUP})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chexflow_install.torchvision_dynamo",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report whether the installed torchvision is patched")
    args = ap.parse_args(argv)
    try:
        ok, said = apply_to(module_file(), importlib.metadata.version(DIST), check=args.check)
    except PatchError as exc:
        ok, said = False, str(exc)
    print(SAY, said, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
