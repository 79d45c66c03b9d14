"""The settings of using the fine-tuned model (config.yaml ``predict:`` and ``export:``), each off
unless enabled. Imported at DAG time (the rules' outputs depend on them), so it imports nothing heavy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from chexflow.settings import setting


@dataclass(frozen=True)
class PredictConfig:
    """``chexflow predict``: the fine-tuned model on images it has not seen (rules/predict.smk)."""
    enabled: bool = False             # the workflow runs predict_images (rule all) when true
    # folders (searched recursively for .png/.jpg/.jpeg/.dcm/.dicom and extension-less DICOM files)
    # and/or list files (.txt: one image path per line, relative to the list's folder)
    inputs: tuple[str, ...] = ()
    batch_size: int = setting(32, ge=1)
    workers: int = setting(1, ge=0)   # decoding processes beside the model (0: decode in the main process)
    device: Literal["auto", "cpu", "cuda"] = "auto"   # auto: cuda when available
    heatmaps: bool = False            # a Grad-CAM PNG per image, for its most likely finding
    # DICOM: what counts as a radiograph (0008,0060 Modality); other modalities are refused
    modalities: tuple[str, ...] = setting(("CR", "DX", "DR"), unique=True)
    max_file_mb: int = setting(512, ge=1)   # larger files are refused unread (a CR image is ~10-30 MB)
    # an image declaring more pixels is refused before it is decoded (a 3,000 x 3,000 CR is 9; the
    # shard stage's default shards.<dataset>.max_image_megapixels is the same)
    max_image_megapixels: float = setting(64.0, gt=0.0)


@dataclass(frozen=True)
class ExportConfig:
    """``chexflow export``: TorchScript and ONNX of the fine-tuned model, checked against torch."""
    enabled: bool = False             # the workflow runs export_model (rule all) when true
    formats: tuple[Literal["torchscript", "onnx"], ...] = setting(("torchscript", "onnx"), unique=True)
    # test images the exports are compared on against the torch model: two batches at least, one of a
    # single image and one of several (dynamic batch size)
    check_images: int = setting(64, ge=2)
    tolerance: float = setting(1e-4, gt=0.0, lt=1.0)   # largest allowed |export - torch| of a probability (fp32)
    opset: int = setting(18, ge=18)   # ONNX opset (torch's exporter writes 18 or newer)
