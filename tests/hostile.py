"""Hostile inputs the tests generate (issue 17: never shipped as files): PNGs and JPEGs whose headers
declare more than their data holds, and gzip tars of chosen members, huge ones included."""
from __future__ import annotations

import gzip
import io
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    (Image.fromarray(arr, mode) if mode else Image.fromarray(arr)).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, body) of every chunk of a PNG."""
    out, pos = [], len(PNG_SIGNATURE)
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        out.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]))
        pos += 12 + n
    return out


def build_png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    """A PNG of these chunks, each with a valid CRC."""
    return PNG_SIGNATURE + b"".join(struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
                                    for kind, body in chunks)


def png_declaring_height(data: bytes, height: int) -> bytes:
    """The same PNG, its IHDR declaring ``height`` rows (its image data unchanged: a complete zlib
    stream holding fewer rows). Pillow decodes it without an error or a warning, the rest black."""
    chunks = png_chunks(data)
    kind, ihdr = chunks[0]
    assert kind == b"IHDR"
    chunks[0] = (kind, ihdr[:4] + struct.pack(">I", height) + ihdr[8:])
    return build_png(chunks)


def interlaced_png(grey: np.ndarray) -> bytes:
    """An 8-bit grey Adam7-interlaced PNG (Pillow writes none): each pass's rows, filter type 0."""
    h, w = grey.shape
    passes = ((0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2), (0, 1, 2, 2), (1, 0, 2, 1))
    raw = b"".join(b"\x00" + grey[y, c0::dc].tobytes() for r0, c0, dr, dc in passes if c0 < w for y in range(r0, h, dr))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 1)
    return build_png([(b"IHDR", ihdr), (b"IDAT", zlib.compress(raw)), (b"IEND", b"")])


def jpeg_declaring_height(data: bytes, height: int) -> bytes:
    """The same JPEG, its start-of-frame declaring ``height`` rows: libjpeg fills the rest grey and warns."""
    pos = 2
    while data[pos + 1] not in (0xC0, 0xC1, 0xC2):
        pos += 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
    return data[:pos + 5] + struct.pack(">H", height) + data[pos + 7:]


class Zeros(io.RawIOBase):
    """``n`` zero bytes as a file (a huge member that compresses to almost nothing)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        k = min(len(buf), self.left)
        buf[:k] = bytes(k)
        self.left -= k
        return k


def tar_gz(path: Path, members: list[tuple[str, bytes | int]]) -> Path:
    """A gzip tar of ``(member name, bytes)``; an int instead of bytes is a member of that many zeros."""
    with gzip.open(path, "wb", compresslevel=1) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = data if isinstance(data, int) else len(data)
            tar.addfile(info, Zeros(data) if isinstance(data, int) else io.BytesIO(data))
    return path
