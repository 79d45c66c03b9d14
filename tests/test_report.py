"""Tests of the self-contained HTML report (chexflow.report.render)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from chexflow.evaluate import published, record
from chexflow.report import render

LABELS = list(published.CHEXNET_AUROC)
CHROMIUM = "/usr/bin/chromium"


# --------------------------------------------------------------------------- fixtures
def _epochs(n: int, metric: str, world_size: int) -> list[dict]:
    return [{"epoch": e, "step": 10 * (e + 1), "train_loss": 1.0 / (e + 1), "val_loss": 1.1 / (e + 1),
             "val_metric": 0.6 + 0.05 * e, "val_metric_name": metric, "lr": 1e-3 * 0.5 ** e,
             "images_per_sec": 120.0 + e, "epoch_time_s": 30.0 + e, "world_size": world_size}
            for e in range(n)]


def _manifest(name: str, labels: list[str], *, synthetic: bool, task: str, title: str) -> dict:
    splits = {}
    for split, n in (("train", 300), ("val", 60), ("test", 60)):
        splits[split] = {"n_images": n, "n_patients": n // 3,
                         "label_counts": {lab: (i * 7 + n) % 40 for i, lab in enumerate(labels)},
                         "n_shards": 2, "shards": [f"{split}-000000.tar", f"{split}-000001.tar"]}
    return {"dataset": name, "title": title, "synthetic": synthetic, "task": task, "labels": labels,
            "image_size": 224, "splits": splits, "n_rejects": 1}


def noisy(scores, rng: np.random.Generator, noise: float) -> np.ndarray:
    """Another run's scores: Gaussian noise of ``noise`` on the logits of ``scores``, back through the
    sigmoid (a predictions.csv holds probabilities; the reader refuses anything outside [0, 1])."""
    p = np.clip(np.asarray(scores, dtype=float), 1e-6, 1 - 1e-6)
    logits = np.log(p / (1 - p)) + rng.normal(scale=noise, size=p.shape)
    return 1 / (1 + np.exp(-logits))


def _make_inputs(tmp_path: Path) -> dict:
    """Small but well-formed inputs in the contract formats, written under ``tmp_path/in``."""
    rng = np.random.default_rng(0)
    n, n_patients = 60, 20
    patients = np.repeat([f"{i:08d}" for i in range(n_patients)], n // n_patients)
    pred = {"image": [f"{p}_{k:03d}.png" for k, p in enumerate(patients)], "patient": patients}
    label_entries = {}
    for j, lab in enumerate(LABELS):
        y = (rng.random(n) < 0.3).astype(float)
        y[:2] = [0.0, 1.0]
        if lab == "Hernia":
            y[:] = 0.0  # single class -> AUROC n/a
        y[rng.random(n) < 0.1] = np.nan
        y[:2] = [0.0, 0.0] if lab == "Hernia" else [0.0, 1.0]
        score = (np.nan_to_num(y) * 0.8 + rng.random(n)) / 1.8      # a probability, as the model's sigmoid
        pred[lab] = y
        pred[f"{lab}_score"] = score
        known = ~np.isnan(y)
        auroc = None if lab == "Hernia" else 0.70 + 0.01 * j
        entry = {"auroc": auroc, "n_pos": int((y[known] == 1).sum()), "n_neg": int((y[known] == 0).sum()),
                 "ci": None if auroc is None else [auroc - 0.05, auroc + 0.05]}
        # no validation predictions here: the evaluation's fallback, the threshold chosen on test
        entry.update(record.choose_operating_point(np.zeros(0), np.zeros(0), y[known], score[known]))
        label_entries[lab] = entry
    defined = [e["auroc"] for e in label_entries.values() if e["auroc"] is not None]
    metrics = {"labels": label_entries, "mean_auroc": float(np.mean(defined)), "n_images": n, "n_patients": n_patients,
               "published_comparable": True,    # NIH's 14 findings: evaluation says CheXNet's numbers apply
               "bootstrap": {"n_resamples": 1000, "seed": 0, "mean_auroc_ci": [0.70, 0.80]}}
    d = tmp_path / "in"
    d.mkdir()
    (d / "metrics.json").write_text(json.dumps(metrics))
    pd.DataFrame(pred).to_csv(d / "predictions.csv", index=False)
    (d / "pretrain.jsonl").write_text("\n".join(json.dumps(e) for e in _epochs(3, "accuracy", 2)) + "\n")
    (d / "finetune.jsonl").write_text("\n".join(json.dumps(e) for e in _epochs(4, "mean_auroc", 2)) + "\n")
    (d / "nih_manifest.json").write_text(json.dumps(
        _manifest("nih_demo", LABELS, synthetic=True, task="multilabel", title="NIH ChestX-ray14 demo <phantoms>")))
    (d / "fmnist_manifest.json").write_text(json.dumps(
        _manifest("fashion_mnist", ["T-shirt/top", "Trouser", "Pullover"], synthetic=False, task="multiclass",
                  title="Fashion-MNIST")))
    bench = d / "finetune.benchmark.tsv"
    bench.write_text("s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
                     "125.3\t0:02:05\t2048.5\t4096.0\t1900.1\t1950.2\t10.0\t5.0\t95.0\t230.1\n")
    bench2 = d / "shard.benchmark.tsv"
    bench2.write_text("s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
                      "10.0\t0:00:10\t-\t-\t-\t-\t-\t-\t-\t-\n")
    return {
        "metrics_json": d / "metrics.json",
        "predictions_csv": d / "predictions.csv",
        "pretrain_metrics": d / "pretrain.jsonl",
        "finetune_metrics": d / "finetune.jsonl",
        "manifests": {"fashion_mnist": d / "fmnist_manifest.json", "nih_demo": d / "nih_manifest.json"},
        "config": {"seed": 0, "finetune": {"epochs": 4, "lr": 1e-3}, "out": Path("/tmp/x")},
        "provenance": {"git_commit": "0123456789abcdef0123456789abcdef01234567", "host": "testhost",
                       "date_utc": "2025-01-01T00:00:00+00:00",
                       "packages": {"python": "3.11.0", "torch": "2.x", "horovod": "not installed"}},
        "stage_benchmarks": {"shard": bench2, "finetune": bench},
    }


def report_inputs(inputs: dict) -> dict:
    """The report's inputs as one structure (what the rule passes as --inputs-json) from the fixture's
    files; a file set to None is left out."""
    tree = {"evaluation": {"metrics": inputs["metrics_json"], "predictions": inputs.get("predictions_csv")},
            "training": {"pretrain": inputs["pretrain_metrics"], "finetune": inputs["finetune_metrics"]},
            "manifests": dict(zip(("pretrain", "finetune"), (inputs["manifests"] or {}).values())),
            "benchmarks": inputs.get("stage_benchmarks") or {}}
    for section, files in inputs.get("studies", {}).items():
        tree[section] = files
    return {section: {k: (str(v) if isinstance(v, Path) else v) for k, v in files.items() if v is not None}
            for section, files in tree.items()}


def _render(out: Path, inputs: dict, **kw) -> None:
    render.render_report(out, inputs=report_inputs(inputs), config=inputs["config"], provenance=inputs["provenance"], **kw)


@pytest.fixture()
def inputs(tmp_path: Path) -> dict:
    return _make_inputs(tmp_path)


@pytest.fixture(scope="module")
def report_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report rendered once from the full fixture inputs (rendering takes a few seconds)."""
    base = tmp_path_factory.mktemp("report")
    out = base / "out" / "report.html"
    _render(out, _make_inputs(base))
    assert out.is_file()
    return out


@pytest.fixture()
def report(report_path: Path) -> str:
    return report_path.read_text(encoding="utf-8")


class _TableParser(HTMLParser):
    """Rows (lists of cell texts) of tbody/tfoot of the table with a given id."""

    def __init__(self, table_id: str):
        super().__init__()
        self.table_id, self.depth = table_id, 0
        self.section: str | None = None
        self.rows: dict[str, list[list[str]]] = {"thead": [], "tbody": [], "tfoot": []}
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            if self.depth or dict(attrs).get("id") == self.table_id:
                self.depth += 1
        elif self.depth:
            if tag in self.rows:
                self.section = tag
            elif tag == "tr" and self.section:
                self.rows[self.section].append([])
            elif tag in ("td", "th"):
                self.cell = []

    def handle_endtag(self, tag):
        if tag == "table" and self.depth:
            self.depth -= 1
        elif self.depth and tag in ("td", "th") and self.cell is not None:
            self.rows[self.section][-1].append(" ".join("".join(self.cell).split()))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def _table(html: str, table_id: str) -> dict[str, list[list[str]]]:
    p = _TableParser(table_id)
    p.feed(html)
    return p.rows


# --------------------------------------------------------------------------- tests
def test_report_has_banner_and_auroc_table(report: str):
    assert render.SYNTHETIC_BANNER in report
    assert 'id="synthetic-banner"' in report
    assert report.index("synthetic-banner") < report.index('id="summary"')  # prominent: at the top
    rows = _table(report, "auroc-table")
    assert len(rows["tbody"]) == 14
    header = rows["thead"][0]
    assert {"CheXNet", "Wang et al. 2017", "This run"} <= set(header)
    chexnet_col, wang_col = header.index("CheXNet"), header.index("Wang et al. 2017")
    by_label = {r[0]: r for r in rows["tbody"]}
    assert by_label["Cardiomegaly"][chexnet_col] == "0.9248"
    assert by_label["Pleural Thickening"][chexnet_col] == "0.8062"
    assert by_label["Hernia"][wang_col] == "0.8717"
    assert by_label["Hernia"][1] == "n/a"
    assert by_label["Atelectasis"][1] == "0.7000"
    assert by_label["Atelectasis"][2] == "0.650 – 0.750"
    # synthetic data: the published numbers for orientation only, no "difference to CheXNet" coloured green/red
    assert "This run − CheXNet" not in header and 'class="pos"' not in report and 'class="neg"' not in report
    assert "published, for orientation only" in report and "no difference is taken" in report
    assert len(rows["tfoot"]) == 1 and rows["tfoot"][0][0].startswith("Mean (13 labels)")
    chexnet_13 = np.mean([v for k, v in published.CHEXNET_AUROC.items() if k != "Hernia"])
    assert rows["tfoot"][0][chexnet_col] == f"{chexnet_13:.4f}"


def test_report_is_self_contained(report: str):
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", report, re.I)
    assert "<script" not in report.lower()
    assert "<link" not in report.lower()
    assert "@import" not in report and "url(" not in report
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]*)"', report)
    assert len(srcs) >= 4  # 2 training curves, bar chart, ROC grid
    assert all(s.startswith("data:image/png;base64,") for s in srcs)


def test_report_sections_content(report: str):
    for section in ("summary", "datasets", "training", "auroc", "roc", "published", "provenance"):
        assert f'id="{section}"' in report
    # dataset table and escaping of manifest text
    assert "NIH ChestX-ray14 demo &lt;phantoms&gt;" in report and "<phantoms>" not in report
    assert "Fashion-MNIST" in report and "T-shirt/top" in report
    # stage times from benchmarks
    stage = _table(report, "stage-times")
    assert [r[0] for r in stage["tbody"]] == ["shard", "finetune"]
    assert stage["tbody"][1][1] == "0:02:05" and stage["tbody"][0][3] == "n/a"
    assert stage["tfoot"][0][1] == "0:02:15"
    # provenance and config
    assert "0123456789abcdef0123456789abcdef01234567" in report
    assert "testhost" in report and "horovod" in report
    assert "finetune:" in report and "epochs: 4" in report
    # references
    assert "arXiv:1711.05225" in report and "0.847" in report and "0.836" in report
    ops = _table(report, "operating-points")
    assert len(ops["tbody"]) == 14
    assert "chosen on the test set" in report and "optimistic" in report


def test_validation_operating_points(tmp_path: Path, inputs: dict):
    """metrics.json with val-chosen operating points (the CIs as ``ci: [lo, hi]``, ``bootstrap.mean_auroc_ci``)."""
    m = json.loads(inputs["metrics_json"].read_text())
    for lab, e in m["labels"].items():
        if e["auroc"] is not None:
            e["threshold_val_youden"] = 0.5
            e["operating_point_split"] = "validation"
            e["test_operating_point"] = {"threshold": 0.5, "sensitivity": 0.8, "specificity": 0.6, "ppv": 0.4,
                                         "npv": 0.9, "f1": 0.5333, "tp": 8, "fp": 12, "tn": 18, "fn": 2}
            few = lab == "Atelectasis"          # its threshold rests on 12 positive images of 4 patients
            e.update(val_positives=12 if few else 30, val_positive_patients=4 if few else 20,
                     threshold_few_positives=few)
            if few:     # each rate's interval over its denominator's patients, or the small-count rule's words
                e["test_operating_point_intervals"] = {
                    "sensitivity": {"ci": None, "too_few": "too few: 3 patients (5 needed)"},
                    "specificity": {"ci": [0.41, 0.77], "too_few": None}, "ppv": {"ci": [0.2, 0.6], "too_few": None},
                    "npv": {"ci": [0.7, 0.98], "too_few": None}, "f1": {"ci": [0.31, 0.71], "too_few": None}}
    m["min_val_positives"] = 10
    inputs["metrics_json"].write_text(json.dumps(m))
    out = tmp_path / "r.html"
    _render(out, {**inputs, "predictions_csv": None})
    html = out.read_text()
    rows = _table(html, "auroc-table")
    assert rows["tbody"][0][2] == "0.650 – 0.750"
    assert rows["tfoot"][0][2] == "0.700 – 0.800"
    ops = _table(html, "operating-points")["tbody"]
    assert ops[0] == ["Atelectasis", "0.500", "0.800too few: 3 patients (5 needed)", "0.6000.410-0.770",
                      "0.4000.200-0.600", "0.9000.700-0.980", "0.5330.310-0.710", "12 / 4", "few positives"]
    assert ops[1][-2:] == ["30 / 20", ""] and ops[1][2] == "0.800n/a"      # a record without intervals: none made up
    assert "fewer than 10 positive images or patients there (evaluate.min_val_positives): 1 of 14 are" in " ".join(html.split())
    assert ops[-1][0] == "Hernia" and ops[-1][1].startswith("n/a")
    assert "chosen on the validation set" in html and "optimistic" not in html


def test_no_banner_for_real_data(tmp_path: Path, inputs: dict):
    manifest = json.loads(inputs["manifests"]["nih_demo"].read_text())
    manifest["synthetic"] = False
    inputs["manifests"]["nih_demo"].write_text(json.dumps(manifest))
    out = tmp_path / "real.html"
    _render(out, {**inputs, "predictions_csv": None, "stage_benchmarks": None})
    html = out.read_text()
    assert "synthetic-banner" not in html and "SYNTHETIC demo data" not in html
    # no predictions: no ROC curves, the operating points evaluation recorded all the same
    assert "ROC curves per label" not in html and len(_table(html, "operating-points")["tbody"]) == 14
    rows = _table(html, "auroc-table")
    assert len(rows["tbody"]) == 14
    diff = rows["thead"][0].index("This run − CheXNet")      # real data: the difference, with its sign
    assert {r[0]: r[diff] for r in rows["tbody"]}["Atelectasis"] == f"{0.70 - 0.8094:+.4f}"


def test_atomic_write_leaves_no_temp_files(tmp_path: Path, inputs: dict):
    out = tmp_path / "o" / "report.html"
    out.parent.mkdir()
    out.write_text("old")
    _render(out, {**inputs, "predictions_csv": None})
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.html"]
    assert out.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("key", ["metrics_json", "pretrain_metrics", "finetune_metrics", "predictions_csv"])
def test_missing_input_names_the_file(tmp_path: Path, inputs: dict, key: str):
    inputs[key].unlink()
    with pytest.raises(render.ReportInputError, match=re.escape(str(inputs[key]))):
        _render(tmp_path / "r.html", inputs)
    assert not (tmp_path / "r.html").exists()


def test_malformed_inputs_are_reported(tmp_path: Path, inputs: dict):
    inputs["finetune_metrics"].write_text('{"epoch": 0, "train_loss": 1.0, "val_metric": 0.5}\nnot json\n')
    with pytest.raises(render.ReportInputError, match=r"finetune\.jsonl:2"):
        _render(tmp_path / "r.html", inputs)
    inputs["finetune_metrics"].write_text('{"epoch": 0}\n')
    with pytest.raises(render.ReportInputError, match=r"missing key\(s\)"):
        _render(tmp_path / "r.html", inputs)
    inputs["finetune_metrics"].write_text("")
    with pytest.raises(render.ReportInputError, match="no epochs"):
        _render(tmp_path / "r.html", inputs)


def test_malformed_metrics_and_manifest(tmp_path: Path, inputs: dict):
    good = inputs["metrics_json"].read_text()
    inputs["metrics_json"].write_text(json.dumps({"labels": {}}))
    with pytest.raises(render.ReportInputError, match="missing key 'mean_auroc'"):
        _render(tmp_path / "r.html", inputs)
    inputs["metrics_json"].write_text(good)
    inputs["manifests"]["nih_demo"].write_text("{broken")
    with pytest.raises(render.ReportInputError, match="nih_manifest.json is not valid JSON"):
        _render(tmp_path / "r.html", inputs)
    inputs["manifests"]["nih_demo"].write_text("{}")
    with pytest.raises(render.ReportInputError, match="missing key 'splits'"):
        _render(tmp_path / "r.html", inputs)


def test_predictions_missing_column(tmp_path: Path, inputs: dict):
    df = pd.read_csv(inputs["predictions_csv"]).drop(columns=["Edema_score"])
    df.to_csv(inputs["predictions_csv"], index=False)
    with pytest.raises(render.ReportInputError, match="Edema_score"):
        _render(tmp_path / "r.html", inputs)


def test_collect_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    prov = render.collect_provenance(tmp_path)  # not a git repo
    assert prov["git_commit"] == "unknown"
    assert prov["slurm_job_id"] == "4242"
    assert prov["host"] and prov["date_utc"].endswith("+00:00")
    for pkg in ("python", "torch", "torchvision", "horovod", "snakemake", "scikit-learn"):
        assert pkg in prov["packages"]
    assert render.collect_provenance(None)["git_commit"] == "unknown"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert "slurm_job_id" not in render.collect_provenance(None)
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "m"], check=True)
    prov = render.collect_provenance(repo)
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"]) and prov["git_dirty"] is False


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path: Path, report_path: Path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    from PIL import Image

    html_path = report_path
    png = tmp_path / "shot.png"
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}"]
    url = html_path.as_uri()
    subprocess.run([*base, f"--screenshot={png}", "--window-size=1280,2000", url],
                   check=True, capture_output=True, timeout=180)
    with Image.open(png) as im:
        rgb = im.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20
    assert any(c != (255, 255, 255) for _, c in colors)
    dom = subprocess.run([*base, "--dump-dom", url], check=True, capture_output=True, text=True,
                         timeout=180).stdout
    assert 'id="auroc-table"' in dom
    assert len(_table(dom, "auroc-table")["tbody"]) == 14
    assert "SYNTHETIC demo data" in dom


def test_subtitle_and_pilot_banner_describe_the_run(inputs, tmp_path):
    """The subtitle names what ran (architectures, datasets, backends, ranks); a pilot on part of
    the release gets a banner and its coverage is stated."""
    nih_manifest = _manifest("nih", LABELS, synthetic=False, task="multilabel", title="NIH ChestX-ray14")
    nih_manifest["split_source"] = "official NIH split lists: test = test_list.txt"
    nih_manifest["coverage"] = {"pilot": True, "archives": [1, 2], "parts": ["images_001", "images_002"],
                                "n_release_parts": 12, "n_listed": 112120, "n_found": 19999, "n_missing": 92121,
                                "missing_examples": [], "per_split": {}}
    path = tmp_path / "nih_manifest.json"
    path.write_text(json.dumps(nih_manifest))
    config = {"study": {"pretrain_dataset": "fashion_mnist", "finetune_dataset": "nih"},
              "pretrain": {"backend": "horovod", "model": {"arch": "resnet50"}},
              "finetune": {"backend": "ddp", "model": {"arch": "densenet121"}}}
    out = tmp_path / "pilot.html"
    _render(out, {**inputs, "manifests": {"fashion_mnist": inputs["manifests"]["fashion_mnist"],
                                                        "nih": path}, "config": config})
    html = out.read_text()
    subtitle = re.search(r'<p class="subtitle" id="run-subtitle">(.*?) &middot;', html).group(1)
    assert subtitle == ("resnet50 pretraining on Fashion-MNIST (horovod, 2 ranks) and densenet121 fine-tuning "
                        "on NIH ChestX-ray14 (ddp, 2 ranks)")
    assert "DenseNet-121 pretraining (Horovod)" not in html
    banner = re.search(r'<div class="banner" id="pilot-banner" role="alert">\s*(.*?)\s*<small>', html, re.S).group(1)
    assert banner == ("PILOT on 2 of 12 archives of NIH ChestX-ray14: 19,999 of the 112,120 images named in the split "
                      "lists were used. These numbers are NOT comparable with CheXNet or the other published results.")
    assert "PILOT on 2 of 12 archives (images_001, images_002): 19,999 of 112,120 listed images" in html
    assert "official NIH split lists: test = test_list.txt" in html
    # the full release: no banner, the coverage stated
    nih_manifest["coverage"].update(pilot=False, archives=None, n_found=112120, n_missing=0,
                                    parts=[f"images_{i:03d}" for i in range(1, 13)])
    path.write_text(json.dumps(nih_manifest))
    _render(out, {**inputs, "manifests": {"fashion_mnist": inputs["manifests"]["fashion_mnist"],
                                                        "nih": path}, "config": config})
    html = out.read_text()
    assert 'id="pilot-banner"' not in html and "all 12 archives: 112,120 of 112,120 listed images" in html


def test_figure_titles_show_the_recorded_metrics_not_a_recomputation(inputs, monkeypatch):
    """The ROC and PR grids draw curves from predictions.csv, but the AUROC and AUPRC in their titles
    are the evaluation's recorded values (a finding without one says n/a, never a number of its own)."""
    from chexflow.report import inputs as report_inputs_mod
    from chexflow.report import plots, results_view
    drawn = {}
    monkeypatch.setattr(plots, "roc_grid", lambda curves: drawn.setdefault("roc", curves) and "roc.png")
    monkeypatch.setattr(plots, "pr_grid", lambda curves: drawn.setdefault("pr", curves) and "pr.png")
    metrics = report_inputs_mod.load_metrics_json(inputs["metrics_json"])
    labels = list(metrics["labels"])
    df = report_inputs_mod.load_predictions(inputs["predictions_csv"], labels)
    first = next(lab for lab in labels if metrics["labels"][lab]["auroc"] is not None)
    metrics["labels"][first]["auroc"] = 0.123          # not what the predictions give
    metrics["raw_labels"][first]["auprc"] = 0.456
    assert results_view.roc_view(df, labels, metrics)["plot"] == "roc.png"
    assert results_view.calibration_view(metrics, df, labels)["pr_plot"] == "pr.png"
    assert drawn["roc"][first][2] == 0.123 and drawn["pr"][first][2] == 0.456
    metrics["labels"][first]["auroc"] = None
    drawn.clear()
    results_view.roc_view(df, labels, metrics)
    assert drawn["roc"][first][2] is None and plots._three(None) == "n/a" and plots._three(0.12345) == "0.123"


@pytest.mark.parametrize("key", ["metrics_json", "finetune_metrics", "predictions_csv", "benchmark", "manifest"])
def test_a_fifo_or_folder_in_place_of_an_input_is_named_for_what_it_is(tmp_path: Path, inputs: dict, key: str):
    """Every input is opened as a regular file only: a FIFO never blocks the report and, like a
    folder, is named for what it is (not "not found"); nothing is written."""
    import os
    path = {"benchmark": lambda: inputs["stage_benchmarks"]["finetune"],
            "manifest": lambda: next(iter(inputs["manifests"].values()))}.get(key, lambda: inputs[key])()
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(OSError, match=rf"{re.escape(str(path))}: a FIFO \(named pipe\), not a regular file; not read"):
        _render(tmp_path / "r.html", inputs)
    path.unlink()
    path.mkdir()
    with pytest.raises(OSError, match="directory, not a regular file; not read"):
        _render(tmp_path / "r.html", inputs)
    assert not (tmp_path / "r.html").exists()
