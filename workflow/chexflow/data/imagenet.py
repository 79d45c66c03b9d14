"""ImageNet ILSVRC2012 in its native layout, read into chexflow's shards (the pretraining data).

The release is three files (``chexflow.data.sources`` pins their md5s):

* ``ILSVRC2012_img_train.tar``: an uncompressed tar of 1000 per-class tars ``n01440764.tar`` ...,
  each holding that class's JPEGs ``n01440764_10026.JPEG`` ... (1,281,167 images);
* ``ILSVRC2012_img_val.tar``: 50,000 flat JPEGs ``ILSVRC2012_val_00000001.JPEG`` ...;
* ``ILSVRC2012_devkit_t12.tar.gz``: ``ILSVRC2012_devkit_t12/data/meta.mat`` (the synsets:
  ``ILSVRC2012_ID`` 1..1000 and ``WNID`` of the leaf classes) and
  ``ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt`` (one ILSVRC2012_ID per
  line, in val image order).

Labels follow ``torchvision.datasets.ImageNet``: the devkit is parsed as its
``parse_devkit_archive`` does (leaf synsets of meta.mat, val ground truth mapped through their
ILSVRC2012_IDs to WNIDs) and the class index is the position of the WNID in sorted order (0..999).
torchvision's helpers are not called directly: they are nested inside ``parse_devkit_archive``,
which insists on the real devkit's md5 and extracts to a temporary directory; here the devkit is
read in memory without extracting anything.

Shard jobs ("parts"): the train archive is split into ``train_parts`` parts by contiguous ranges of
sorted WNIDs (``train_000`` ...), plus one part ``val`` for the val archive. A train part opens the
outer tar with random access (its per-class tars are found from the outer headers; nothing else
of the 138 GB file is read) and streams its per-class tars *interleaved*: the next image is taken
from a class picked by a generator seeded with the part index, so every shard mixes the part's
classes instead of holding one or two whole classes (which a streaming loader could not undo).

Splits: ILSVRC2012 has a fixed split and no patients. ``splits.csv`` lists the val images of the
devkit ground truth (split ``val``); every image of the train archive is ``train``; the images
have no groups, so each image is its own "patient". There is no test split (the ILSVRC2012 test
labels were never published).

Images are decoded with PIL (JPEG in draft mode: luma only, at the smallest DCT scale keeping the
target size), converted to grey ``L`` (CMYK, palette, RGB(A) included: the models have a grey
stem), cut to the central square, resized to ``image_size`` and stored as raw uint8. A file that
fails to decode goes to the part's rejects with the reason; members that are not safe (the tar
'data' filter, absolute paths, links) are rejected too.
"""
from __future__ import annotations

import io
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from chexflow.data.config import ShardConfig
from chexflow.data import archives, images
from chexflow.data.archives import tarfile   # the one tarfile the readers check members with
from chexflow.data.dataset import Dataset, DatasetInfo, Report, ShardError
from chexflow.data.sources import RemoteFile, Source

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT = "ILSVRC2012_devkit_t12.tar.gz"
META_MAT = "ILSVRC2012_devkit_t12/data/meta.mat"
VAL_GROUND_TRUTH = "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt"
_IMAGE_EXT = (".jpeg", ".jpg")
VAL_PART = "val"
MAX_TRAIN_PARTS = 1000   # train_000 .. train_999: at most one part per class
# the devkit's files are read whole: meta.mat and the val ground truth are well under 1 MB each
_DEVKIT_MEMBER_BYTES = 16_000_000
_TRAIN_PART = re.compile(r"train_(\d{3})")


class ImageNetError(ValueError):
    """The devkit, an archive or a part name is not what ILSVRC2012 has; names the file."""


@dataclass(frozen=True)
class Devkit:
    """What the devkit says: the classes and the val labels."""
    wnids: tuple[str, ...]                  # sorted; the class index is the position
    words: tuple[str, ...]                  # words of each class, same order
    val_wnids: tuple[str, ...]              # WNID of val image i+1 (ILSVRC2012_val_{i+1:08d})

    def class_index(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.wnids)}


def val_image_name(i: int) -> str:
    """Name of the i-th (1-based) val image: ``ILSVRC2012_val_00000001.JPEG``."""
    return f"ILSVRC2012_val_{i:08d}.JPEG"


# --------------------------------------------------------------------------- the release's files

def source() -> Source:
    how = ("ImageNet (ILSVRC2012) requires registration at https://image-net.org/ ; download "
           "ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and ILSVRC2012_devkit_t12.tar.gz and give "
           "their directory (or a file:// / http(s) URL of it) as the mirror.")
    return Source(
        name="imagenet", title="ImageNet ILSVRC2012",
        files=(RemoteFile(TRAIN_TAR, None, md5="1d675b47d978889d74fa0da5fadfb00e", role="archive"),
               RemoteFile(VAL_TAR, None, md5="29b22e2961454d5413ddabcf34fc5622", role="archive"),
               RemoteFile(DEVKIT, None, md5="fa75699e90414af021442c21a62c3abf",
                          role="devkit")),
        how_to_obtain=how)


def check_train_parts(train_parts: int) -> int:
    if isinstance(train_parts, bool) or not isinstance(train_parts, int) or not 1 <= train_parts <= MAX_TRAIN_PARTS:
        raise ImageNetError(f"imagenet: train_parts must be an integer in 1..{MAX_TRAIN_PARTS}, got {train_parts!r}")
    return train_parts


def part_names(train_parts: int) -> list[str]:
    """``train_000`` ... ``train_{N-1}`` (class ranges of the train archive) and ``val``."""
    return [f"train_{i:03d}" for i in range(check_train_parts(train_parts))] + [VAL_PART]


# --------------------------------------------------------------------------- devkit

def parse_meta_mat(data: bytes, *, where: str) -> tuple[dict[int, str], dict[str, str]]:
    """``meta.mat`` -> (ILSVRC2012_ID -> WNID, WNID -> words) of the leaf synsets.

    As ``torchvision.datasets.imagenet.parse_devkit_archive``: ``loadmat(squeeze_me=True)``,
    the ``synsets`` struct array, only entries with ``num_children == 0``.
    """
    import scipy.io as sio

    try:
        mat = sio.loadmat(io.BytesIO(data), squeeze_me=True)
    except (ValueError, TypeError, OSError, EOFError, zlib.error, NotImplementedError) as exc:
        raise ImageNetError(f"{where}: cannot read meta.mat ({type(exc).__name__}: {exc})") from exc
    if "synsets" not in mat:
        raise ImageNetError(f"{where}: meta.mat has no 'synsets' (has {sorted(k for k in mat if not k.startswith('__'))})")
    synsets = np.atleast_1d(mat["synsets"])
    fields = synsets.dtype.names or ()
    needed = ("ILSVRC2012_ID", "WNID", "words", "num_children")
    missing = [f for f in needed if f not in fields]
    if missing:
        raise ImageNetError(f"{where}: meta.mat synsets lack field(s) {missing} (has {list(fields)})")
    idx_to_wnid: dict[int, str] = {}
    words: dict[str, str] = {}
    for s in synsets:
        if int(s["num_children"]) != 0:
            continue
        idx, wnid = int(s["ILSVRC2012_ID"]), str(s["WNID"])
        if idx in idx_to_wnid or wnid in words:
            raise ImageNetError(f"{where}: meta.mat lists ILSVRC2012_ID {idx} / WNID {wnid} twice")
        idx_to_wnid[idx] = wnid
        words[wnid] = str(s["words"])
    if not idx_to_wnid:
        raise ImageNetError(f"{where}: meta.mat has no leaf synsets (num_children == 0)")
    return idx_to_wnid, words


def parse_ground_truth(text: str, idx_to_wnid: dict[int, str], *, where: str) -> tuple[str, ...]:
    """``ILSVRC2012_validation_ground_truth.txt`` -> the WNID of every val image, in order."""
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        try:
            out.append(idx_to_wnid[int(line)])
        except (ValueError, KeyError):
            raise ImageNetError(f"{where}: line {lineno}: {line!r} is not an ILSVRC2012_ID of meta.mat") from None
    return tuple(out)


def read_devkit(path: Path | str) -> Devkit:
    """Read meta.mat and the val ground truth from the devkit ``.tar.gz`` in memory."""
    path = Path(path)
    fh = archives.open_archive(path, "ImageNet devkit")
    wanted = {META_MAT: None, VAL_GROUND_TRUTH: None}
    unsafe: list[str] = []
    try:
        with fh, tarfile.open(fileobj=fh, mode="r:gz") as tar:
            for member in archives.safe_members(tar, lambda name, why: unsafe.append(f"{name}: {why}"),
                                                max_bytes=_DEVKIT_MEMBER_BYTES):
                name = member.name[2:] if member.name.startswith("./") else member.name
                if name in wanted:
                    wanted[name] = _read_member(tar, member)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise ImageNetError(f"{path}: truncated or corrupt devkit archive ({type(exc).__name__}: {exc})") from exc
    missing = [n for n, data in wanted.items() if data is None]
    if missing:
        raise ImageNetError(f"{path}: devkit lacks {missing}" + (f" (unsafe members skipped: {unsafe[:3]})" if unsafe else ""))
    idx_to_wnid, words = parse_meta_mat(wanted[META_MAT], where=f"{path}:{META_MAT}")
    val_wnids = parse_ground_truth(wanted[VAL_GROUND_TRUTH].decode("ascii", "replace"), idx_to_wnid,
                                   where=f"{path}:{VAL_GROUND_TRUTH}")
    wnids = tuple(sorted(words))
    return Devkit(wnids=wnids, words=tuple(words[w] for w in wnids), val_wnids=val_wnids)


# --------------------------------------------------------------------------- parts

def train_part_classes(part: str, train_parts: int, wnids: tuple[str, ...]) -> tuple[str, ...]:
    """The WNIDs of train part ``part``: a contiguous range of the sorted WNIDs (sizes differ by <= 1)."""
    m = _TRAIN_PART.fullmatch(part)
    if m is None or int(m.group(1)) >= check_train_parts(train_parts):
        raise ImageNetError(f"imagenet: no part {part!r}; the parts are {part_names(train_parts)[0]} .. "
                            f"train_{train_parts - 1:03d} and {VAL_PART}")
    if train_parts > len(wnids):
        raise ImageNetError(f"imagenet: train_parts={train_parts} but the devkit has only {len(wnids)} classes")
    k = int(m.group(1))
    bounds = np.linspace(0, len(wnids), train_parts + 1).round().astype(int)
    return tuple(wnids[bounds[k]:bounds[k + 1]])


def _is_image(name: str) -> bool:
    return name.lower().endswith(_IMAGE_EXT)


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    fh = tar.extractfile(member)
    return fh.read() if fh is not None else b""


def _class_stream(outer: tarfile.TarFile, member: tarfile.TarInfo, wnid: str, where: str,
                  report: Callable[[str, str], None], max_member_bytes: int | None
                  ) -> Iterator[tuple[str, str, bytes, str]]:
    """(wnid, image name, bytes, member path) of one per-class tar, streamed from inside the outer tar."""
    fh = outer.extractfile(member)
    try:
        with tarfile.open(fileobj=fh, mode="r|") as inner:
            for m in archives.safe_members(inner, lambda name, why: report(f"{member.name}/{name}", why),
                                           max_bytes=max_member_bytes):
                if _is_image(m.name):
                    yield wnid, archives.posix_basename(m.name), _read_member(inner, m), f"{member.name}/{m.name}"
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise archives.ArchiveError(f"{where}: per-class tar {member.name} is truncated or corrupt "
                               f"({type(exc).__name__}: {exc})") from exc


def iter_train_part(path: Path | str, classes: tuple[str, ...], *, seed: int,
                    on_skip: Callable[[str, str], None], max_member_bytes: int | None = None
                    ) -> Iterator[tuple[str, str, bytes, str]]:
    """(wnid, image name, bytes, member path) of the images of ``classes`` in the train archive, interleaved.

    The per-class tars are streamed side by side; each next image comes from a class drawn
    uniformly among those not yet exhausted by ``numpy.random.default_rng(seed)``, so the order
    is the same on every run (a part that crashed resumes). Unsafe members, and images of more
    than ``max_member_bytes`` (skipped unread), go to ``on_skip``.
    """
    path = Path(path)
    fh = archives.open_archive(path, "ImageNet train archive")
    try:
        with fh, tarfile.open(fileobj=fh, mode="r:") as outer:   # random access: headers only, data seeked over
            members: dict[str, tarfile.TarInfo] = {}
            for m in archives.safe_members(outer, on_skip):
                base = archives.posix_basename(m.name)
                if base.endswith(".tar"):
                    members[base[:-4]] = m
            missing = [w for w in classes if w not in members]
            if missing:
                raise ImageNetError(f"{path}: no per-class tar for {len(missing)} class(es) of the devkit, "
                                    f"e.g. {[w + '.tar' for w in missing[:5]]}")
            streams = [_class_stream(outer, members[w], w, str(path), on_skip, max_member_bytes) for w in classes]
            rng = np.random.default_rng(seed)
            while streams:
                i = int(rng.integers(len(streams)))
                try:
                    yield next(streams[i])
                except StopIteration:
                    streams.pop(i)
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise archives.ArchiveError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from exc
    except OSError as exc:
        raise archives.ArchiveError(f"{path}: cannot read archive ({exc})") from exc


def iter_val(path: Path | str, *, on_skip: Callable[[str, str], None],
             max_member_bytes: int | None = None) -> Iterator[tuple[str, bytes, str]]:
    """(image name, bytes, member path) of the val archive, streamed in archive order (images of more
    than ``max_member_bytes`` are skipped unread and go to ``on_skip``)."""
    path = Path(path)
    fh = archives.open_archive(path, "ImageNet val archive")
    try:
        with fh, tarfile.open(fileobj=fh, mode="r|") as tar:
            for m in archives.safe_members(tar, on_skip, max_bytes=max_member_bytes):
                if _is_image(m.name):
                    yield archives.posix_basename(m.name), _read_member(tar, m), m.name
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise archives.ArchiveError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from exc
    except OSError as exc:
        raise archives.ArchiveError(f"{path}: cannot read archive ({exc})") from exc


def val_split_rows(devkit: Devkit) -> list[str]:
    """The val image names the devkit ground truth labels (``splits.csv`` rows of split val)."""
    return [val_image_name(i) for i in range(1, len(devkit.val_wnids) + 1)]


def iter_part(raw_dir: Path | str, part: str, *, train_parts: int, devkit: Devkit,
              val_images: set[str], report: Callable[[str, str], None], max_member_bytes: int | None = None
              ) -> Iterator[tuple[str, str, np.int64, bytes, str]]:
    """(image name, split, class index, bytes, origin) of one part, in a deterministic order; the
    origin names the archive and the member (``ILSVRC2012_img_val.tar:ILSVRC2012_val_00000001.JPEG``).

    ``val_images``: the val rows of ``splits.csv``; a val archive image not among them is reported
    (``report(name, reason)``) and left out, as are unsafe archive members and images of more than
    ``max_member_bytes`` (skipped unread).
    """
    raw_dir = Path(raw_dir)
    index = devkit.class_index()
    if part == VAL_PART:
        val_label = dict(zip(val_split_rows(devkit), devkit.val_wnids))
        for name, data, member in iter_val(raw_dir / VAL_TAR, on_skip=report, max_member_bytes=max_member_bytes):
            if name not in val_images or name not in val_label:
                report(member, "not in the devkit's val ground truth / splits.csv")
                continue
            yield name, "val", np.int64(index[val_label[name]]), data, f"{VAL_TAR}:{member}"
        return
    classes = train_part_classes(part, train_parts, devkit.wnids)
    seed = int(part.rsplit("_", 1)[1])
    for wnid, name, data, member in iter_train_part(raw_dir / TRAIN_TAR, classes, seed=seed, on_skip=report,
                                                    max_member_bytes=max_member_bytes):
        yield name, "train", np.int64(index[wnid]), data, f"{TRAIN_TAR}:{member}"


def decode(data: bytes, *, name: str, size: int, max_pixels: int | None = None) -> np.ndarray:
    """JPEG (or PNG) -> uint8 ``size x size`` grey: central square, resized.

    Raises ``images.DecodeError`` naming the image when it cannot be decoded completely, or its
    header declares more than ``max_pixels``.
    """
    return images.resize_square(images.decode_grey(data, name=name, draft=size, max_pixels=max_pixels), size)


# --------------------------------------------------------------------------- the adapter (chexflow.data.registry)

@dataclass(frozen=True)
class ImageNet(Dataset):
    """ILSVRC2012: ``train_parts`` class ranges of the train archive and ``val``, each read with
    the devkit; the fixed official split (val = the official val set)."""
    name: str = "imagenet"
    stage: str = "pretrain"
    split_roles: tuple[str, ...] = ("devkit",)   # the val ground truth
    shard_options: tuple[str, ...] = ("train_parts", "max_member_mb", "max_image_megapixels")
    val_carved: bool = False

    def source(self, n_archives: int | None = None) -> Source:
        return source()

    def parts(self, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
        return part_names(cfg.train_parts)

    def check_settings(self, cfg: ShardConfig) -> list[str]:
        if cfg.val_fraction != 0:
            return [f"shards.imagenet.val_fraction: {cfg.val_fraction} is not 0: the validation split is the "
                    "official ILSVRC2012 val set"]
        return []

    def part_files(self, source: Source, part: str) -> list[RemoteFile]:
        archive = VAL_TAR if part == VAL_PART else TRAIN_TAR
        return [source.file(archive), *(f for f in source.files if f.role == "devkit")]

    def info(self, raw_dir: Path | None = None) -> DatasetInfo:
        """The classes come from the devkit: without ``raw_dir`` the labels are empty (``gather``
        then takes them from the part manifests)."""
        labels = read_devkit(Path(raw_dir) / DEVKIT).wnids if raw_dir is not None else ()
        return DatasetInfo(self.name, "ImageNet ILSVRC2012", "multiclass", tuple(labels), False,
                           "official ILSVRC2012 train and val sets")

    def split(self, raw_dir: Path, cfg: ShardConfig, *, expected: object = None) -> pd.DataFrame:
        """Fixed: the official val set is "val"; every train-archive image is "train" and is not
        listed (listing 1.28M names would mean reading all 1000 per-class tars here)."""
        problems = self.check_settings(cfg)
        if problems:
            raise ShardError(problems[0])
        names = val_split_rows(read_devkit(Path(raw_dir) / DEVKIT))
        return pd.DataFrame({"image": names, "patient": names, "split": "val"})

    def samples(self, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
                report: Report) -> Iterator[tuple]:
        """Each image is its own "patient" (train images are not in the split table)."""
        devkit = read_devkit(Path(raw_dir) / DEVKIT)
        val_images = set(splits["image"][splits["split"] == "val"])
        for key, split, target, data, origin in iter_part(raw_dir, part, train_parts=cfg.train_parts, devkit=devkit,
                                                          val_images=val_images, report=report,
                                                          max_member_bytes=images.million(cfg.max_member_mb)):
            yield key, key, split, target, data, origin

    def decode(self, data: bytes, key: str, cfg: ShardConfig) -> np.ndarray:
        return decode(data, name=key, size=cfg.image_size, max_pixels=images.million(cfg.max_image_megapixels))


ADAPTER = ImageNet()
