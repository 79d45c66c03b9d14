"""``chexflow predict`` and ``chexflow export`` on a model fine-tuned here (resnet18, 32 px crops of
40 px shards cut from a 48 px phantom release): the probabilities equal evaluation's on the test
images, through their PNGs, JPEGs and DICOM files written here from the same pixels; unreadable and
non-radiograph files get a reason and stop nothing; the exports agree with torch and carry their
metadata. DICOM decoding (windows, LUTs, MONOCHROME1, compression, refusals) is checked alone first.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from PIL import Image

import dicom_files as D
from chexflow.data import augment, dicom, images
from chexflow.data import manifest as manifest_mod
from chexflow.evaluate import run as evaluate
from chexflow.evaluate import saliency
from chexflow.evaluate.config import EvaluateConfig
from chexflow.predict import export, files, heatmap
from chexflow.predict import run as predict
from chexflow.predict.config import ExportConfig, PredictConfig
from chexflow.predict.model import PredictInputError, load_predictor
from chexflow.config import check_study
from chexflow.settings import ConfigError, from_dict
from chexflow.train import trainer as T
from chexflow.train import identity
from chexflow.train.backends import Backend
from chexflow.train.checkpoint import ModelFileError, load_model_file
from chexflow.train.config import TrainConfig
from chexflow.train.models import build_model
from conftest import REPO, build_demo_dataset, cli_env, job_counts, module_scratch, snakemake
from test_distributed import train_cfg

RELEASE_SIZE, STORED, CROP = 48, 40, 32


def pixels(seed: int = 0, shape=(40, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


# --------------------------------------------------------------------------- DICOM decoding alone

@pytest.mark.parametrize("write", [
    D.plain, D.deep_windowed, D.voi_lut, D.voi_lut_8bit, D.rle, D.jpeg2000,
    lambda p, path: D.deep_windowed(p, path, monochrome1=False, function="LINEAR_EXACT", slope=2.0, intercept=100.0)],
    ids=["8bit", "12bit-rescale-window-monochrome1", "16bit-voi-lut", "8bit-voi-lut-1021-entries", "rle", "jpeg2000",
         "linear-exact"])
def test_dicom_gives_back_the_pixels_it_was_made_from(write, tmp_path):
    p = pixels()
    out = dicom.decode_dicom(write(p, tmp_path / "x.dcm").read_bytes(), name="x.dcm")
    assert out.dtype == np.uint8 and out.shape == p.shape
    assert np.array_equal(out, p)


def test_dicom_jpeg_baseline_is_what_pillow_decodes(tmp_path):
    p = pixels()
    out = dicom.decode_dicom(D.jpeg_baseline(p, tmp_path / "j.dcm").read_bytes(), name="j.dcm")
    with Image.open(io.BytesIO(D.jpeg_baseline_bytes(p))) as im:
        assert np.array_equal(out, np.asarray(im.convert("L")))


def test_dicom_sigmoid_window_follows_the_standard(tmp_path):
    """VOI LUT Function SIGMOID (PS3.3 C.11.2.1.3.1): y = 1 / (1 + exp(-4 (x - c) / w)) of the
    rescaled value x, computed here by hand; MONOCHROME1 inverted."""
    p, a, b = pixels(), 6.0, 300.0
    out = dicom.decode_dicom(D.deep_windowed(p, tmp_path / "s.dcm", function="SIGMOID", a=a, b=b).read_bytes(),
                             name="s.dcm")
    x = a * (255.0 - p) + b
    c, w = b + 127.5 * a + 0.5, 255 * a + 1
    expected = 255 - np.rint(255 / (1 + np.exp(-4 * (x - c) / w)))
    assert np.abs(out.astype(int) - expected).max() <= 1


def test_dicom_without_window_scales_like_a_16bit_png(tmp_path):
    """No VOI: 12-bit data is min-max scaled by its range, exactly as decode_grey does a 16-bit PNG."""
    deep = np.linspace(1000, 3000, 40 * 56).reshape(40, 56).astype(np.uint16)
    out = dicom.decode_dicom(D.write(D.dataset(deep, bits=12), tmp_path / "d.dcm").read_bytes(), name="d.dcm")
    buf = io.BytesIO()
    Image.fromarray(deep).save(buf, format="PNG")
    assert np.array_equal(out, images.decode_grey(buf.getvalue(), name="d.png"))


@pytest.mark.parametrize("write, reason", [
    (D.multiframe, "multi-frame (3 frames)"),
    (D.colour, "colour or not grey (RGB"),
    (lambda p, path: D.no_pixels(path), "no pixel data"),
    (lambda p, path: D.plain(p, path, modality="MR"), "modality MR, not a radiograph"),
    (lambda p, path: D.plain(p, path, modality="MG"), "modality MG, not a radiograph"),
], ids=["multiframe", "colour", "no-pixels", "mr", "mammography"])
def test_dicom_that_is_not_a_radiograph_is_refused_with_the_reason(write, reason, tmp_path):
    with pytest.raises(dicom.NotARadiograph) as exc:
        dicom.decode_dicom(write(pixels(), tmp_path / "x.dcm").read_bytes(), name="x.dcm")
    assert reason in exc.value.reason and "x.dcm" in str(exc.value)


def test_dicom_unreadable_files_name_the_problem(tmp_path):
    p = pixels()
    with pytest.raises(images.DecodeError, match=r"JPEG Lossless.*1\.2\.840\.10008\.1\.2\.4\.70.*(gdcm|pylibjpeg)"):
        dicom.decode_dicom(D.jpeg_lossless_undecodable(p, tmp_path / "j.dcm").read_bytes(), name="j.dcm")
    whole = D.plain(p, tmp_path / "a.dcm").read_bytes()
    with pytest.raises(images.DecodeError, match="pixel data.*less than expected"):
        dicom.decode_dicom(whole[:-300], name="cut.dcm")
    rle = D.rle(p, tmp_path / "r.dcm").read_bytes()
    with pytest.raises(images.DecodeError, match="truncated DICOM"):
        dicom.decode_dicom(rle[:-300], name="cut-rle.dcm")
    with pytest.raises(images.DecodeError, match="not a readable DICOM"):
        dicom.decode_dicom(b"\x89PNG\r\n\x1a\n" + bytes(200), name="png-named.dcm")
    with pytest.raises(images.DecodeError, match="junk.dcm': (not a readable|truncated) DICOM"):
        dicom.decode_dicom(b"\0" * 128 + b"DICM" + b"\xff" * 40, name="junk.dcm")
    big = D.plain(np.zeros((64, 64), np.uint8), tmp_path / "big.dcm").read_bytes()
    with pytest.raises(dicom.NotARadiograph, match="64 x 64 pixels"):
        dicom.decode_dicom(big, name="big.dcm", max_pixels=1000)


# --------------------------------------------------------------------------- a fine-tuned model

class Study:
    """What the chain leaves for predict: model.pt, the manifest, evaluation's metrics and predictions,
    and the test split's images as the release shipped them (PNG files)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.manifest = build_demo_dataset(root, n_images=200, image_size=RELEASE_SIZE, per_archive=100,
                                           samples_per_shard=25, stored_size=STORED)
        cfg = from_dict(TrainConfig, train_cfg("single", epochs=2, seed=1, channels_last="auto",
                                                   checkpoint={"every_steps": 100}))
        paths = T.TrainPaths(manifest=self.manifest, out_dir=root / "finetune", ckpt_dir=root / "finetune" / "ckpt")
        assert T.Trainer(cfg, paths, Backend()).fit() == 0
        self.run_id = identity.run_id(cfg, self.manifest, None)
        self.model = root / "finetune" / "model.pt"
        evaluate.run(EvaluateConfig(batch_size=16, bootstrap_resamples=20), model_path=self.model,
                     manifest=self.manifest, out_dir=root / "evaluate")
        self.metrics = root / "evaluate" / "metrics.json"
        self.packaged = root / "evaluate" / "model.pt"      # the model file that travels alone
        self.evaluation = pd.read_csv(root / "evaluate" / "predictions.csv")
        # evaluation's scores before its CSV rounded them
        net = load_predictor(self.model, self.manifest, self.metrics)[0].model
        s, _, _, names = evaluate.predict(net, manifest_mod.split_shards(self.manifest, "test"), crop=CROP, batch_size=16,
                                          device=torch.device("cpu"))
        self.scores = dict(zip(names, s))
        self.labels = list(load_model_file(self.model)["labels"])
        self.pngs = root / "test_png"
        self.pngs.mkdir()
        for archive in sorted((root / "release").glob("images_*.tar.gz")):
            with tarfile.open(archive) as tar:
                for member in tar.getmembers():
                    if Path(member.name).name in self.scores:
                        (self.pngs / Path(member.name).name).write_bytes(tar.extractfile(member).read())
        assert sorted(p.name for p in self.pngs.iterdir()) == sorted(self.scores)

    def thresholds(self) -> dict[str, float]:
        entries = json.loads(self.metrics.read_text())["labels"]
        return {k: v["threshold_val_youden"] for k, v in entries.items() if "threshold_val_youden" in v}

    def png(self, name: str) -> np.ndarray:
        with Image.open(self.pngs / name) as im:
            return np.asarray(im.convert("L"))


@pytest.fixture(scope="module")
def study(tmp_path_factory, request):
    with module_scratch(tmp_path_factory, request, "predict") as root:
        yield Study(root)


def scores_of(table: pd.DataFrame, labels: list[str]) -> np.ndarray:
    return table[[f"{label}_score" for label in labels]].apply(pd.to_numeric).to_numpy(np.float64)


def read_predictions(path: Path) -> pd.DataFrame:
    """predictions.csv with its text columns as text ('' for none) and the scores as numbers (NaN for none)."""
    table = pd.read_csv(path, keep_default_na=False)
    scores = [c for c in table.columns if c.endswith("_score")]
    table[scores] = table[scores].replace("", np.nan).apply(pd.to_numeric)
    return table


@pytest.mark.slow
def test_predict_on_the_test_pngs_gives_evaluations_probabilities(study, tmp_path):
    out = tmp_path / "predictions.csv"
    table = predict.run(PredictConfig(batch_size=7, workers=0), model_path=study.model, manifest=study.manifest,
                        metrics=study.metrics, out_csv=out, inputs=[study.pngs], progress=False)
    names = [Path(f).name for f in table["file"]]
    assert sorted(names) == sorted(study.scores) and (table["error"] == "").all() and (table["format"] == "PNG").all()
    got = scores_of(table, study.labels)
    want = np.stack([study.scores[n] for n in names]).astype(np.float64)
    print(f"max |predict - evaluate| over {len(names)} test images: {np.abs(got - want).max():.3g}")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # the written CSV: the same numbers (float32 read back exactly, as evaluation's own CSV)
    written = read_predictions(out)
    evaluation = study.evaluation.set_index("image").loc[names]
    np.testing.assert_allclose(scores_of(written, study.labels), scores_of(evaluation, study.labels),
                               rtol=2e-5, atol=1e-6)
    # the model's run id, and the findings at the validation thresholds, computed here from metrics.json
    assert (written["run_id"] == study.run_id).all()
    thresholds = study.thresholds()
    assert thresholds, "the fixture's evaluation chose no threshold: nothing to check the findings against"
    for row, p in zip(written.itertuples(), want):
        expected = [label for j, label in enumerate(study.labels) if label in thresholds and p[j] >= thresholds[label]]
        assert (row.findings.split(";") if row.findings else []) == expected
    assert written["findings"].ne("").any(), "no image has a finding: the check above saw only empty lists"



def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "chexflow", *args], env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


DICOM_WRITERS = {"plain.dcm": D.plain, "mono1-window.dcm": D.deep_windowed, "voi-lut.dcm": D.voi_lut,
                 "voi-lut-8bit.dcm": D.voi_lut_8bit, "rle.dcm": D.rle, "j2k.dcm": D.jpeg2000}


@pytest.mark.slow
def test_predict_cli_on_dicom_and_jpeg_made_from_the_same_pixels(study, tmp_path):
    """DICOM files of the test images' pixels (8-bit; 12-bit behind a rescale and a MONOCHROME1 window;
    16-bit behind a VOI LUT of 12-bit entries and one of 1021 8-bit entries; RLE; JPEG 2000), some
    without a suffix in a PACS-like tree: evaluation's probabilities. JPEGs: the probabilities of a PNG holding the pixels Pillow decodes from them."""
    names = sorted(study.scores)[:6]
    pacs, jpegs = tmp_path / "pacs", tmp_path / "jpeg"
    for k, name in enumerate(names):
        series = pacs / f"study{k}" / "series1"
        series.mkdir(parents=True)
        for fname, write in DICOM_WRITERS.items():
            write(study.png(name), series / (f"IM{fname.split('.')[0]}" if k % 2 else fname))
    jpegs.mkdir()
    listed = []
    for name in names[:3]:
        Image.fromarray(study.png(name)).save(jpegs / f"{name}.jpg", quality=85)
        with Image.open(jpegs / f"{name}.jpg") as im:
            Image.fromarray(np.asarray(im.convert("L"))).save(jpegs / f"{name}.decoded.png")
        listed += [f"jpeg/{name}.jpg", f"jpeg/{name}.decoded.png"]
    (tmp_path / "list.txt").write_text("# JPEGs and their decoded twins\n" + "\n".join(listed) + "\n")
    out = tmp_path / "out" / "predictions.csv"
    run_cli("predict", "--config-json", json.dumps({"workers": 1, "batch_size": 8}), "--model", str(study.model),
            "--manifest", str(study.manifest), "--metrics", str(study.metrics), "--out", str(out),
            str(pacs), str(tmp_path / "list.txt"))
    table = read_predictions(out)
    assert (table["error"] == "").all(), table.loc[table["error"] != "", ["file", "error"]]
    dicoms = table[table["format"] == "DICOM"]
    assert len(dicoms) == len(names) * len(DICOM_WRITERS)
    assert any("." not in Path(f).name for f in dicoms["file"]), "extension-less DICOM files were not found"
    image_of = {f: names[int(Path(f).parts[-3].removeprefix("study"))] for f in dicoms["file"]}
    want = np.stack([study.scores[image_of[f]] for f in dicoms["file"]])
    print(f"max |predict(DICOM) - evaluate| {np.abs(scores_of(dicoms, study.labels) - want).max():.3g}")
    np.testing.assert_allclose(scores_of(dicoms, study.labels), want, rtol=2e-5, atol=1e-6)
    assert (dicoms["run_id"] == study.run_id).all()
    jpg = table[table["format"] == "JPEG"]
    jpg = jpg.set_index(jpg["file"].map(lambda f: Path(f).name.removesuffix(".jpg")))
    twin = table[table["file"].str.endswith(".decoded.png")]
    twin = twin.set_index(twin["file"].map(lambda f: Path(f).name.removesuffix(".decoded.png")))
    assert len(jpg) == len(twin) == 3
    np.testing.assert_allclose(scores_of(jpg, study.labels), scores_of(twin.loc[jpg.index], study.labels), atol=1e-6)


def _copy_pngs(study, names, folder: Path) -> Path:
    """A new folder holding copies of the test split's PNGs ``names``."""
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes((study.pngs / name).read_bytes())
    return folder


@pytest.mark.slow
def test_unreadable_files_get_a_reason_and_the_others_go_on(study, tmp_path):
    names = sorted(study.scores)[:2]
    folder = _copy_pngs(study, names, tmp_path / "in")
    good = (study.pngs / names[0]).read_bytes()
    (folder / "cut.png").write_bytes(good[: len(good) // 2])
    (folder / "notes.png").write_text("not an image")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "huge.png").write_bytes(np.random.default_rng(0).bytes(int(1.5 * 2 ** 20)))
    p = study.png(names[0])
    D.multiframe(p, folder / "multi.dcm")
    D.colour(p, folder / "colour.dcm")
    D.plain(p, folder / "mr.dcm", modality="MR")
    D.no_pixels(folder / "sr.dcm")
    D.jpeg_lossless_undecodable(p, folder / "ljpeg.dcm")
    D.with_voi_lut(p.astype(np.uint16), folder / "badlut.dcm", descriptor=[256, 0, 8], data=list(range(200)))
    (folder / "notdicom.dcm").write_text("plain text")
    (folder / ".hidden.png").write_bytes(good)               # skipped, as are AppleDouble files and DICOMDIR
    (folder / "._mr.dcm").write_bytes(b"\0" * 10)
    D.plain(p, folder / "DICOMDIR")
    (tmp_path / "list.txt").write_text("in/missing.png\n")
    cfg = PredictConfig(batch_size=4, workers=1, max_file_mb=1)
    table = predict.run(cfg, model_path=study.model, manifest=study.manifest, metrics=study.metrics,
                        out_csv=tmp_path / "p.csv", inputs=[folder, tmp_path / "list.txt"], progress=False)
    errors = dict(zip(table["file"].map(lambda f: Path(f).name), table["error"]))
    assert sorted(errors) == sorted([*names, "cut.png", "notes.png", "empty.jpg", "huge.png", "multi.dcm",
                                     "colour.dcm", "mr.dcm", "sr.dcm", "ljpeg.dcm", "badlut.dcm", "notdicom.dcm",
                                     "missing.png"])
    expected = {"cut.png": "truncated|broken|image file is|incomplete", "notes.png": "not a PNG or JPEG file",
                "empty.jpg": "not a PNG or JPEG file", "huge.png": r"1\.5 MB, above predict\.max_file_mb \(1 MB\)",
                "multi.dcm": r"multi-frame \(3 frames\)", "colour.dcm": "colour or not grey", "mr.dcm": "modality MR",
                "sr.dcm": "no pixel data", "ljpeg.dcm": "transfer syntax JPEG Lossless.*(gdcm|pylibjpeg)",
                "badlut.dcm": r"UnsupportedVOILUT: LUT Data \(0028,3006\) holds 200 values; its descriptor says 256",
                "notdicom.dcm": "not a readable DICOM", "missing.png": "cannot read the file .No such file"}
    for fname, pattern in expected.items():
        assert re.search(pattern, errors[fname]), (fname, errors[fname])
    ok = table[table["error"] == ""]
    assert sorted(Path(f).name for f in ok["file"]) == names
    np.testing.assert_allclose(scores_of(ok, study.labels),
                               np.stack([study.scores[Path(f).name] for f in ok["file"]]), rtol=0, atol=1e-5)
    bad = table[table["error"] != ""]
    assert bad[[f"{label}_score" for label in study.labels]].isna().all().all() and (bad["findings"] == "").all()
    assert (table["run_id"] == study.run_id).all()


@pytest.mark.slow
def test_heatmaps_one_png_per_readable_file_for_its_most_likely_finding(study, tmp_path):
    names = sorted(study.scores)[:5]
    folder = _copy_pngs(study, names, tmp_path / "in")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    out = tmp_path / "res" / "predictions.csv"
    table = predict.run(PredictConfig(heatmaps=True, workers=0, batch_size=3), model_path=study.model,
                        manifest=study.manifest, metrics=study.metrics, out_csv=out, inputs=[folder], progress=False)
    written = read_predictions(out)
    assert list(written["heatmap"]) == list(table["heatmap"])
    thresholds = study.thresholds()
    for row in written.itertuples():
        if row.error:
            assert row.heatmap == "" and row.heatmap_label == ""
            continue
        probs = study.scores[Path(row.file).name]
        found = [j for j, label in enumerate(study.labels) if label in thresholds and probs[j] >= thresholds[label]]
        assert row.heatmap_label == study.labels[max(found or range(len(probs)), key=lambda j: probs[j])]
        with Image.open(out.parent / row.heatmap) as im:
            assert im.mode == "RGB" and im.size == (STORED, STORED)
    assert sorted(p.name for p in (out.parent / "heatmaps").iterdir()) == sorted(
        Path(h).name for h in written["heatmap"] if h)


def test_gradcam_is_the_hand_computed_grad_cam():
    """The report's Grad-CAM (evaluate.saliency, which the heatmaps use) against Grad-CAM by hand
    (forward/backward hooks on resnet18's layer4): weights = spatial mean of the target's gradient,
    map = ReLU(sum_k w_k A_k), upsampled bilinearly to the input."""
    torch.manual_seed(0)
    model = build_model("resnet18", in_channels=1, num_outputs=5).eval()
    x = torch.randn(3, 1, 96, 96)
    targets = [0, 3, 4]
    kept = {}
    layer = model.layer4
    h1 = layer.register_forward_hook(lambda m, i, o: kept.__setitem__("a", o))
    h2 = layer.register_full_backward_hook(lambda m, gi, go: kept.__setitem__("g", go[0]))
    out = model(x)
    out[torch.arange(3), torch.tensor(targets)].sum().backward()
    h1.remove(), h2.remove()
    weights = kept["g"].mean(dim=(2, 3), keepdim=True)
    cam = torch.relu((weights * kept["a"]).sum(dim=1, keepdim=True))
    cam = torch.nn.functional.interpolate(cam, size=(96, 96), mode="bilinear", align_corners=False)[:, 0].detach()
    got = saliency.gradcam(model, layer, x, targets, batch_size=2)
    assert got.shape == (3, 96, 96) and cam.max() > 0
    np.testing.assert_allclose(got, cam.numpy(), atol=1e-5 * float(cam.max()))


def test_heatmap_overlay_is_the_map_in_jet_over_the_image():
    grey = np.full((8, 8), 100, np.uint8)
    heat = np.zeros((4, 4), np.float32)
    png = Image.open(io.BytesIO(heatmap.overlay_png(grey, heat)))
    assert png.mode == "RGB" and png.size == (8, 8)
    # a zero map is jet's lowest colour (dark blue) at 0.4 over the grey
    from matplotlib import colormaps
    low = np.asarray(colormaps["jet"](0.0)[:3])
    np.testing.assert_allclose(np.asarray(png)[0, 0], np.rint((0.6 * 100 / 255 + 0.4 * low) * 255), atol=1)


@pytest.mark.slow
def test_predict_refuses_files_that_do_not_belong_together(study, tmp_path):
    metrics = json.loads(study.metrics.read_text())

    def refused(pattern: str, *, model=study.model, manifest=study.manifest, metrics_data=None):
        path = tmp_path / "metrics.json"
        path.write_text(json.dumps(metrics if metrics_data is None else metrics_data))
        with pytest.raises(PredictInputError, match=pattern):
            load_predictor(model, manifest, path)

    refused(r"evaluated another model \(model_run_id 'feedfeedfeedfeed'",
            metrics_data={**metrics, "model_run_id": "feedfeedfeedfeed"})
    refused("evaluated another model .model_epoch 99", metrics_data={**metrics, "model_epoch": 99})
    one_short = {**metrics, "labels": {k: v for k, v in list(metrics["labels"].items())[1:]}}
    refused("'labels' must hold the model's 14 labels", metrics_data=one_short)
    label = next(k for k, v in metrics["labels"].items() if "threshold_val_youden" in v)
    bad = json.loads(json.dumps(metrics))
    bad["labels"][label]["threshold_val_youden"] = 3.5
    refused(f"labels.{label}.threshold_val_youden must be a probability, got 3.5", metrics_data=bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(PredictInputError, match="broken.json: cannot read evaluation metrics"):
        load_predictor(study.model, study.manifest, tmp_path / "broken.json")
    manifest = json.loads(study.manifest.read_text())
    other = tmp_path / "manifest.json"
    other.write_text(json.dumps({**manifest, "labels": ["a", "b"]}))
    refused("its labels .* are not the model's", manifest=other)
    other.write_text(json.dumps({**manifest, "image_size": "big"}))
    refused("'image_size' must be a side in px", manifest=other)
    info = load_model_file(study.model)
    for change, pattern in (({"run_id": None}, "run_id is a NoneType"), ({"task": "multiclass"}, "task: the file's")):
        torch.save({**info, **change}, tmp_path / "model.pt")
        with pytest.raises(ModelFileError, match=pattern):
            load_predictor(tmp_path / "model.pt", study.manifest, study.metrics)
    if not torch.cuda.is_available():
        with pytest.raises(PredictInputError, match="device cuda asked for"):
            predict.run(PredictConfig(device="cuda"), model_path=study.model, manifest=study.manifest,
                        metrics=study.metrics, out_csv=tmp_path / "x.csv", inputs=[study.pngs], progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(files.NoInputsError, match="no image files"):
        predict.run(PredictConfig(), model_path=study.model, manifest=study.manifest, metrics=study.metrics,
                    out_csv=tmp_path / "x.csv", inputs=[tmp_path / "empty"], progress=False)
    assert not (tmp_path / "x.csv").exists()


# --------------------------------------------------------------------------- the model file that travels alone

@pytest.mark.slow
def test_model_file_alone_predicts_as_the_flags_do(study, tmp_path):
    """Evaluation's model.pt alone (CLI: --model, --out, the images): the scores of fine-tuning's model.pt
    with --manifest and --metrics, the thresholds and findings of evaluation's metrics.json, and a
    synthetic-data warning in the log and in every row."""
    cfg = PredictConfig(batch_size=7, workers=0)
    flags = predict.run(cfg, model_path=study.model, manifest=study.manifest, metrics=study.metrics,
                        out_csv=tmp_path / "flags.csv", inputs=[study.pngs], progress=False)
    alone = predict.run(cfg, model_path=study.packaged, out_csv=tmp_path / "alone.csv", inputs=[study.pngs],
                        progress=False)
    diff = np.abs(scores_of(alone, study.labels) - scores_of(flags, study.labels)).max()
    print(f"max |model file alone - flags| over {len(alone)} test PNGs: {diff:.3g}")
    assert diff <= 1e-6
    assert list(alone["findings"]) == list(flags["findings"]) and alone["findings"].ne("").any()
    # the record's thresholds are evaluation's, and its positives the validation positives they rest on
    info = load_model_file(study.packaged)
    metrics = json.loads(study.metrics.read_text())
    assert metrics["published_comparable"] is True       # NIH's 14 findings: evaluation says CheXNet's apply
    record = info["predict"]
    assert record["thresholds"] == {k: v.get("threshold_val_youden") for k, v in metrics["labels"].items()}
    assert record["val_positives"] == {k: {"images": v["val_positives"], "patients": v["val_positive_patients"]}
                                       for k, v in metrics["labels"].items()}
    manifest = json.loads(study.manifest.read_text())
    assert (record["stored_size"], record["synthetic"], record["dataset_title"]) == (STORED, True, manifest["title"])
    assert (record["mean"], record["std"], info["crop"]) == (augment.MEAN, augment.STD, CROP)
    # the weights evaluation packaged are the ones it evaluated: the fine-tuning's, tensor for tensor
    trained = load_model_file(study.model)
    assert all(torch.equal(trained["state_dict"][k], v) for k, v in info["state_dict"].items())
    assert {k: v for k, v in info.items() if k not in ("predict", "state_dict")} == \
        {k: v for k, v in trained.items() if k != "state_dict"}
    proc = run_cli("predict", "--config-json", json.dumps({"workers": 0}), "--model", str(study.packaged),
                   "--out", str(tmp_path / "cli.csv"), str(study.pngs))
    assert proc.stderr.count("trained on synthetic data") == 2 and f"thresholds from {study.packaged}" in proc.stderr
    written = read_predictions(tmp_path / "cli.csv")
    assert written["synthetic_training_data"].astype(str).eq("True").all() and (written["run_id"] == study.run_id).all()
    np.testing.assert_allclose(scores_of(written, study.labels), scores_of(alone, study.labels), rtol=2e-5, atol=1e-6)


@pytest.mark.slow
def test_model_file_with_a_malformed_record_is_refused_naming_the_key(study, tmp_path):
    info = load_model_file(study.packaged)
    label = study.labels[0]

    def refused(pattern: str, change) -> None:
        broken = json.loads(json.dumps(info["predict"]))
        change(broken)
        torch.save({**info, "predict": broken}, tmp_path / "model.pt")
        with pytest.raises(ModelFileError, match=pattern):
            load_predictor(tmp_path / "model.pt")

    refused(r"no 'predict.thresholds'", lambda r: r.pop("thresholds"))
    refused(r"predict.stored_size is a str", lambda r: r.update(stored_size="40"))
    refused(r"predict.synthetic is a str", lambda r: r.update(synthetic="yes"))
    refused(r"predict.mean is a str", lambda r: r.update(mean="0.5"))
    refused(r"predict.thresholds names label\(s\) the model does not have: \['Dragon'\]",
            lambda r: r["thresholds"].update(Dragon=0.5))
    refused(rf"predict.thresholds lacks the model's label\(s\) \['{label}'\]", lambda r: r["thresholds"].pop(label))
    refused(rf"predict.thresholds.{label} is 1.5, not a probability", lambda r: r["thresholds"].update({label: 1.5}))
    refused(rf"predict.val_positives.{label} is .*not {{'images'", lambda r: r["val_positives"].update({label: 3}))
    refused(r"predict.mean/std \(0.5, 0.0\) is not a normalisation", lambda r: r.update(std=0.0))
    refused(r"predict has keys this chexflow does not know: \['extra'\]", lambda r: r.update(extra=1))
    torch.save({**info, "predict": [1, 2]}, tmp_path / "model.pt")
    with pytest.raises(ModelFileError, match="predict is a list"):
        load_predictor(tmp_path / "model.pt")
    # a model file without a record needs the flags, and says which
    with pytest.raises(PredictInputError, match=r"no 'predict' record .* give --manifest"):
        load_predictor(study.model)
    with pytest.raises(PredictInputError, match=r"no 'predict' record .* give --metrics"):
        load_predictor(study.model, study.manifest)


@pytest.mark.slow
def test_flags_override_the_record(study, tmp_path):
    """--metrics replaces the record's thresholds; --manifest its stored size (here a manifest saying 36 px)."""
    metrics = json.loads(study.metrics.read_text())
    label = next(k for k, v in metrics["labels"].items() if "threshold_val_youden" in v)
    metrics["labels"][label]["threshold_val_youden"] = 0.0
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    predictor, _ = load_predictor(study.packaged, None, tmp_path / "metrics.json")
    assert predictor.thresholds[label] == 0.0 and predictor.sources["thresholds"] == str(tmp_path / "metrics.json")
    assert predictor.preprocess.stored_size == STORED and predictor.synthetic is True
    manifest = json.loads(study.manifest.read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "image_size": 36, "synthetic": False}))
    predictor, _ = load_predictor(study.packaged, tmp_path / "manifest.json")
    assert (predictor.preprocess.stored_size, predictor.synthetic) == (36, False)
    assert predictor.thresholds == {k: v for k, v in load_model_file(study.packaged)["predict"]["thresholds"].items()
                                    if v is not None}


def test_list_inputs(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for rel in ("a/1.PNG", "a/b/2.jpeg", "a/b/3.dcm", "a/notes.txt", "a/.x.png", "a/b/DICOMDIR", "a/readme"):
        (tmp_path / rel).write_bytes(b"x")
    D.plain(pixels(), tmp_path / "a" / "b" / "IM0001")
    (tmp_path / "list.txt").write_text("# two\na/1.PNG\n\n/abs/none.png\nc/gone.jpg\n")
    found = files.list_inputs([tmp_path / "a", tmp_path / "list.txt", tmp_path / "a" / "b" / "3.dcm"])
    rel = [str(p.relative_to(tmp_path)) if p.is_relative_to(tmp_path) else str(p) for p in found]
    # the folder's images (sorted, extension-less DICOM included), then the list's (a/1.PNG once)
    assert rel == ["a/1.PNG", "a/b/2.jpeg", "a/b/3.dcm", "a/b/IM0001", "/abs/none.png", "c/gone.jpg"]
    with pytest.raises(files.NoInputsError, match="nowhere: no such file or folder"):
        files.list_inputs([tmp_path / "nowhere"])


def test_predict_and_export_settings_are_checked():
    for cls, data, message in (
            (PredictConfig, {"batch_size": 0}, "predict.batch_size: 0 is not >= 1"),
            (PredictConfig, {"workers": -1}, "predict.workers: -1 is not >= 0"),
            (ExportConfig, {"formats": ["onnx", "onnx"]}, "export.formats: .* lists a value twice"),
            (ExportConfig, {"formats": ["tflite"]}, r"export.formats\[0\]: 'tflite' is not one of"),
            (ExportConfig, {"check_images": 1}, "export.check_images: 1 is not >= 2"),
            (ExportConfig, {"tolerance": 0.0}, r"export.tolerance: 0.0 is not in \(0, 1\)")):
        with pytest.raises(ConfigError, match=message):
            from_dict(cls, data, "predict" if cls is PredictConfig else "export")
    study = yaml.safe_load((REPO / "config.yaml").read_text())
    study["predict"] = {"enabled": True, "modalities": []}
    with pytest.raises(ConfigError, match=r"predict.modalities: \[\] would refuse every DICOM file"):
        check_study(study)


# --------------------------------------------------------------------------- exports

@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
@pytest.mark.slow
def test_exports_agree_with_torch_and_carry_what_a_server_needs(study, tmp_path):
    card = tmp_path / "model_card.md"
    card.write_text("# Model card\nSynthetic phantoms only.\n")
    out = tmp_path / "export"
    summary = export.run(ExportConfig(check_images=16), model_path=study.packaged, manifest=study.manifest,
                         out_dir=out, model_card=card)
    recorded = json.loads((out / "export.json").read_text())
    assert recorded == json.loads(json.dumps(summary))
    # export.json names the predict record the exports carry: the model file's, by its sha256
    record = json.loads(json.dumps(load_model_file(study.packaged)["predict"]))
    named = recorded["predict_record"]
    assert named["key"] == "chexflow.json:predict" and named["in_model_file"] is True
    assert named["sha256"] == hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    assert named["thresholds"] == named["stored_size"] == str(study.packaged)
    assert recorded["metadata"]["predict"] == record and recorded["metadata"]["synthetic_training_data"] is True
    assert recorded["n_check_images"] == 16 and recorded["run_id"] == study.run_id
    for fmt in ("torchscript", "onnx"):
        diffs = recorded["exports"][fmt]["max_abs_diff"]
        print(f"{fmt}: max |export - torch| {diffs}")
        assert set(diffs) == {"batch_16", "batch_1"} and max(diffs.values()) <= 1e-4
    assert (out / "model_card.md").read_text() == card.read_text()
    # the metadata: what evaluation chose and what the training path did, read back from each file
    thresholds = study.thresholds()
    files_meta = {"torchscript": {"chexflow.json": "", "model_card.md": ""}}
    ts = torch.jit.load(str(out / "model.torchscript.pt"), _extra_files=files_meta["torchscript"])
    import onnxruntime
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_meta = session.get_modelmeta().custom_metadata_map
    for text, card_text in ((files_meta["torchscript"]["chexflow.json"].decode(),
                             files_meta["torchscript"]["model_card.md"].decode()),
                            (onnx_meta["chexflow.json"], onnx_meta["model_card.md"])):
        meta = json.loads(text)
        assert card_text == card.read_text() and meta["predict"] == record
        assert meta["run_id"] == study.run_id and meta["labels"] == study.labels
        assert meta["thresholds"] == {label: thresholds.get(label) for label in study.labels}
        pre = meta["preprocess"]
        assert (pre["stored_size"], pre["crop"], pre["mean"], pre["std"]) == (STORED, CROP, augment.MEAN, augment.STD)
    # any batch size, on test images the check did not use: the probabilities evaluation computed
    names = sorted(study.scores)[-5:]
    x = torch.stack([torch.from_numpy(images.resize_square(study.png(n), STORED)) for n in names])
    x = augment.gpu_augment(x, out_size=CROP, train=False, cfg=None, generator=None)
    want = np.stack([study.scores[n] for n in names])
    with torch.no_grad():
        np.testing.assert_allclose(ts(x).numpy(), want, atol=1e-5)
    np.testing.assert_allclose(session.run(["probabilities"], {"image": x[:3].numpy()})[0], want[:3], atol=1e-4)
    assert [d.name for d in session.get_inputs()] == ["image"] and session.get_inputs()[0].shape[0] == "batch"


@pytest.mark.slow
def test_export_cli_one_format_without_model_card(study, tmp_path):
    out = tmp_path / "export"
    proc = run_cli("export", "--config-json", json.dumps({"formats": ["onnx"], "check_images": 4}),
                   "--model", str(study.model), "--manifest", str(study.manifest), "--metrics", str(study.metrics),
                   "--out-dir", str(out), "--model-card", str(tmp_path / "absent.md"))
    assert "no model card at" in proc.stderr and "onnx: " in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.onnx"]
    recorded = json.loads((out / "export.json").read_text())
    assert list(recorded["exports"]) == ["onnx"] and recorded["metadata"]["model_card"] is None


@pytest.mark.slow
def test_export_beyond_tolerance_writes_nothing(study, tmp_path):
    """A re-loaded export at batch size 1 (TorchScript) or on ONNX Runtime's kernels differs from the
    torch model by ~1e-7, above a tolerance of 1e-12: the export stops naming the difference, and no
    file takes its name."""
    out = tmp_path / "export"
    with pytest.raises(export.ExportMismatchError,
                       match=r"(torchscript|onnx) export of .*differ from torch's by .* > export.tolerance 1e-12"):
        export.run(ExportConfig(formats=("torchscript", "onnx"), check_images=4, tolerance=1e-12),
                   model_path=study.model, manifest=study.manifest, metrics=study.metrics, out_dir=out)
    assert not out.exists() or [p.name for p in out.iterdir()] == []


# --------------------------------------------------------------------------- the rules

def test_rules_are_off_by_default_and_join_rule_all_when_on(tmp_path):
    (tmp_path / "config.yaml").write_text((REPO / "config.yaml").read_text())
    dry = snakemake(tmp_path, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert "predict_images" not in counts and "export_model" not in counts
    (tmp_path / "scans").mkdir()
    on = tmp_path / "on.yaml"
    on.write_text(yaml.safe_dump({"predict": {"enabled": True, "inputs": ["scans"], "heatmaps": True},
                                  "export": {"enabled": True}}))
    dry = snakemake(tmp_path, "-n", "-p", "--configfile", str(tmp_path / "config.yaml"), str(on))
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["predict_images"] == counts["export_model"] == counts["evaluate_model"] == 1
    assert "--heatmap-dir results/predict/heatmaps" in dry.stdout
    assert "--out-dir results/export --model-card results/finetune/model_card.md" in dry.stdout


@pytest.mark.slow
def test_rules_run_on_the_chain_outputs(study, tmp_path):
    """predict_images and export_model as Snakemake runs them, on the model, manifest and metrics the
    chain leaves (placed where its rules write them; --allowed-rules keeps the rest of the chain out)."""
    shutil.copytree(study.manifest.parent, tmp_path / "data" / "shards" / "nih_demo")
    for src, dest in ((study.model, "results/finetune/model.pt"), (study.metrics, "results/evaluate/metrics.json"),
                      (study.packaged, "results/evaluate/model.pt")):
        (tmp_path / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tmp_path / dest)
    card = "# Model card\n\nwritten by the report (render_report), carried along with the exports\n"
    (tmp_path / "results/finetune/model_card.md").write_text(card)
    names = sorted(study.scores)[:4]
    (tmp_path / "scans").mkdir()
    for k, name in enumerate(names):
        D.plain(study.png(name), tmp_path / "scans" / f"{k}.dcm")
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["predict"] = {"enabled": True, "inputs": ["scans"], "heatmaps": True, "workers": 0}
    cfg["export"] = {"enabled": True, "formats": ["onnx"], "check_images": 4}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(tmp_path, "--allowed-rules", "predict_images", "export_model", "--",
                     "results/predict/predictions.csv", "results/export/export.json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    table = read_predictions(tmp_path / "results/predict/predictions.csv")
    order = [names[int(Path(f).stem)] for f in table["file"]]
    np.testing.assert_allclose(scores_of(table, study.labels), np.stack([study.scores[n] for n in order]), atol=1e-5)
    assert table["synthetic_training_data"].astype(str).eq("True").all()   # pandas reads the CSV's true
    assert len(list((tmp_path / "results/predict/heatmaps").glob("*.png"))) == len(names)
    summary = json.loads((tmp_path / "results/export/export.json").read_text())
    assert summary["exports"]["onnx"]["max_abs_diff"] and summary["metadata"]["model_card"] == "model_card.md"
    assert (tmp_path / "results/export/model_card.md").read_text() == card


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_predict_on_cuda_gives_the_cpu_probabilities(study, tmp_path):
    """The same files on the GPU (bench/gpu_check.sh runs this): the probabilities of the CPU run,
    to the tolerance of different kernels."""
    runs = {device: predict.run(PredictConfig(device=device, heatmaps=True), model_path=study.model,
                                manifest=study.manifest, metrics=study.metrics,
                                out_csv=tmp_path / device / "p.csv", inputs=[study.pngs], progress=False)
            for device in ("cpu", "cuda")}
    np.testing.assert_allclose(scores_of(runs["cuda"], study.labels), scores_of(runs["cpu"], study.labels), atol=1e-4)
