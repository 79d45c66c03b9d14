"""Decoding and resizing of image files, for every dataset's shard stage.

Whatever the source format (PNG, JPEG, 16-bit, palette, RGBA...), images become uint8 HxW grey,
cut to the central square and resized to the stored side.
"""
from __future__ import annotations

import io

import numpy as np


class DecodeError(ValueError):
    """An image could not be decoded."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, reason)
        self.name = name
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot decode image {self.name!r}: {self.reason}"


def decode_grey(data: bytes, *, name: str, draft: int | None = None, size: int | None = None) -> np.ndarray:
    """Decode an image file to uint8 HxW greyscale (``size``: then ``resize_square`` to ``size`` px).

    With ``size`` the centre crop and the resize run on the decoded PIL image, without a numpy copy
    of the full-resolution image in between (same pixels as ``resize_square(decode_grey(...))``).

    ``draft``: for JPEGs, let libjpeg decode only the luma channel at the smallest DCT scale
    (1/2, 1/4, 1/8) that keeps both sides >= ``draft`` px (``PIL.Image.draft``): much faster for
    large photos that are resized to ``draft`` px afterwards anyway. Ignored for other formats.

    - 8-bit L: as is; P/1/CMYK/…: converted by PIL to L.
    - RGB/RGBA/LA/PA: alpha is dropped (not composited), colour converted to L (ITU-R 601 luma).
      Some NIH PNGs are RGBA with an opaque alpha channel.
    - 16-bit / 32-bit integer or float ('I;16*', 'I', 'F'): min-max scaled by the image's actual
      range to 0..255 (a constant image becomes 0). Chosen over ``>> 8`` because 12-bit data
      stored in 16-bit would otherwise use only 16 grey levels.

    Raises ``DecodeError(name, reason)`` on unreadable or truncated data.
    """
    from PIL import Image, UnidentifiedImageError

    if size is not None and size < 1:
        raise ValueError(f"size must be positive, got {size}")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if draft is not None and img.format == "JPEG":
                img.draft("L", (draft, draft))
            img.load()
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
    """``resize_square`` on a PIL 'L' image (returns a PIL image)."""
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
    """Centre-crop a uint8 HxW image to a square, then resize to ``size x size``.

    PIL bilinear resampling, which low-pass filters (antialiases) when shrinking, like
    torchvision's ``Resize(antialias=True)``.
    """
    from PIL import Image

    if img.ndim != 2:
        raise ValueError(f"resize_square expects a 2-D greyscale image, got shape {img.shape}")
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    h, w = img.shape
    if h != w:
        s = min(h, w)
        top, left = (h - s) // 2, (w - s) // 2
        img = img[top:top + s, left:left + s]
    img = np.ascontiguousarray(img, dtype=np.uint8)
    if img.shape[0] == size:
        return img.copy()
    out = Image.fromarray(img).resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(out, dtype=np.uint8).copy()
