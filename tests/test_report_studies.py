"""The report's study sections (scaling, sweep, ablation), from the studies' own output writers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from chexflow.report import render
from chexflow.studies import scaling, sweep
from test_report import _make_inputs, _table


def _study_inputs(tmp_path: Path, inputs: dict) -> dict:
    d = tmp_path / "studies"
    d.mkdir()
    points = []
    for w, ips in ((1, 100.0), (2, 190.0), (4, 340.0)):
        p = d / f"world{w}.json"
        p.write_text(json.dumps({"world_size": w, "images_per_sec": ips, "images_per_sec_per_rank": ips / w,
                                 "per_rank": [ips / w] * w, "measured_epoch_s": 5.0, "time_per_epoch_s": 6000 / ips,
                                 "epoch_images": 6000, "steps_per_rank": 10, "batch_per_rank": 8,
                                 "global_batch": 8 * w}))
        points.append(p)
    scaling.write_summary(points, out_csv=d / "scaling.csv", out_json=d / "scaling.json", out_png=d / "scaling.png")
    model = d / "t001_model.pt"
    model.write_bytes(b"weights of trial t001")
    results = []
    for trial, status, val, reason in (("t000", "ok", 0.61, None), ("t001", "ok", 0.66, None),
                                       ("t002", "failed", None, "diverged: non-finite training loss at step 3")):
        r = d / f"{trial}.json"
        r.write_text(json.dumps({"trial": trial, "params": {"optim.lr": {"t000": 1e-3, "t001": 3e-3, "t002": 10.0}[trial]},
                                 "status": status, "val_metric": val, "val_metric_name": "mean_auroc",
                                 "reason": reason, "model": str(model) if trial == "t001" else None}))
        results.append(r)
    sweep.write_selection(results, out_csv=d / "trials.csv", out_json=d / "selection.json", out_model=d / "winner.pt")
    assert (d / "winner.pt").read_bytes() == b"weights of trial t001"
    ablation = json.loads(inputs["metrics_json"].read_text())
    for e in ablation["labels"].values():
        if e["auroc"] is not None:
            e["auroc"] -= 0.1
    ablation["mean_auroc"] -= 0.1
    ablation["mean_auroc_ci"] = [0.6, 0.7]
    (d / "ablation.json").write_text(json.dumps(ablation))
    return {"scaling_csv": d / "scaling.csv", "scaling_plot": d / "scaling.png", "sweep_table": d / "trials.csv",
            "sweep_selection": d / "selection.json", "sweep_metrics": inputs["metrics_json"],
            "ablation_metrics": d / "ablation.json"}


def test_study_sections(tmp_path):
    inputs = _make_inputs(tmp_path)
    inputs["config"] = {"finetune": {"init": "pretrained"}}
    out = tmp_path / "r.html"
    render.render_report(out, **inputs, **_study_inputs(tmp_path, inputs))
    html = out.read_text()
    for section in ("scaling", "sweep", "ablation"):
        assert f'id="{section}"' in html and f'href="#{section}"' in html
    rows = _table(html, "scaling-table")["tbody"]
    assert [r[0] for r in rows] == ["1", "2", "4"]
    assert [r[3] for r in rows] == ["1.00", "1.90", "3.40"] and [r[4] for r in rows] == ["100.0%", "95.0%", "85.0%"]
    assert rows[0][5] == "60.0"                                   # 6000 images at 100 images/s
    assert html.count('src="data:image/png;base64,') >= 5        # + the scaling plot
    sweep_rows = _table(html, "sweep-table")["tbody"]
    assert [(r[0], r[2], r[-1]) for r in sweep_rows] == [
        ("t000", "ok", ""), ("t001", "ok", "winner"), ("t002", "failed", "diverged: non-finite training loss at step 3")]
    assert "3 trials, 1 failed" in html and "the winner (t001)" in html
    abl = _table(html, "ablation-table")
    mean = json.loads(inputs["metrics_json"].read_text())["mean_auroc"]
    assert abl["tbody"][0][0] == "Fine-tuned from the pretraining model" and abl["tbody"][0][1] == f"{mean:.4f}"
    assert abl["tbody"][1][0] == "Fine-tuned from random init" and abl["tbody"][1][1] == f"{mean - 0.1:.4f}"
    assert abl["tbody"][1][2] == "0.600 – 0.700"
    assert abl["tfoot"][0][1] == "+0.1000"


def test_no_study_sections_without_inputs(tmp_path):
    inputs = _make_inputs(tmp_path)
    out = tmp_path / "r.html"
    render.render_report(out, **inputs)
    html = out.read_text()
    for section in ("scaling", "sweep", "ablation"):
        assert f'id="{section}"' not in html


def test_missing_study_input_is_named(tmp_path):
    inputs = _make_inputs(tmp_path)
    studies = _study_inputs(tmp_path, inputs)
    studies["scaling_plot"].unlink()
    with pytest.raises(render.ReportInputError, match="scaling plot not found"):
        render.render_report(tmp_path / "r.html", **inputs, **studies)
    with pytest.raises(render.ReportInputError, match="both"):
        render.render_report(tmp_path / "r.html", **inputs, sweep_table=studies["sweep_table"])
