"""Decoding and resizing of image files, for every dataset's shard stage.

Whatever the source format (PNG, JPEG, 16-bit, palette, RGBA...), images become uint8 HxW grey,
cut to the central square and resized to the stored side.

Every image file is untrusted, so before a sample counts:

* it is a PNG or a JPEG by its signature (whatever its name says); other formats are refused;
* the width x height its header declares is within ``max_pixels``, checked before any pixel is
  decoded (not only Pillow's global decompression-bomb limit);
* it decodes completely: a truncated file, a corrupt stream, or a header declaring more rows than
  the data holds is a ``DecodeError``. Pillow accepts a PNG whose zlib stream ends early: the rows
  it never reached keep the image memory's initial value (black), without an error or a warning,
  so the memory is first filled with a sentinel and the row decoded last must no longer hold it.
  libjpeg fills missing JPEG data with grey and only warns, which Pillow drops: JPEGs are decoded
  by libjpeg-turbo through ``simplejpeg`` with ``strict=True``, which makes every libjpeg warning
  (premature end of data, corrupt data) an error.
"""
from __future__ import annotations

import io

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def million(x: float) -> int:
    """A setting in millions (``max_member_mb``, ``max_image_megapixels``) as a count of bytes or pixels."""
    return int(x * 1_000_000)

JPEG_SIGNATURE = b"\xff\xd8\xff"
# two fill values of the image memory before a PNG is decoded: a row decoded last that still holds
# the first one in every byte is decoded again over the second (a real row cannot hold both)
_SENTINELS = (0x5A, 0xA5)


class DecodeError(ValueError):
    """An image could not be decoded."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, reason)
        self.name = name
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot decode image {self.name!r}: {self.reason}"


def decode_grey(data: bytes, *, name: str, draft: int | None = None, size: int | None = None,
                max_pixels: int | None = None) -> np.ndarray:
    """Decode a PNG or JPEG file to uint8 HxW greyscale (``size``: then ``resize_square`` to ``size`` px).

    With ``size`` the centre crop and the resize of a PNG run on the decoded PIL image, without a
    numpy copy of the full-resolution image in between (same pixels as ``resize_square(decode_grey(...))``).

    ``draft``: for JPEGs, let libjpeg decode only the luma channel at the smallest DCT scale
    (1/2, 1/4, 1/8) that keeps both sides >= ``draft`` px (the scale ``PIL.Image.draft`` picks):
    much faster for large photos that are resized to ``draft`` px afterwards anyway. Ignored for PNGs.

    ``max_pixels``: the most pixels (width x height, as the header declares them) an image may
    have; a larger one is refused before it is decoded.

    - 8-bit L: as is; P/1/…: converted by PIL to L. JPEG: the luma channel libjpeg decodes.
    - RGB/RGBA/LA/PA: alpha is dropped (not composited), colour converted to L (ITU-R 601 luma).
      Some NIH PNGs are RGBA with an opaque alpha channel.
    - 16-bit / 32-bit integer or float ('I;16*', 'I', 'F'): min-max scaled by the image's actual
      range to 0..255 (a constant image becomes 0). Chosen over ``>> 8`` because 12-bit data
      stored in 16-bit would otherwise use only 16 grey levels.

    Raises ``DecodeError(name, reason)`` on another format, too many pixels, or unreadable,
    truncated or incomplete data (see the module docstring).
    """
    if size is not None and size < 1:
        raise ValueError(f"size must be positive, got {size}")
    head = bytes(data[:8])
    if head.startswith(JPEG_SIGNATURE):
        arr = _decode_jpeg(data, name, draft, max_pixels)
        return resize_square(arr, size) if size is not None else arr
    if head != PNG_SIGNATURE:
        raise DecodeError(name, "not a PNG or JPEG file (its first bytes are neither signature)")
    return _decode_png(data, name, size, max_pixels)


def _check_pixels(name: str, width: int, height: int, max_pixels: int | None) -> None:
    if width < 1 or height < 1:
        raise DecodeError(name, f"header declares an empty image ({width} x {height} px)")
    if max_pixels is not None and width * height > max_pixels:
        raise DecodeError(name, f"header declares {width} x {height} = {width * height / 1e6:.1f} MP, more than "
                                f"the {max_pixels / 1e6:g} MP allowed (max_image_megapixels); not decoded")


def _decode_jpeg(data: bytes, name: str, draft: int | None, max_pixels: int | None) -> np.ndarray:
    import simplejpeg

    try:
        height, width, _colorspace, _subsampling = simplejpeg.decode_jpeg_header(data)
    except ValueError as exc:
        raise DecodeError(name, f"JPEG header: {exc}") from exc
    _check_pixels(name, width, height, max_pixels)
    scale = _draft_scale(width, height, draft)
    try:
        # strict: a libjpeg warning (data ending early, a corrupt segment) is an error, not a grey fill
        arr = simplejpeg.decode_jpeg(data, colorspace="GRAY", min_height=-(-height // scale),
                                     min_width=-(-width // scale), strict=True)
    except ValueError as exc:
        raise DecodeError(name, f"incomplete or corrupt JPEG: {exc}") from exc
    return np.ascontiguousarray(arr[..., 0])


def _draft_scale(width: int, height: int, draft: int | None) -> int:
    """The DCT scale denominator ``PIL.Image.draft((draft, draft))`` picks: the largest of 8, 4, 2, 1
    that keeps both sides >= ``draft``."""
    if draft is None:
        return 1
    fit = min(width // draft, height // draft)
    return next(s for s in (8, 4, 2, 1) if fit >= s or s == 1)


def _decode_png(data: bytes, name: str, size: int | None, max_pixels: int | None) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        img = _load_complete_png(data, name, max_pixels)
        with img:
            mode = img.mode
            if mode.startswith("I") or mode.startswith("F"):
                arr = _minmax_to_uint8(np.asarray(img))
                if size is not None and arr.ndim == 2 and arr.size:
                    arr = resize_square(arr, size)
            else:
                grey = img
                if mode in ("LA", "La"):
                    grey = img.getchannel("L")
                elif mode != "L":
                    if mode in ("RGBA", "RGBa", "RGBX", "PA") or "A" in img.getbands():
                        grey = img.convert("RGB")
                    grey = grey.convert("L")
                if size is not None and grey.width and grey.height:
                    grey = _square_pil(grey, size)
                arr = np.asarray(grey, dtype=np.uint8)
    except DecodeError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError,
            Image.DecompressionBombError) as exc:
        raise DecodeError(name, f"{type(exc).__name__}: {exc}") from exc
    if arr.ndim != 2 or arr.size == 0:
        raise DecodeError(name, f"unexpected decoded shape {arr.shape} (mode {mode})")
    return np.ascontiguousarray(arr)


def _load_complete_png(data: bytes, name: str, max_pixels: int | None):
    """The PNG opened and loaded by Pillow, every row its header declares decoded (else ``DecodeError``).

    The image memory is filled with a sentinel before decoding; if the pixels decoded last
    (``_decoded_last``) still hold it in every byte, the file is decoded again over the other
    sentinel: still holding that one, they were never written (the data ends early)."""
    from PIL import Image

    for sentinel in range(len(_SENTINELS)):
        img = Image.open(io.BytesIO(data), formats=["PNG"])
        try:
            _check_pixels(name, *img.size, max_pixels)
            fill = _fill_value(img.mode, sentinel)
            img.im = Image.new(img.mode, img.size, fill).im     # Pillow decodes into this memory
            img.load()
            box = _decoded_last(img)
            if img.crop(box).tobytes() != Image.new(img.mode, (box[2] - box[0], box[3] - box[1]), fill).tobytes():
                return img
        except BaseException:
            img.close()
            raise
        img.close()
    raise DecodeError(name, f"incomplete PNG: its image data ends before the {img.width} x {img.height} px "
                            "its header declares")


def _fill_value(mode: str, sentinel: int) -> int | tuple[int, ...]:
    from PIL import Image

    if mode == "1":
        return sentinel
    value = _SENTINELS[sentinel] * (0x101 if mode.startswith("I") else 1)
    bands = Image.getmodebands(mode)
    return value if bands == 1 else (value,) * bands


def _decoded_last(img) -> tuple[int, int, int, int]:
    """The box of the pixels Pillow's PNG decoder writes last: the bottom row, or for an interlaced
    (Adam7) image the last row of pass 7 (the odd rows, written whole), or with a single row the
    last pixel of pass 6 (odd columns) or pass 1."""
    w, h = img.size
    if not img.info.get("interlace"):
        return 0, h - 1, w, h
    if h >= 2:
        y = h - 1 if (h - 1) % 2 else h - 2
        return 0, y, w, y + 1
    x = 0 if w == 1 else (w - 1 if (w - 1) % 2 else w - 2)
    return x, 0, x + 1, 1


def _minmax_to_uint8(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    if a.ndim == 3:
        a = a[..., 0]
    finite = np.isfinite(a)
    if not finite.all():
        a = np.where(finite, a, np.nan)
    lo, hi = np.nanmin(a), np.nanmax(a)
    if not np.isfinite(lo) or hi <= lo:
        return np.zeros(a.shape, dtype=np.uint8)
    out = (np.nan_to_num(a, nan=lo) - lo) * (255.0 / (hi - lo))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def _square_pil(img, size: int):
    """A PIL 'L' image's central square resized to ``size x size`` (a PIL image). PIL bilinear
    resampling, which low-pass filters (antialiases) when shrinking, like torchvision's
    ``Resize(antialias=True)``."""
    from PIL import Image
    w, h = img.size
    if h != w:
        s = min(h, w)
        top, left = (h - s) // 2, (w - s) // 2
        img = img.crop((left, top, left + s, top + s))
    if img.size[0] == size:
        return img.copy()
    return img.resize((size, size), Image.Resampling.BILINEAR)


def resize_square(img: np.ndarray, size: int) -> np.ndarray:
    """Centre-crop a uint8 HxW image to a square, then resize to ``size x size`` (:func:`_square_pil`)."""
    from PIL import Image

    if img.ndim != 2:
        raise ValueError(f"resize_square expects a 2-D greyscale image, got shape {img.shape}")
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    square = _square_pil(Image.fromarray(np.ascontiguousarray(img, dtype=np.uint8)), size)
    return np.array(square, dtype=np.uint8)
