"""Which files ``chexflow predict`` reads, and reading one of them to the training path's stored pixels."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from chexflow.data import dicom, images, tables
from chexflow.data.config import ShardConfig
from chexflow.fsutil import NotRegularFile, check_regular, open_regular, read_regular, read_text_regular
from chexflow.predict.config import PredictConfig

SUFFIXES = (".png", ".jpg", ".jpeg", ".dcm", ".dicom")
DICOM_SUFFIXES = (".dcm", ".dicom")


class NoInputsError(ValueError):
    """No image to predict on; the message names what was searched."""


class ScannedPath(type(Path())):
    """A file found by scanning a folder: a symbolic link there is never followed (it could lead out
    of the folder); a path the user named (given, or in a ``.txt`` list) is a plain ``Path``."""


def list_inputs(sources: Sequence[str | Path]) -> list[Path]:
    """The image files named by ``sources``, in order, each once.

    A folder: every file under it (recursively, sorted, symbolic links to folders not descended)
    with a suffix of ``SUFFIXES`` or without a suffix but with the DICOM preamble (PACS exports name
    files ``IM0001``), hidden files and ``DICOMDIR`` left out; these are ``ScannedPath`` (a link among
    them gets its row's error, unfollowed). A ``.txt`` file (a regular file of at most
    ``MAX_LIST_BYTES``): one path per line (relative to the list's folder; blank lines and ``#``
    comments skipped), kept even when missing so that its row reports it. Any other file: itself.
    """
    found: dict[Path, None] = {}
    for src in sources:
        path = Path(src)
        if path.is_dir():
            found.update(dict.fromkeys(_scan(path)))
        elif path.suffix.lower() == ".txt" and path.is_file():
            found.update(dict.fromkeys(_listed(path)))
        elif path.exists() or path.is_symlink():     # a FIFO, a device, a dangling link: its row says why
            found[path] = None
        else:
            raise NoInputsError(f"predict input {src}: no such file or folder")
    if not found:
        searched = ", ".join(map(str, sources)) or "(none given: predict.inputs)"
        raise NoInputsError(f"no image files ({', '.join(SUFFIXES)} or DICOM) in {searched}")
    return list(found)


def _scan(folder: Path) -> list[Path]:
    out = []
    for top, dirs, names in os.walk(folder, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = ScannedPath(top, name)
            if name.startswith(".") or name == "DICOMDIR":
                continue
            suffix = path.suffix.lower()
            if suffix in SUFFIXES or (not suffix and _has_dicom_preamble(path)):
                out.append(path)
    return sorted(out)


def _has_dicom_preamble(path: Path) -> bool:
    try:
        with open_regular(path, follow_symlinks=False) as fh:
            return dicom.is_dicom(fh.read(132))
    except OSError:
        return False


MAX_LIST_BYTES = 64 << 20     # a list of image paths (a million lines of 64 characters)


def _listed(list_file: Path) -> list[Path]:
    base = list_file.parent
    try:
        text = read_text_regular(list_file, max_bytes=MAX_LIST_BYTES, what="list of images")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise NoInputsError(f"predict input {list_file}: cannot read the list ({reason})") from None
    lines = (line.strip() for line in text.splitlines())
    return [base / line for line in lines if line and not line.startswith("#")]     # an absolute line stays absolute


@dataclass(frozen=True)
class Reader:
    """Reads one file to uint8 ``stored_size x stored_size`` grey pixels, the way the training path
    stored its images: PNG/JPEG through the shard stage's decoding the model file names
    (``decoding``, ``data.tables.DECODINGS``; ``shard``: the stored side and pixel bound), DICOM through
    ``data.dicom`` and the same centre square and resize (``images.resize_square``). Plain values only:
    loader worker processes get a copy."""
    shard: ShardConfig
    modalities: tuple[str, ...] = dicom.RADIOGRAPH_MODALITIES
    max_bytes: int = 512 << 20
    decoding: str = "grey"

    def read(self, path: Path) -> tuple[np.ndarray, str]:
        """``(pixels, format)``; ``images.DecodeError`` (its ``reason`` says why) for a file that
        cannot be read, is too large, or is DICOM but not a radiograph."""
        name = str(path)
        try:
            size = check_regular(path, follow_symlinks=not isinstance(path, ScannedPath)).st_size
            if size > self.max_bytes:
                raise images.DecodeError(name, f"{size / 2**20:.1f} MB, above predict.max_file_mb "
                                               f"({self.max_bytes / 2**20:.0f} MB); not read")
            data = read_regular(path, max_bytes=self.max_bytes, follow_symlinks=not isinstance(path, ScannedPath))
        except NotRegularFile as exc:
            raise images.DecodeError(name, exc.strerror) from None
        except OSError as exc:
            raise images.DecodeError(name, f"cannot read the file ({exc.strerror or type(exc).__name__})") from None
        if dicom.is_dicom(data) or path.suffix.lower() in DICOM_SUFFIXES:
            full = dicom.decode_dicom(data, name=name, modalities=self.modalities,
                                      max_pixels=images.million(self.shard.max_image_megapixels))
            return images.resize_square(full, self.shard.image_size), "DICOM"
        return tables.DECODINGS[self.decoding](data, name, self.shard), _format(data)


def reader_for(dataset: str, stored_size: int, cfg: PredictConfig, decoding: str = "grey") -> Reader:
    """The reader of ``chexflow predict`` for a model trained on ``dataset`` stored at ``stored_size`` px,
    its files read by ``decoding`` (the model file's ``predict.decoding``)."""
    shard = ShardConfig(dataset=dataset, image_size=stored_size, max_image_megapixels=cfg.max_image_megapixels)
    return Reader(shard, tuple(cfg.modalities), cfg.max_file_mb << 20, decoding)


def _format(data: bytes) -> str:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    return "other"
