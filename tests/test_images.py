"""chexflow.data.images: decoding any image file to uint8 grey, centre-square resizing."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from chexflow.data import images


def _png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    (Image.fromarray(arr, mode) if mode else Image.fromarray(arr)).save(buf, format="PNG")
    return buf.getvalue()

def test_decode_grey_modes():
    grey = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert np.array_equal(images.decode_grey(_png(grey), name="g.png"), grey)

    rgb = np.stack([grey, grey, grey], axis=-1)
    out = images.decode_grey(_png(rgb), name="rgb.png")
    assert out.shape == (16, 16) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - grey).max() <= 1

    rgba = np.concatenate([rgb, np.full((16, 16, 1), 255, np.uint8)], axis=-1)
    assert np.abs(images.decode_grey(_png(rgba), name="rgba.png").astype(int) - grey).max() <= 1
    half_alpha = rgba.copy()
    half_alpha[..., 3] = 10   # alpha is dropped, not composited
    assert np.abs(images.decode_grey(_png(half_alpha), name="a.png").astype(int) - grey).max() <= 1

    la = np.stack([grey, np.full_like(grey, 255)], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(la, "LA").save(buf, format="PNG")
    assert np.array_equal(images.decode_grey(buf.getvalue(), name="la.png"), grey)


def test_decode_grey_16bit_minmax():
    arr = np.linspace(1000, 5095, 64 * 64).reshape(64, 64).astype(np.uint16)   # 12-bit range, offset
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    with Image.open(io.BytesIO(buf.getvalue())) as im:
        assert im.mode.startswith("I")
    out = images.decode_grey(buf.getvalue(), name="deep.png")
    assert out.dtype == np.uint8 and out.min() == 0 and out.max() == 255
    expected = np.rint((arr.astype(float) - 1000) * 255 / 4095)
    assert np.abs(out - expected).max() <= 1
    flat = io.BytesIO()
    Image.fromarray(np.full((8, 8), 300, np.uint16)).save(flat, format="PNG")
    assert (images.decode_grey(flat.getvalue(), name="flat.png") == 0).all()


def test_decode_grey_corrupt():
    good = _png(np.zeros((32, 32), np.uint8))
    with pytest.raises(images.DecodeError, match="broken.png") as exc:
        images.decode_grey(b"\x89PNG\r\n\x1a\n garbage", name="broken.png")
    assert exc.value.name == "broken.png" and exc.value.reason
    with pytest.raises(images.DecodeError, match="cut.png"):
        images.decode_grey(good[: len(good) // 2], name="cut.png")
    with pytest.raises(images.DecodeError, match="empty.png"):
        images.decode_grey(b"", name="empty.png")


def test_resize_square():
    img = np.tile(np.arange(200, dtype=np.uint8), (100, 1))            # 100 x 200, not square
    out = images.resize_square(img, 50)
    assert out.shape == (50, 50) and out.dtype == np.uint8
    # centre crop keeps columns 50..149: the left edge of the output is ~50, the right ~149
    assert abs(int(out[0, 0]) - 51) <= 2 and abs(int(out[0, -1]) - 148) <= 2
    sq = np.random.default_rng(0).integers(0, 255, (64, 64), dtype=np.uint8)
    assert np.array_equal(images.resize_square(sq, 64), sq)
    small = images.resize_square(sq, 16)
    assert small.shape == (16, 16)
    assert abs(float(small.mean()) - float(sq.mean())) < 3   # antialiased: the mean is preserved


@pytest.mark.parametrize("mode", ["L", "RGBA", "RGB", "I;16", "LA", "P"])
@pytest.mark.parametrize("shape", [(40, 40), (50, 36), (36, 50), (24, 24)])
def test_decode_grey_with_size_is_decode_then_resize_square(mode, shape):
    """The fused decode+resize of the shard stage gives the pixels of the two-step path."""
    from PIL import Image
    rng = np.random.default_rng(3)
    grey = rng.integers(0, 256, shape, dtype=np.uint8)
    if mode == "I;16":
        img = Image.fromarray(grey.astype(np.uint16) * 200 + 7)
    elif mode in ("RGB", "RGBA"):
        img = Image.fromarray(np.stack([grey, np.roll(grey, 3), grey // 2] + ([grey] if mode == "RGBA" else []), -1),
                              mode=mode)
    else:
        img = Image.fromarray(grey, mode="L").convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    data = buf.getvalue()
    for size in (24, 17):
        fused = images.decode_grey(data, name="x.png", size=size)
        assert fused.shape == (size, size) and fused.dtype == np.uint8
        np.testing.assert_array_equal(fused, images.resize_square(images.decode_grey(data, name="x.png"), size))
    with pytest.raises(ValueError, match="size must be positive"):
        images.decode_grey(data, name="x.png", size=0)
