"""Reader of Fashion-MNIST's native IDX files (the demo's pretraining data)."""
from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from chexflow.data.config import ShardConfig
from chexflow.data import images
from chexflow.data.dataset import Dataset, DatasetInfo, Report, ShardError
from chexflow.data.sources import RemoteFile, Source
from chexflow.fsutil import MAX_READ_BYTES, open_regular

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]

_FMNIST_BASE = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# md5: published in the Fashion-MNIST README. sha256 and size: of the official files, computed
# from the Debian package dataset-fashion-mnist after restoring their gzip header (see below);
# the restored bytes reproduce all four published md5s.
_FMNIST = (
    # name, md5, sha256, size, role
    ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
     "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", 26421880, "archive"),
    ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe",
     "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", 29515, "labels"),
    ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79",
     "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", 4422102, "archive"),
    ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310",
     "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", 5148, "labels"),
)
# Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist) ships the same compressed
# streams, but dh_strip_nondeterminism rewrote each gzip header: FNAME dropped, MTIME set to the
# packaging time. The official header is FLG=FNAME, this MTIME, XFL=0, OS=3 (Unix), the name
# without ".gz". debian_gzip_header gives the official header for chexflow.data.download to write.
FASHION_MNIST_GZIP_MTIME = {
    "train-images-idx3-ubyte.gz": 1504176606,   # 2017-08-31 10:50:06 UTC
    "train-labels-idx1-ubyte.gz": 1504176606,
    "t10k-images-idx3-ubyte.gz": 1504176627,    # 2017-08-31 10:50:27 UTC
    "t10k-labels-idx1-ubyte.gz": 1504176627,
}


def debian_gzip_header(file: RemoteFile, path: Path) -> tuple[bytes, int] | None:
    """(the official gzip header, 10): what replaces a Debian copy's normalised 10-byte header
    (no optional fields); None for any other copy (taken as it is and checked by the pins)."""
    mtime = FASHION_MNIST_GZIP_MTIME.get(file.name)
    if mtime is None or not Path(path).is_file():
        return None
    with open_regular(path) as fh:
        head = fh.read(10)
    if len(head) < 10 or head[:4] != b"\x1f\x8b\x08\x00":      # gzip, deflate, FLG 0: normalised
        return None
    name = file.name.removesuffix(".gz").encode("latin-1") + b"\0"
    return b"\x1f\x8b\x08\x08" + struct.pack("<I", mtime) + head[8:10] + name, 10   # FLG = FNAME; XFL, OS kept


def source() -> Source:
    return Source(
        name="fashion_mnist",
        title="Fashion-MNIST (Zalando Research)",
        files=tuple(RemoteFile(name=n, url=_FMNIST_BASE + n, md5=md5, sha256=sha, size=size, role=role)
                    for n, md5, sha, size, role in _FMNIST),
        how_to_obtain="Official files at " + _FMNIST_BASE + " (no registration needed).",
        local_header=debian_gzip_header,
    )


# part name -> (images file, labels file): the official train and test ("t10k") files
PARTS = {part: tuple(name for name, *_ in _FMNIST if name.startswith(f"{part}-")) for part in ("train", "t10k")}


class IdxError(ValueError):
    """An IDX file is truncated or not what its header says."""


def read_idx(path: Path) -> np.ndarray:
    """Read a (gzipped) IDX file into a uint8 array of the shape its header declares."""
    path = Path(path)
    try:     # a regular file only (a FIFO would block, a link to /dev/zero never end), read to a bound
        with open_regular(path) as raw, (gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw) as fh:
            data = fh.read(MAX_READ_BYTES + 1)
    except (OSError, EOFError) as exc:
        raise IdxError(f"{path}: cannot read IDX file ({exc})") from exc
    if len(data) > MAX_READ_BYTES:
        raise IdxError(f"{path}: more than {MAX_READ_BYTES:,} bytes (uncompressed); not an IDX file of Fashion-MNIST")
    if len(data) < 4:
        raise IdxError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise IdxError(f"{path}: not an unsigned-byte IDX file (its first 4 bytes are not 0, 0, 0x08, ndim)")
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


@dataclass(frozen=True)
class FashionMNIST(Dataset):
    """Official train and test files; val carved out of train (seeded); each image is its own "patient"."""
    name: str = "fashion_mnist"
    stage: str = "pretrain"
    split_roles: tuple[str, ...] = ("archive", "labels")

    def source(self, n_archives: int | None = None) -> Source:
        return source()

    def parts(self, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
        return list(PARTS)

    def part_files(self, source: Source, part: str) -> list[RemoteFile]:
        if part not in PARTS:
            raise ShardError(f"fashion_mnist has no part {part!r} (parts: {list(PARTS)})")
        return [f for f in source.files if f.role in ("archive", "labels") and f.name.startswith(f"{part}-")]

    def info(self, raw_dir: Path | None = None) -> DatasetInfo:
        return DatasetInfo(self.name, "Fashion-MNIST", "multiclass", tuple(CLASSES), False,
                           "official train/test files; val carved out of train (seeded)")

    def split(self, raw_dir: Path, cfg: ShardConfig, *, expected: object = None) -> pd.DataFrame:
        frames = []
        for part, split in (("train", None), ("t10k", "test")):
            imgs, _ = read_part(raw_dir, part)
            names = image_names(part, len(imgs))
            frames.append(pd.DataFrame({"image": names, "patient": names, "split": split or "train"}))
        df = pd.concat(frames, ignore_index=True)
        train = df.index[df["split"] == "train"].to_numpy()
        rng = np.random.default_rng(cfg.split_seed)
        n_val = int(round(cfg.val_fraction * len(train)))
        df.loc[rng.choice(train, size=n_val, replace=False), "split"] = "val"
        return df

    def samples(self, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
                report: Report) -> Iterator[tuple]:
        split_of = dict(zip(splits["image"], splits["split"]))
        patient_of = dict(zip(splits["image"], splits["patient"]))
        imgs, labels = read_part(raw_dir, part)
        images_file = PARTS[part][0]
        for i, (key, img, lbl) in enumerate(zip(image_names(part, len(imgs)), imgs, labels)):
            yield key, str(patient_of[key]), split_of[key], np.int64(lbl), img, f"{images_file}[{i}]"

    def decode(self, data: np.ndarray, key: str, cfg: ShardConfig) -> np.ndarray:
        return images.resize_square(data, cfg.image_size)


ADAPTER = FashionMNIST()
