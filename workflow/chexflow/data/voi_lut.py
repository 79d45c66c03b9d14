"""A DICOM VOI LUT (PS3.3 C.11.2.1.1), read from the file and applied exactly, or refused.

pydicom 3.0.2's ``apply_voi`` indexes the table with an array of the entries' type, so the inputs
of an 8-bit LUT with more than 256 entries (legal: the entry count follows the input range, the
entry size the output) wrap at 256 and the image comes out silently wrong. Here the table is read
into integers and indexed with 64-bit integers; the standard's rules:

- LUT Descriptor (0028,3002): the number of entries (0 means 65536), the first input value
  mapped, the bits per entry (8 to 16). Inputs below the first value mapped take the first entry,
  inputs at or above ``first + entries - 1`` the last one. The first value mapped is signed (SS)
  when the LUT's input may be negative: a file that writes the descriptor as US then is read as
  the signed value it must hold.
- LUT Data (0028,3006): US values, or OW words in the file's byte order. 8-bit entries are packed
  two per 16-bit word, the first in the low byte; the older one-entry-per-word layout is told
  apart by the data's length (as the standard's note says).

Anything else (a length that fits neither layout, entries outside their bits, a missing element,
8-bit entries packed in a big-endian file) is :class:`UnsupportedVOILUT`: the file gets that
reason as its error, never a guessed image.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class UnsupportedVOILUT(ValueError):
    """A VOI LUT whose table cannot be read unambiguously from the file (the message says why)."""


@dataclass(frozen=True)
class VOILUT:
    first: int              # the first input value mapped
    table: np.ndarray       # int64 entries, the first one for ``first``

    def apply(self, values: np.ndarray) -> np.ndarray:
        """The LUT's output for each input (integers; non-integer inputs are rounded to the nearest)."""
        lo, hi = self.first, self.first + len(self.table) - 1
        if values.dtype.kind != "f":
            return self.table[np.clip(values.astype(np.int64), lo, hi) - lo]
        if not np.isfinite(values).all():
            raise UnsupportedVOILUT("the VOI LUT's input (the rescaled pixels) holds values that are not finite")
        return self.table[np.rint(np.clip(values, lo, hi)).astype(np.int64) - lo]   # clipped before the cast


def read_voi_lut(ds, index: int = 0) -> VOILUT:
    """VOI LUT ``index`` of the VOI LUT Sequence of ``ds`` (the first: the default view)."""
    item = ds.VOILUTSequence[index]
    if "LUTDescriptor" not in item or "LUTData" not in item:
        raise UnsupportedVOILUT("VOI LUT Sequence item without LUT Descriptor (0028,3002) or LUT Data (0028,3006)")
    elem = item["LUTDescriptor"]
    desc = list(elem.value) if elem.VM > 1 else [elem.value]
    if len(desc) != 3 or not all(isinstance(v, int) for v in desc):
        raise UnsupportedVOILUT(f"LUT Descriptor (0028,3002) is {desc!r}, expected 3 integers")
    entries = (desc[0] % 65536) or 65536
    first, bits = desc[1], desc[2]
    if elem.VR == "US" and first >= 32768 and _input_may_be_signed(ds):
        first -= 65536           # the standard's SS value, written as US
    if not 8 <= bits <= 16:
        raise UnsupportedVOILUT(f"LUT Descriptor (0028,3002) gives {bits} bits per entry; the standard allows 8 to 16")
    return VOILUT(first, _entries(item["LUTData"], entries, bits, _little_endian(ds)))


def _entries(elem, entries: int, bits: int, little: bool | None) -> np.ndarray:
    said = f"its descriptor says {entries} entries of {bits} bits"
    value = elem.value
    if isinstance(value, (bytes, bytearray)):
        words = _from_bytes(bytes(value), entries, bits, little, said)
    else:
        words = np.asarray([value] if isinstance(value, int) else list(value or []), dtype=np.int64)
        if bits == 8 and entries > 1 and len(words) == -(-entries // 2):     # two 8-bit entries per US value
            words = np.stack([words & 0xFF, words >> 8], axis=1).reshape(-1)[:entries]
        elif len(words) != entries:
            raise UnsupportedVOILUT(f"LUT Data (0028,3006) holds {len(words)} values; {said}")
    if words.size and (words.min() < 0 or words.max() >= 2 ** bits):
        bad = int(words.min()) if words.min() < 0 else int(words.max())
        raise UnsupportedVOILUT(f"LUT Data (0028,3006) holds the value {bad}, outside the {bits} bits per entry "
                                "of its descriptor")
    return words


def _from_bytes(data: bytes, entries: int, bits: int, little: bool | None, said: str) -> np.ndarray:
    if bits == 8 and len(data) in (entries, entries + 1) and len(data) != 2 * entries:
        if little is False:
            raise UnsupportedVOILUT("8-bit LUT entries packed two per word in a big-endian file")
        return np.frombuffer(data, np.uint8, count=entries).astype(np.int64)
    if len(data) != 2 * entries:
        raise UnsupportedVOILUT(f"LUT Data (0028,3006) holds {len(data)} bytes; {said}")
    if little is None:
        raise UnsupportedVOILUT("LUT Data (0028,3006) as OW in a file of unknown byte order")
    return np.frombuffer(data, "<u2" if little else ">u2").astype(np.int64)


def _little_endian(ds) -> bool | None:
    syntax = getattr(ds, "file_meta", {}).get("TransferSyntaxUID")
    if syntax is not None and syntax.is_transfer_syntax:
        return bool(syntax.is_little_endian)
    return ds.original_encoding[1]


def _input_may_be_signed(ds) -> bool:
    """Whether the VOI LUT's input (the Modality LUT's output) may be negative, as PS3.3 C.11.2.1.1
    decides the type of the first value mapped: the Pixel Representation without a rescale; the
    rescaled range of the stored values with one; never after a Modality LUT (its entries are unsigned)."""
    if ds.get("ModalityLUTSequence"):
        return False
    bits, signed = int(ds.get("BitsStored", 16)), int(ds.get("PixelRepresentation", 0)) == 1
    if "RescaleSlope" not in ds and "RescaleIntercept" not in ds:
        return signed
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    slope, intercept = float(ds.get("RescaleSlope", 1) or 1), float(ds.get("RescaleIntercept", 0) or 0)
    return min(lo * slope + intercept, hi * slope + intercept) < 0
