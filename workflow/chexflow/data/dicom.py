"""Decoding a DICOM radiograph to uint8 grey, as ``images.decode_grey`` does for PNG and JPEG.

Through pydicom: the stored pixels (any transfer syntax an installed pixel-data handler decodes;
pydicom alone: uncompressed, deflated and RLE; with Pillow: JPEG baseline and JPEG 2000; JPEG
lossless and JPEG-LS need gdcm or pylibjpeg, and without them the file gets an error naming its
transfer syntax), then the Modality LUT (rescale slope/intercept or a LUT), then the VOI LUT
(``chexflow.data.voi_lut``: any length, 8- to 16-bit entries; one it cannot apply is refused) or
window, all at full bit depth, and only then one scaling to 0..255:

- with a VOI transform, the darkest and brightest values it can output become 0 and 255 (what a
  viewer shows is what the network sees);
- without one, an 8-bit image keeps its values (as an 8-bit PNG does) and a deeper one is min-max
  scaled by its actual range (as ``decode_grey`` scales a 16-bit PNG);
- MONOCHROME1 (0 = white) is inverted last.

Files that are DICOM but not a single grey radiograph (no pixel data, colour, multi-frame, a
modality that is not a projection radiograph) are refused with the reason: :class:`NotARadiograph`.
"""
from __future__ import annotations

import io
import warnings

import numpy as np

from chexflow.data.images import DecodeError, _minmax_to_uint8
from chexflow.data.voi_lut import read_voi_lut

RADIOGRAPH_MODALITIES = ("CR", "DX", "DR")


class NotARadiograph(DecodeError):
    """A readable DICOM file that is not a single grey projection radiograph."""

    def __str__(self) -> str:
        return f"refused {self.name!r}: {self.reason}"


def is_dicom(head: bytes) -> bool:
    """A DICOM Part 10 file: 128 bytes of preamble, then ``DICM``."""
    return head[128:132] == b"DICM"


def decode_dicom(data: bytes, *, name: str, modalities=RADIOGRAPH_MODALITIES,
                 max_pixels: int | None = None) -> np.ndarray:
    """uint8 HxW grey pixels of a DICOM radiograph (full resolution; see the module docstring).

    ``modalities``: the (0008,0060) Modality values accepted. ``max_pixels``: larger images are
    refused before their pixel data is decoded (default: the size at which Pillow refuses a PNG or
    JPEG as a decompression bomb, twice ``Image.MAX_IMAGE_PIXELS``; none when that is None). Raises :class:`NotARadiograph` for a file that is not a grey
    single-frame radiograph, ``DecodeError`` for one that cannot be read.
    """
    import pydicom
    from PIL import Image

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = pydicom.dcmread(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - any parser failure on an untrusted file is that file's error
        raise DecodeError(name, f"not a readable DICOM file ({_one_line(exc)})") from exc
    # pydicom reads a file cut inside encapsulated (compressed) pixel data as a dataset without
    # them, and only warns
    cut = [str(w.message) for w in caught if "End of file reached" in str(w.message)]
    if cut:
        raise DecodeError(name, f"truncated DICOM file ({' '.join(cut[0].split())})")
    step = "its header"
    try:
        bomb = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
        _check_radiograph(ds, name, modalities, max_pixels or bomb)
        step = "its pixel data"
        arr = ds.pixel_array
        if arr.ndim != 2 or arr.size == 0:
            raise NotARadiograph(name, f"pixel data of shape {arr.shape}, expected one grey frame")
        step = "its LUT or window"
        out = _to_uint8(arr, ds)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed tag, a missing pixel handler, corrupt pixel data
        raise DecodeError(name, f"cannot read {step}{_syntax(ds, step)}: {_one_line(exc)}") from exc
    return 255 - out if ds.PhotometricInterpretation == "MONOCHROME1" else out


def _one_line(exc: Exception) -> str:
    """``Type: message`` on one line (pydicom lists missing plugins on several; a CSV cell wants one)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _syntax(ds, step: str) -> str:
    """`` in transfer syntax <name> (<uid>)`` for errors of the pixel data (a compressed syntax
    without an installed handler is the usual one)."""
    ts = ds.file_meta.get("TransferSyntaxUID") if step == "its pixel data" else None
    return f" in transfer syntax {ts.name} ({ts})" if ts else ""


def _check_radiograph(ds, name: str, modalities, max_pixels: int | None) -> None:
    if "PixelData" not in ds:
        floats = "float pixel data" if "FloatPixelData" in ds or "DoubleFloatPixelData" in ds else "no pixel data"
        raise NotARadiograph(name, f"{floats} (SOP class {ds.get('SOPClassUID', 'unknown')})")
    modality = str(ds.get("Modality", "") or "")
    if modality not in modalities:
        raise NotARadiograph(name, f"modality {modality or 'missing'}, not a radiograph "
                                   f"(accepted: {', '.join(modalities)}; predict.modalities)")
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    if frames != 1:
        raise NotARadiograph(name, f"multi-frame ({frames} frames)")
    samples, photometric = int(ds.get("SamplesPerPixel", 1)), str(ds.get("PhotometricInterpretation", ""))
    if samples != 1 or photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise NotARadiograph(name, f"colour or not grey ({photometric or 'no PhotometricInterpretation'}, "
                                   f"{samples} samples per pixel)")
    rows, cols = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
    if rows * cols == 0 or (max_pixels is not None and rows * cols > max_pixels):
        raise NotARadiograph(name, f"{rows} x {cols} pixels (limit {max_pixels})")


def _to_uint8(arr: np.ndarray, ds) -> np.ndarray:
    from pydicom.pixels import apply_modality_lut

    values = apply_modality_lut(arr, ds)
    voi = _apply_voi(values, ds)
    if voi is not None:
        out, black, white = voi
        if white == black:
            return np.zeros(arr.shape, np.uint8)
        return np.rint(np.clip((out - black) / (white - black), 0.0, 1.0) * 255.0).astype(np.uint8)
    if int(ds.get("BitsStored", 16)) <= 8 and int(ds.get("PixelRepresentation", 0)) == 0 \
            and np.array_equal(values, arr):
        return arr.astype(np.uint8)
    return _minmax_to_uint8(values)


def _apply_voi(values: np.ndarray, ds) -> tuple[np.ndarray, float, float] | None:
    """(VOI output, the output that is black, the one that is white), or None when the file has
    no VOI transform. A VOI LUT comes first (as pydicom's ``apply_voi_lut``), else the window;
    the first of several alternative views is the default view."""
    from pydicom.pixels import apply_windowing

    if ds.get("VOILUTSequence"):
        lut = read_voi_lut(ds)          # not pydicom's apply_voi: see chexflow.data.voi_lut
        return lut.apply(values).astype(np.float64), float(lut.table.min()), float(lut.table.max())
    if "WindowCenter" in ds and "WindowWidth" in ds:
        black, white = apply_windowing(np.array([-np.inf, np.inf]), ds)           # the window's output range
        return apply_windowing(values, ds), float(black), float(white)
    return None
