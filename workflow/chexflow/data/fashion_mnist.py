"""Reader of Fashion-MNIST's native IDX files (the demo's pretraining data)."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from chexflow.data.parts import FASHION_MNIST_PARTS

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]

# part name -> (images file, labels file)
PARTS = FASHION_MNIST_PARTS


class IdxError(ValueError):
    """An IDX file is truncated or not what its header says."""


def read_idx(path: Path) -> np.ndarray:
    """Read a (gzipped) IDX file into a uint8 array of the shape its header declares."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError) as exc:
        raise IdxError(f"{path}: cannot read IDX file ({exc})") from exc
    if len(data) < 4:
        raise IdxError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise IdxError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    expected = int(np.prod(dims))
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != expected:
        raise IdxError(f"{path}: header declares {dims} = {expected} bytes, file holds {body.size}")
    return body.reshape(dims)


def read_part(raw_dir: Path, part: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) int64 of part 'train' or 't10k'."""
    if part not in PARTS:
        raise KeyError(f"Fashion-MNIST has parts {sorted(PARTS)}, not {part!r}")
    img_name, lbl_name = PARTS[part]
    images = read_idx(Path(raw_dir) / img_name)
    labels = read_idx(Path(raw_dir) / lbl_name).astype(np.int64)
    if images.shape[0] != labels.shape[0]:
        raise IdxError(f"{raw_dir}/{img_name}: {images.shape[0]} images but {labels.shape[0]} labels")
    return images, labels


def image_names(part: str, n: int) -> list[str]:
    return [f"{part}_{i:05d}" for i in range(n)]
