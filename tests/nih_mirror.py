"""A tiny ChestX-ray14 mirror in the exact release layout, for tests of the real ``nih`` source.

12 ``images_NNN.tar.gz`` archives of ``images/<name>.png`` members, ``Data_Entry_2017_v2020.csv``
(real rows of the NIH label file, all its columns), both split lists and ``BBox_List_2017.csv`` (a
small one: where the phantoms' findings were drawn, in the release's 1,024 px frame); the images are phantoms
rendered at 32 px, a few of them re-encoded at the release's 1,024 px and a few as RGBA PNGs
(as some NIH images are). The packaging is the phantom release's (``phantoms.release.write_archive`` /
``write_tables``), so the layout is the same code path the demo uses.

Pinned archive checksums and the published table sizes cannot match such a mirror: ``registry``
is the test-only override (``chexflow.data.registry.load_test_registry``) that tests hand to the
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

from chexflow.data import images, nih
from chexflow.data.nih import NIH_N_ARCHIVES, NIH_TABLES, archive_name
from chexflow.data.phantoms.release import make_release, write_archive

BIG = 1024          # the release's image side
SIDE = 32           # the generated phantoms' side


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


def generate(root: Path, *, per_archive: int = 30, seed: int = 11) -> Path:
    """The phantom release (12 archives of ``per_archive`` 32 px images) a mirror is packed from."""
    info = make_release(root, n_images=per_archive * NIH_N_ARCHIVES, image_size=SIDE,
                        images_per_archive=per_archive, test_fraction=0.25, seed=seed)
    assert len(info.archives) == NIH_N_ARCHIVES
    return root


def make_nih_mirror(root: Path, generated: Path, *, n_big: int = 3, n_rgba: int = 3,
                    drop: tuple[tuple[int, int], ...] = (), corrupt: tuple[tuple[int, int], ...] = ()) -> Mirror:
    """Pack the mirror under ``root`` from a ``generate``d release.

    The first ``n_big`` images of archive 1 are stored at 1,024 px, ``n_rgba`` images from the last
    of those on as RGBA. ``drop``: (archive number, member index) of listed images left out of every
    archive; ``corrupt``: (archive number, member index) of images stored as truncated PNGs.
    """
    root.mkdir(parents=True, exist_ok=True)
    archives: dict[str, list[str]] = {}
    big: list[str] = []
    rgba: list[str] = []
    for a in range(1, NIH_N_ARCHIVES + 1):
        name = archive_name(a)
        out = []
        for i, (img, data) in enumerate(nih.iter_archive(generated / name)):
            if (a, i) in drop:
                continue
            to_big, to_rgba = a == 1 and i < n_big, a == 1 and n_big - 1 <= i < n_big - 1 + n_rgba
            if to_big or to_rgba:
                data = _png(images.decode_grey(data, name=img), size=BIG if to_big else None, rgba=to_rgba)
                (big if to_big else []).append(img)
                (rgba if to_rgba else []).append(img)
            if (a, i) in corrupt:
                data = data[: len(data) // 2]
            out.append((img, data))
        write_archive(root / name, out)
        archives[name] = [img for img, _ in out]
    for table in NIH_TABLES:
        shutil.copyfile(generated / table, root / table)
    # the release's boxes are in pixels of its 1,024 px images: the phantoms' regions scaled up
    boxes = nih.read_box_list(generated / nih.BOX_LIST_NAME, frame=SIDE)
    scale = nih.PNG_SIDE / SIDE
    nih.write_box_list(root / nih.BOX_LIST_NAME, [(r.image, r.label, r.x * scale, r.y * scale, r.w * scale, r.h * scale)
                                                  for r in boxes.itertuples(index=False)])
    files = {name: {"sha256": _sha256(root / name), "size": (root / name).stat().st_size}
             for name in [*archives, *NIH_TABLES, nih.BOX_LIST_NAME]}
    labels = nih.read_labels(root / NIH_TABLES[0])
    content = {"n_images": len(labels), "n_patients": int(labels["patient"].nunique()),
               "n_train_val": len(nih.read_split_list(root / NIH_TABLES[1])),
               "n_test": len(nih.read_split_list(root / NIH_TABLES[2]))}
    return Mirror(root=root, archives=archives, n_images=len(labels), big=tuple(big), rgba=tuple(rgba),
                  registry={"nih": {"files": files, "content": content}})
