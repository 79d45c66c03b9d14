"""Images/s of ``chexflow predict`` against a plain loop doing the same work, in one process.

The inputs: ``--n`` radiograph-like grey images of ``--size`` px (1,024: the NIH release's side),
once as 8-bit PNG files and once as DICOM files (12 bits stored, a rescale and a MONOCHROME1 window:
what a DX/CR export holds). The model: ``--arch`` with chexflow's grey stem and 14 outputs, random
weights, saved as a chexflow model file; the data it "was trained on" stores ``--stored`` px images,
fed to the network at ``--crop`` px (the real study's 256 / 224). Per format:

* ``loop``      -- the reference: for each file, PIL (``Image.open(...).convert("L")``) or pydicom
                  (``dcmread``, ``pixel_array``, ``apply_modality_lut``, ``apply_voi_lut``, scale to
                  0..255, invert MONOCHROME1) decodes it, PIL cuts the central square and resizes it
                  to ``--stored``; every ``--batch`` images go through ``interpolate`` to ``--crop``,
                  the normalisation and the model: no chexflow code, no worker processes;
* ``predict``   -- ``chexflow.predict.run.run`` for real: the same files listed from their folder,
                  decoded through chexflow's readers, batched, the probabilities and findings written
                  to a CSV; with ``--workers 0`` (decoding in this process, like the loop) and with the
                  default ``predict.workers`` (1 decoding process beside the model).

Each is run once untimed (warm page cache and kernels), then ``--repeats`` times alternating; the
median counts. Prints images/s and ``predict / loop`` (target >= 0.9), and the CPU seconds per image
(this process and its finished children, i.e. the decoding workers): on a machine shared with other
jobs the wall-clock rates swing with their load, the CPU cost per image less. Last, the decoding
alone (file to stored pixels, one process): CPU ms per image of the loop's decode and of chexflow's
reader (``predict.files.Reader``), and that the two give the same pixels.

    OMP_NUM_THREADS=2 .venv/bin/python bench/predict.py              # CPU: resnet18, 256 / 224 px
    python bench/predict.py --device cuda --arch resnet50 --n 256 --batch 64   # bench/gpu_check.sh
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from chexflow.data import nih  # noqa: E402
from chexflow.fsutil import write_text_atomic  # noqa: E402
from chexflow.predict import run as predict  # noqa: E402
from chexflow.predict.config import PredictConfig  # noqa: E402
from chexflow.train import checkpoint, models  # noqa: E402


def _test_helper(name: str):
    """A module of tests/ by its path (the DICOM writers the tests use: one way to make these files)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dicom_files = _test_helper("dicom_files")


def radiograph(args: tuple[int, int]) -> np.ndarray:
    """Image ``i``: a smooth random field, a vertical gradient and pixel noise, uint8."""
    i, size = args
    rng = np.random.default_rng([7, i])
    coarse = Image.fromarray(rng.integers(40, 200, (12, 12), dtype=np.uint8))
    field = np.asarray(coarse.resize((size, size), Image.Resampling.BICUBIC), dtype=np.int16)
    ramp = np.linspace(0, 50, size).astype(np.int16)[:, None]
    return np.clip(field + ramp + rng.integers(-6, 7, (size, size), dtype=np.int16), 0, 255).astype(np.uint8)


def write_one(args: tuple[int, int, str]) -> None:
    i, size, work = args
    img = radiograph((i, size))
    Image.fromarray(img).save(f"{work}/png/{i:05d}.png")
    dicom_files.deep_windowed(img, Path(f"{work}/dicom/{i:05d}.dcm"))


def write_inputs(work: Path, n: int, size: int) -> None:
    (work / "png").mkdir(parents=True)
    (work / "dicom").mkdir()
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(write_one, [(i, size, str(work)) for i in range(n)], chunksize=8)


def write_model(work: Path, arch: str, stored: int, crop: int) -> tuple[Path, Path, Path]:
    """A chexflow model file (random weights), the manifest of its data and evaluation's metrics
    (no thresholds chosen: no findings, which costs nothing either way)."""
    labels = list(nih.LABELS)
    net = models.build_model(arch, in_channels=1, num_outputs=len(labels))
    model = work / "model.pt"
    torch.save(checkpoint.model_record(state_dict=net.state_dict(), run_id="bench", stage="finetune", dataset="nih",
                                       task="multilabel", labels=labels, arch=arch, in_channels=1, crop=crop,
                                       epoch=1, val_metric=0.5, val_metric_name="mean_auroc", config={}), model)
    manifest, metrics = work / "manifest.json", work / "metrics.json"
    write_text_atomic(manifest, json.dumps({"dataset": "nih", "labels": labels, "image_size": stored}))
    write_text_atomic(metrics, json.dumps({"labels": {label: {} for label in labels}}))
    return model, manifest, metrics


def decode_png(path: Path, stored: int) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(square(im.convert("L"), stored))


def decode_dicom(path: Path, stored: int) -> np.ndarray:
    import pydicom
    from pydicom.pixels import apply_modality_lut, apply_voi_lut
    ds = pydicom.dcmread(path)
    v = apply_voi_lut(apply_modality_lut(ds.pixel_array, ds), ds)
    lo = ds.RescaleIntercept                                     # the window's output range (pydicom's)
    hi = (2 ** ds.BitsStored - 1) * ds.RescaleSlope + ds.RescaleIntercept
    u8 = np.rint(np.clip((v - lo) / (hi - lo), 0, 1) * 255).astype(np.uint8)
    if ds.PhotometricInterpretation == "MONOCHROME1":
        u8 = 255 - u8
    return np.asarray(square(Image.fromarray(u8), stored))


def square(img: Image.Image, size: int) -> Image.Image:
    w, h = img.size
    s = min(w, h)
    img = img.crop(((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s))
    return img.resize((size, size), Image.Resampling.BILINEAR)


def load_net(model_file: Path, arch: str, device: torch.device) -> torch.nn.Module:
    net = models.build_model(arch, in_channels=1, num_outputs=len(nih.LABELS))
    net.load_state_dict(torch.load(model_file, map_location="cpu", weights_only=True)["state_dict"])
    return net.to(device).eval()


def loop_pass(paths: list[Path], decode, model_file: Path, *, arch: str, stored: int, crop: int, batch: int,
              device: torch.device) -> float:
    """images/s of the plain loop, loading the model file as predict does."""
    t0 = time.perf_counter()
    net = load_net(model_file, arch, device)
    done = 0
    with torch.no_grad():
        for first in range(0, len(paths), batch):
            imgs = np.stack([decode(p, stored) for p in paths[first:first + batch]])
            x = torch.from_numpy(imgs).to(device).unsqueeze(1).float().div_(255.0)
            x = torch.nn.functional.interpolate(x, size=(crop, crop), mode="bilinear", antialias=True,
                                                align_corners=False)
            probs = torch.sigmoid(net((x - 0.5) / 0.25)).cpu().numpy()
            done += len(probs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return done / (time.perf_counter() - t0)


def predict_pass(folder: Path, files: tuple[Path, Path, Path], out: Path, *, batch: int, workers: int,
                 device: str) -> float:
    cfg = PredictConfig(batch_size=batch, workers=workers, device=device)
    t0 = time.perf_counter()
    table = predict.run(cfg, model_path=files[0], manifest=files[1], metrics=files[2], out_csv=out,
                        inputs=[folder], progress=False)
    dt = time.perf_counter() - t0
    assert (table["error"] == "").all(), table["error"].unique()[:3]
    return len(table) / dt


def decode_cpu(paths: list[Path], decode, stored: int, repeats: int) -> dict:
    """CPU ms per image of the loop's decode and of chexflow's reader (median of ``repeats``
    alternating passes), and the largest pixel difference between them."""
    from chexflow.predict.files import reader_for
    reader = reader_for("nih", stored, PredictConfig())
    ms = {"loop": [], "chexflow": []}
    for _ in range(repeats):
        for name, read in (("loop", lambda p: decode(p, stored)), ("chexflow", lambda p: reader.read(p)[0])):
            t = time.process_time()
            for p in paths:
                read(p)
            ms[name].append(1000 * (time.process_time() - t) / len(paths))
    diff = max(int(np.abs(decode(p, stored).astype(int) - reader.read(p)[0]).max()) for p in paths)
    return {"cpu_ms_per_image": {k: statistics.median(v) for k, v in ms.items()}, "max_pixel_diff": diff}


def cpu_seconds() -> float:
    """User + system CPU of this process and of its children that have ended (loader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="images per format")
    ap.add_argument("--size", type=int, default=1024, help="side of the files in px")
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--stored", type=int, default=256, help="stored side of the training data")
    ap.add_argument("--crop", type=int, default=224, help="network input side")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=PredictConfig().workers,
                    help="predict's decoding processes in the second predict variant (the first has 0)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed")
    args = ap.parse_args(argv)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="chexflow-bench-predict-"))
    device = torch.device(args.device)
    try:
        t0 = time.perf_counter()
        write_inputs(work, args.n, args.size)
        files = write_model(work, args.arch, args.stored, args.crop)
        mb = {f: sum(p.stat().st_size for p in (work / f).iterdir()) / 1e6 for f in ("png", "dicom")}
        print(f"inputs: {args.n} images of {args.size} px as PNG ({mb['png']:.0f} MB) and DICOM "
              f"({mb['dicom']:.0f} MB), written in {time.perf_counter() - t0:.0f} s; model {args.arch}, stored "
              f"{args.stored} px, crop {args.crop} px, batch {args.batch}, device {device}, "
              f"torch threads {torch.get_num_threads()}")
        variants = {"loop": None, "predict (workers 0)": 0, f"predict (workers {args.workers})": args.workers}
        results = {}
        for fmt, decode in (("png", decode_png), ("dicom", decode_dicom)):
            paths = sorted((work / fmt).iterdir())

            def once(workers) -> tuple[float, float]:
                """(images/s, CPU s per image) of one pass."""
                cpu = cpu_seconds()
                if workers is None:
                    rate = loop_pass(paths, decode, files[0], arch=args.arch, stored=args.stored, crop=args.crop,
                                     batch=args.batch, device=device)
                else:
                    rate = predict_pass(work / fmt, files, work / f"{fmt}.csv", batch=args.batch, workers=workers,
                                        device=args.device)
                return rate, (cpu_seconds() - cpu) / len(paths)

            rates = {name: [] for name in variants}
            cpu = {name: [] for name in variants}
            for name, workers in variants.items():
                once(workers)                                       # warm-up, untimed
            for _ in range(args.repeats):
                for name, workers in variants.items():
                    rate, per_image = once(workers)
                    rates[name].append(rate)
                    cpu[name].append(per_image)
            med = {name: statistics.median(r) for name, r in rates.items()}
            med_cpu = {name: statistics.median(c) for name, c in cpu.items()}
            results[fmt] = {"images_per_s": med, "passes": rates, "cpu_s_per_image": med_cpu,
                            "ratio_to_loop": {name: med[name] / med["loop"] for name in variants if name != "loop"},
                            "cpu_ratio_to_loop": {name: med_cpu[name] / med_cpu["loop"] for name in variants
                                                  if name != "loop"}}
            dec = results[fmt]["decode_alone"] = decode_cpu(paths[:16], decode, args.stored, max(args.repeats, 5))
            ms = dec["cpu_ms_per_image"]
            print(f"{fmt:5s} decoding alone: loop {ms['loop']:.1f} CPU ms/image, chexflow's reader "
                  f"{ms['chexflow']:.1f} ({ms['chexflow'] / ms['loop']:.2f}x); largest pixel difference "
                  f"{dec['max_pixel_diff']}")
            for name in variants:
                ratio = "" if name == "loop" else (f"  = {med[name] / med['loop']:.2f}x the loop's rate, "
                                                   f"{med_cpu[name] / med_cpu['loop']:.2f}x its CPU per image")
                print(f"{fmt:5s} {name:20s} {med[name]:7.1f} images/s, {med_cpu[name]:.3f} CPU s/image "
                      f"(passes {', '.join(f'{r:.1f}' for r in rates[name])}){ratio}")
        worst = min(r for f in results.values() for r in f["ratio_to_loop"].values())
        print(f"machine: {platform.node()}, {os.cpu_count()} cores; lowest predict / loop {worst:.2f} "
              f"(target >= 0.9): {'OK' if worst >= 0.9 else 'MISSED'}")
        if args.json:
            write_text_atomic(args.json, json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "device": str(device), "results": results}, indent=1))
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
