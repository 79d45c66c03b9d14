"""chexflow.data.images: decoding any image file to uint8 grey, centre-square resizing."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import hostile
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


# --------------------------------------------------------------------------- untrusted files (issue 17)
# Hostile files (tests/hostile.py) made from valid ones: a PNG whose header declares more rows than
# its zlib stream holds (Pillow decodes it without an error or a warning, the missing rows black),
# JPEGs cut short or declaring more rows than their scan holds (libjpeg fills grey and only warns).

def _png_modes() -> dict[str, bytes]:
    rng = np.random.default_rng(5)
    grey = rng.integers(0, 256, (40, 30), dtype=np.uint8)
    out = {"L": _png(grey)}
    for mode in ("RGB", "RGBA", "LA", "P", "1"):
        buf = io.BytesIO()
        Image.fromarray(grey).convert(mode).save(buf, format="PNG")
        out[mode] = buf.getvalue()
    out["I;16"] = _png(grey.astype(np.uint16) * 257 + 3)
    # rows of exactly the memory's fill values: a complete image, whatever its last row holds
    out["flat 0x5A"] = _png(np.full((8, 8), 0x5A, np.uint8))
    out["flat 0xA5"] = _png(np.full((8, 8), 0xA5, np.uint8))
    out["flat 16-bit"] = _png(np.full((8, 8), 0x5A5A, np.uint16))
    return out


@pytest.mark.parametrize("mode", list(_png_modes()))
def test_png_declaring_more_rows_than_its_data_is_rejected(mode):
    png = _png_modes()[mode]
    with Image.open(io.BytesIO(png)) as im:
        w, h = im.size
    assert images.decode_grey(png, name="ok.png").shape == (h, w)
    for extra in (1, 3 * h):
        taller = hostile.png_declaring_height(png, h + extra)
        with Image.open(io.BytesIO(taller)) as im:     # what Pillow alone does with it: no error, black rows
            im.load()
            assert im.size == (w, h + extra)
        with pytest.raises(images.DecodeError, match=rf"incomplete PNG: .* {w} x {h + extra} px its header declares"):
            images.decode_grey(taller, name="taller.png")
        with pytest.raises(images.DecodeError, match="taller.png"):
            images.decode_grey(taller, name="taller.png", size=16)


@pytest.mark.parametrize("shape", [(16, 16), (17, 13), (2, 9), (1, 7), (1, 1)])
def test_interlaced_png_complete_or_rejected(shape):
    grey = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    png = hostile.interlaced_png(grey)
    with Image.open(io.BytesIO(png)) as im:
        assert im.info.get("interlace") and np.array_equal(np.asarray(im), grey)   # the encoder is right
    assert np.array_equal(images.decode_grey(png, name="adam7.png"), grey)
    ihdr, idat, iend = hostile.png_chunks(png)
    raw = zlib.decompress(idat[1])
    for cut in sorted({len(raw) - 1, len(raw) // 2, 1}):    # the zlib stream ends early, but ends properly
        short = hostile.build_png([ihdr, (b"IDAT", zlib.compress(raw[:cut])), iend])
        with pytest.raises(images.DecodeError, match="adam7.png"):
            images.decode_grey(short, name="adam7.png")


def test_jpeg_incomplete_or_cut_is_rejected():
    grey = (np.add.outer(np.arange(96), np.arange(128)) % 256).astype(np.uint8)
    for kw in ({}, {"progressive": True}):
        jpg = hostile.jpeg(grey, **kw)
        bad = {"declares more rows": hostile.jpeg_declaring_height(jpg, 400),
               "scan cut, end marker kept": jpg[:len(jpg) // 2] + b"\xff\xd9",
               "cut": jpg[:len(jpg) // 2]}
        for what, data in bad.items():
            with Image.open(io.BytesIO(data)) as im:
                if what != "cut":
                    im.load()                           # Pillow alone: decoded, the rest grey
            with pytest.raises(images.DecodeError, match=r"'x.jpg': incomplete or corrupt JPEG"):
                images.decode_grey(data, name="x.jpg", draft=32)
            with pytest.raises(images.DecodeError, match="x.jpg"):
                images.decode_grey(data, name="x.jpg", size=32)


@pytest.mark.parametrize("size, shape", [(32, (300, 400)), (64, (300, 400)), (100, (375, 500)), (8, (96, 128))])
def test_jpeg_draft_decodes_the_pixels_pillow_draft_does(size, shape):
    rng = np.random.default_rng(2)
    rgb = np.asarray(Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(shape[::-1]))
    for arr in (rgb, rgb[..., 0]):
        jpg = hostile.jpeg(arr)
        with Image.open(io.BytesIO(jpg)) as im:
            im.draft("L", (size, size))
            expected = np.asarray(im.convert("L"))
        np.testing.assert_array_equal(images.decode_grey(jpg, name="x.jpg", draft=size), expected)


def test_declared_pixels_are_capped_before_decoding():
    # header and an IDAT of garbage: refused for its declared size, never decoded
    ihdr = struct.pack(">IIBBBBB", 5000, 4000, 8, 0, 0, 0, 0)
    bomb = hostile.build_png([(b"IHDR", ihdr), (b"IDAT", b"not zlib data"), (b"IEND", b"")])
    with pytest.raises(images.DecodeError, match=r"'bomb.png': header declares 5000 x 4000 = 20.0 MP, more than the "
                                                 r"16 MP allowed \(max_image_megapixels\); not decoded"):
        images.decode_grey(bomb, name="bomb.png", max_pixels=16_000_000)
    with pytest.raises(images.DecodeError, match="'bomb.png': OSError: broken data stream"):
        images.decode_grey(bomb, name="bomb.png", max_pixels=20_000_000)    # allowed: then it fails to decode
    jpg = hostile.jpeg_declaring_height(hostile.jpeg(np.zeros((16, 16), np.uint8)), 4001)   # 16 x 4001
    with pytest.raises(images.DecodeError, match=r"16 x 4001 = 0.1 MP, more than the 0.05 MP allowed"):
        images.decode_grey(jpg, name="tall.jpg", max_pixels=50_000)
    ok = _png(np.zeros((100, 100), np.uint8))
    assert images.decode_grey(ok, name="ok.png", max_pixels=10_000).shape == (100, 100)
    with pytest.raises(images.DecodeError, match="100 x 100"):
        images.decode_grey(ok, name="ok.png", max_pixels=9_999)


def test_only_png_and_jpeg_are_read():
    grey = np.zeros((8, 8), np.uint8)
    for fmt in ("GIF", "BMP", "TIFF", "WEBP"):
        buf = io.BytesIO()
        Image.fromarray(grey).save(buf, format=fmt)
        with pytest.raises(images.DecodeError, match="'x.png': not a PNG or JPEG file"):
            images.decode_grey(buf.getvalue(), name="x.png")
    jpg_named_png = hostile.jpeg(grey)
    assert images.decode_grey(jpg_named_png, name="x.png").shape == (8, 8)   # by content, not name
