"""Using the fine-tuned model: ``chexflow predict`` on PNG, JPEG and DICOM files (``run``), and its
TorchScript and ONNX exports checked against torch (``export``). Above ``evaluate`` in the layers
(its saliency draws the heatmaps); only the CLI imports it. This module stays import-light: the
Snakefile reads the export file names from it.
"""

# The files of ``chexflow export`` in its --out-dir, by format, and the summary of their checks
EXPORT_FILES = {"torchscript": "model.torchscript.pt", "onnx": "model.onnx"}
EXPORT_SUMMARY = "export.json"
