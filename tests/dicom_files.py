"""DICOM files made here from known pixels (pydicom writes them; none is downloaded), for the tests of
``chexflow.data.dicom`` and ``chexflow predict`` and for bench/predict.py.

Each writer takes the 8-bit grey image ``p`` that the PNG path would decode and stores it so that a
correct reader gets ``p`` back exactly: as is, or as 12/16-bit values behind a rescale and a window
(or a VOI LUT of 8- or 12-bit entries) that map them back, inverted for MONOCHROME1, compressed with
RLE or JPEG 2000 (JPEG baseline: lossy, the pixels Pillow decodes). ``with_voi_lut`` writes any VOI
LUT as given, for the tests that compute its output from the standard.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image
from pydicom import dcmwrite
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.sequence import Sequence
from pydicom.uid import (JPEG2000Lossless, JPEGBaseline8Bit, JPEGLosslessSV1, RLELossless,
                         DigitalXRayImageStorageForPresentation, ExplicitVRBigEndian, ExplicitVRLittleEndian,
                         generate_uid)


def dataset(pixels: np.ndarray, *, bits: int = 8, photometric: str = "MONOCHROME2", modality: str = "DX",
            frames: int = 1) -> Dataset:
    """A DX image of ``pixels`` (uint8 or uint16 HxW, or FxHxW with ``frames``), explicit VR little endian."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = DigitalXRayImageStorageForPresentation
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = modality
    ds.PatientID = "phantom"
    ds.set_pixel_data(pixels, photometric_interpretation=photometric, bits_stored=bits)
    if frames > 1:
        ds.NumberOfFrames = frames
    return ds


def write(ds: Dataset, path: Path) -> Path:
    dcmwrite(path, ds, enforce_file_format=True)
    return path


def plain(p: np.ndarray, path: Path, **kw) -> Path:
    """8-bit MONOCHROME2, uncompressed: the PNG's values as they are."""
    return write(dataset(p, **kw), path)


def deep_windowed(p: np.ndarray, path: Path, *, monochrome1: bool = True, a: float = 6.0, b: float = 300.0,
                  slope: float = 0.5, intercept: float = -40.0, function: str = "LINEAR") -> Path:
    """12 bits stored in 16, a rescale and a window that give back ``p``: the rescaled value is
    ``x = a * p + b`` (stored ``(x - intercept) / slope``; MONOCHROME1 stores the inverted image) and
    the window maps ``[b, b + 255 a]`` onto the full output range (LINEAR: centre ``b + 127.5 a + 0.5``,
    width ``255 a + 1``; LINEAR_EXACT: centre ``b + 127.5 a``, width ``255 a``)."""
    q = 255 - p.astype(np.float64) if monochrome1 else p.astype(np.float64)
    stored = np.rint((a * q + b - intercept) / slope).astype(np.uint16)
    assert stored.max() < 4096, "keep the stored values in 12 bits"
    ds = dataset(stored, bits=12, photometric="MONOCHROME1" if monochrome1 else "MONOCHROME2")
    ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = slope, intercept, "US"
    exact = function == "LINEAR_EXACT"
    ds.WindowCenter = b + 127.5 * a + (0 if exact else 0.5)
    ds.WindowWidth = 255 * a + (0 if exact else 1)
    ds.VOILUTFunction = function
    return write(ds, path)


def voi_lut(p: np.ndarray, path: Path, *, offset: int = 1000) -> Path:
    """16-bit stored values ``4 p + offset`` and a VOI LUT sequence (12-bit entries) that maps them to
    ``16 p``, plus a misleading window that a VOI LUT takes precedence over."""
    stored = (4 * p.astype(np.uint16) + offset).astype(np.uint16)
    ds = dataset(stored, bits=16)
    lut = Dataset()
    n = 4 * 255 + 1
    lut.add_new(0x00283002, "US", [n, offset, 12])                    # LUT Descriptor (US or SS)
    lut.add_new(0x00283006, "US", [16 * (i // 4) for i in range(n)])   # LUT Data (US or OW)
    lut.LUTExplanation = "test LUT"
    ds.VOILUTSequence = Sequence([lut])
    ds.WindowCenter, ds.WindowWidth = 5.0, 3.0
    return write(ds, path)


def voi_lut_8bit(p: np.ndarray, path: Path, *, offset: int = 1000) -> Path:
    """16-bit stored values ``4 p + offset`` behind an 8-bit VOI LUT of 1021 entries that maps them back
    to ``p`` (more than 256 entries: pydicom 3.0.2's ``apply_voi`` wraps their indices at 256)."""
    n = 4 * 255 + 1
    stored = (4 * p.astype(np.uint16) + offset).astype(np.uint16)
    return with_voi_lut(stored, path, descriptor=[n, offset, 8], data=[i // 4 for i in range(n)])


def with_voi_lut(stored: np.ndarray, path: Path, *, descriptor: list[int], data, data_vr: str = "US",
                 descriptor_vr: str | None = None, bits: int = 16, rescale: tuple[float, float] | None = None,
                 photometric: str = "MONOCHROME2", syntax: str = ExplicitVRLittleEndian) -> Path:
    """``stored`` (uint16 or int16: Pixel Representation 1) behind one VOI LUT exactly as given:
    LUT Descriptor ``descriptor`` (VR ``descriptor_vr``, default SS for signed pixels, else US) and
    LUT Data ``data`` (a list of values for US/SS, bytes for OW); ``rescale``: (slope, intercept);
    ``syntax``: the transfer syntax written (implicit VR leaves the VRs to the reader, big endian
    swaps the pixel bytes and OW words)."""
    ds = dataset(stored, bits=bits, photometric=photometric)
    if rescale is not None:
        ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = rescale[0], rescale[1], "US"
    lut = Dataset()
    lut.add_new(0x00283002, descriptor_vr or ("SS" if stored.dtype.kind == "i" else "US"), descriptor)
    lut.add_new(0x00283006, data_vr, data)
    ds.VOILUTSequence = Sequence([lut])
    ds.file_meta.TransferSyntaxUID = syntax
    if syntax == ExplicitVRBigEndian:
        ds.PixelData = stored.astype(stored.dtype.newbyteorder(">")).tobytes()
    return write(ds, path)


def rle(p: np.ndarray, path: Path) -> Path:
    """RLE Lossless (pydicom's own encoder and decoder)."""
    ds = dataset(p)
    ds.compress(RLELossless)
    return write(ds, path)


def jpeg2000(p: np.ndarray, path: Path) -> Path:
    """JPEG 2000 Lossless: a codestream Pillow encodes (reversible wavelet), encapsulated."""
    ds = dataset(p)
    buf = io.BytesIO()
    Image.fromarray(p).save(buf, format="JPEG2000", irreversible=False, no_jp2=True)
    ds.PixelData = encapsulate([buf.getvalue()])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = JPEG2000Lossless
    return write(ds, path)


def jpeg_baseline_bytes(p: np.ndarray) -> bytes:
    """A grey baseline JPEG of ``p`` (lossy: a reader must give back what Pillow decodes from it)."""
    buf = io.BytesIO()
    Image.fromarray(p).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def jpeg_baseline(p: np.ndarray, path: Path) -> Path:
    """JPEG Baseline (process 1), which pydicom decodes through Pillow."""
    ds = dataset(p)
    ds.PixelData = encapsulate([jpeg_baseline_bytes(p)])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
    return write(ds, path)


def jpeg_lossless_undecodable(p: np.ndarray, path: Path) -> Path:
    """A file in JPEG Lossless (process 14), which only gdcm or pylibjpeg-libjpeg decode; the
    fragment is not a real codestream: a reader without those must stop at the transfer syntax."""
    ds = dataset(p)
    ds.PixelData = encapsulate([b"\xff\xd8\xff\xc3" + bytes(64) + b"\xff\xd9"])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = JPEGLosslessSV1
    return write(ds, path)


def no_pixels(path: Path) -> Path:
    """A structured report-like object: DICOM, but no image."""
    ds = dataset(np.zeros((4, 4), np.uint8), modality="SR")
    del ds.PixelData
    return write(ds, path)


def colour(p: np.ndarray, path: Path) -> Path:
    meta = dataset(p)
    ds = dataset(np.stack([p, p, p], axis=-1), photometric="RGB")
    ds.SOPInstanceUID = meta.SOPInstanceUID
    return write(ds, path)


def multiframe(p: np.ndarray, path: Path) -> Path:
    return write(dataset(np.stack([p, p, p]), frames=3), path)
