"""A tiny ChestX-ray14 mirror in the exact release layout, for tests of the real ``nih`` source.

12 ``images_NNN.tar.gz`` archives of ``images/<name>.png`` members, ``Data_Entry_2017_v2020.csv``
(real rows of the NIH label file, all its columns) and both split lists; the images are phantoms
rendered at 32 px, a few of them re-encoded at the release's 1,024 px and a few as RGBA PNGs
(as some NIH images are). The packaging is the phantom release's (``phantoms.write_archive`` /
``write_tables``), so the layout is the same code path the demo uses.

Pinned archive checksums and the published table sizes cannot match such a mirror: ``registry``
is the test-only override (``chexflow.data.sources.load_test_registry``) that tests hand to the
stages through ``$CHEXFLOW_TEST_REGISTRY``.
"""
from __future__ import annotations

import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from chexflow.data import nih, phantoms
from chexflow.data.sources import NIH_N_ARCHIVES, NIH_TABLES

BIG = 1024          # the release's image side


@dataclass(frozen=True)
class Mirror:
    root: Path                        # the mirror directory (serve it over HTTP or use it as a path)
    archives: dict[str, list[str]]    # archive name -> member image names, in archive order
    n_images: int                     # rows of the label table (= listed images)
    big: tuple[str, ...]              # images stored at 1,024 px
    rgba: tuple[str, ...]             # images stored as RGBA
    registry: dict                    # the test registry override for this mirror

    def write_registry(self, path: Path) -> Path:
        path.write_text(json.dumps(self.registry))
        return path


def _png(img: np.ndarray, *, size: int | None = None, rgba: bool = False) -> bytes:
    im = Image.fromarray(img, mode="L")
    if size is not None:
        im = im.resize((size, size), Image.Resampling.BILINEAR)
    if rgba:
        im = im.convert("RGBA")       # opaque alpha, as in the NIH RGBA PNGs
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_nih_mirror(root: Path, *, per_archive: int = 30, seed: int = 11, n_big: int = 3, n_rgba: int = 3,
                    drop: tuple[str, ...] = (), corrupt: tuple[str, ...] = ()) -> Mirror:
    """Write the mirror under ``root/mirror`` (generated phantoms under ``root/generated``).

    ``drop``: listed images left out of every archive; ``corrupt``: images stored as truncated PNGs.
    """
    generated = root / "generated"
    info = phantoms.make_release(generated, n_images=per_archive * NIH_N_ARCHIVES, image_size=32,
                                 images_per_archive=per_archive, test_fraction=0.25, seed=seed)
    assert len(info.archives) == NIH_N_ARCHIVES
    mirror = root / "mirror"
    mirror.mkdir(parents=True, exist_ok=True)
    members: dict[str, list[tuple[str, bytes]]] = {}
    for name in info.archives:
        members[name] = [(img, data) for img, data in nih.iter_archive(generated / name)]
    first = [img for img, _ in members[info.archives[0]]]
    big = tuple(first[:n_big])                       # 1,024 px (the last of them also RGBA)
    rgba = tuple(first[n_big - 1:n_big - 1 + n_rgba])
    archives: dict[str, list[str]] = {}
    for name, items in members.items():
        out = []
        for img, data in items:
            if img in drop:
                continue
            if img in big or img in rgba:
                pixels = nih.decode_grey(data, name=img)
                data = _png(pixels, size=BIG if img in big else None, rgba=img in rgba)
            if img in corrupt:
                data = data[: len(data) // 2]
            out.append((img, data))
        phantoms.write_archive(mirror / name, out)
        archives[name] = [img for img, _ in out]
    for table in NIH_TABLES:
        shutil.copyfile(generated / table, mirror / table)
    files = {name: {"sha256": _sha256(mirror / name), "size": (mirror / name).stat().st_size}
             for name in [*archives, *NIH_TABLES]}
    content = {"n_images": info.n_images, "n_patients": info.n_patients, "n_train_val": info.n_train_val,
               "n_test": info.n_test}
    return Mirror(root=mirror, archives=archives, n_images=info.n_images, big=big, rgba=rgba,
                  registry={"nih": {"files": files, "content": content}})
