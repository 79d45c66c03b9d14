"""An exact edit of an installed package's source: the text it replaces, the text it puts there, a marker.

Used by the installers that only save time (``torchvision_dynamo``, ``torch_dynamo``): each edit is written for
one release and one exact text, is idempotent (its marker), and never fails an installation: another release,
or code that is not what the edit expects, is left as it is with a line that says so. ``--check`` only reports
(exit 1 when the release the edit is written for is installed and not patched).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from chexflow.fsutil import write_text_atomic


class PatchError(RuntimeError):
    """The installed file is not the code the edit was written for."""


@dataclass(frozen=True)
class SourcePatch:
    dist: str               # the distribution (``importlib.metadata`` name)
    version: str            # the release the edit is written for (envs/requirements.txt pins it)
    module: str             # the module whose file is edited
    original: str           # the text replaced, exactly once in the file
    replacement: str        # the text put there; it holds ``marker``
    marker: str             # the line that says the file is patched, and where the edit is written up
    writeup: str            # envs/patches/<name>.md

    def __post_init__(self) -> None:
        assert self.marker in self.replacement, f"{self.module}: the replacement must hold the marker"

    def is_patched(self, text: str) -> bool:
        return self.marker in text

    def patch_text(self, text: str, *, source: str | None = None) -> str:
        """``text`` (the module's source) with the edit applied; unchanged if it already is."""
        if self.is_patched(text):
            return text
        if text.count(self.original) != 1:
            first = self.original.strip().splitlines()[0]
            raise PatchError(f"{source or self.module}: the text this patch replaces (from {first!r}) is there "
                             f"{text.count(self.original)} times, not once: {self.dist}'s code changed")
        return text.replace(self.original, self.replacement)

    def module_file(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise PatchError(f"{self.dist} is not installed")
        return Path(spec.origin)

    def apply_to(self, path: Path, version: str, *, check: bool = False) -> tuple[bool, str]:
        """Patch ``path``, the module's file in ``dist`` ``version``: (done or nothing to do, what happened)."""
        if version != self.version:
            return True, (f"{self.dist} {version}: left as it is (the patch is written for {self.version}; "
                          f"{self.writeup})")
        text = path.read_text(encoding="utf-8")
        if self.is_patched(text):
            return True, f"{path}: {self.dist} {version} is patched"
        try:
            new = self.patch_text(text, source=str(path))
        except PatchError as exc:
            return True, f"{exc}; left as it is (it only costs time: {self.writeup})"
        if check:
            return False, f"{path}: {self.dist} {version} is not patched (run `bash envs/setup.sh`)"
        compile(new, str(path), "exec")         # a patch that does not even compile is never written
        write_text_atomic(path, new)
        return True, f"{path}: patched {self.dist} {version} ({self.writeup})"


def main(patches: tuple[SourcePatch, ...], prog: str, say: str, description: str,
         argv: list[str] | None = None) -> int:
    """The installer's command line: apply (or ``--check``) each of ``patches``, one line each."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--check", action="store_true", help="only report whether the installed files are patched")
    args = ap.parse_args(argv)
    code = 0
    for patch in patches:
        try:
            ok, said = patch.apply_to(patch.module_file(), importlib.metadata.version(patch.dist), check=args.check)
        except PatchError as exc:
            ok, said = False, str(exc)
        print(say, said, file=sys.stdout if ok else sys.stderr)
        code = code or (0 if ok else 1)
    return code
