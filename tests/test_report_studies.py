"""The report's study sections (scaling, sweep, ablation), from the studies' own output writers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chexflow.report import render
from chexflow.studies import ablation_compare, scaling, sweep
from chexflow.train import checkpoint as ckpt
from test_report import _make_inputs, _render, _table, noisy


def _with_studies(inputs: dict, studies: dict) -> dict:
    """The fixture's inputs with study sections (the report's one input structure); the ablation's
    runs are compared first, as rule compare_ablation does, with the config's main run and bootstrap."""
    tree = {"scaling": {"table": studies.get("scaling_csv"), "plot": studies.get("scaling_plot")},
            "sweep": {"table": studies.get("sweep_table"), "selection": studies.get("sweep_selection"),
                      "metrics": studies.get("sweep_metrics")}}
    if studies.get("ablation"):
        finetune, ev = inputs["config"].get("finetune") or {}, inputs["config"].get("evaluate") or {}
        comparison = inputs["metrics_json"].parent / "comparison.json"
        ablation_compare.write_comparison(studies["ablation"], comparison,
                                          main=f"{finetune.get('init', 'pretrained')}_seed{finetune.get('seed', 0)}",
                                          n_resamples=ev.get("bootstrap_resamples", 1000), seed=ev.get("seed", 0))
        tree["ablation"] = {"comparison": comparison}
    return {**inputs, "studies": {k: v for k, v in tree.items() if any(x is not None for x in v.values())}}


def _runs(inputs: dict, ablation_dir: Path, *, main_init: str = "pretrained") -> dict:
    """The ablation's two runs (seed 0): the main run and the other arm, their metrics naming init and seed."""
    other = "random" if main_init == "pretrained" else "pretrained"
    for path, init in ((inputs["metrics_json"], main_init), (ablation_dir / "metrics.json", other)):
        m = json.loads(path.read_text())
        m.update(model_init=init, model_seed=0, model_epoch=3 if init == "pretrained" else 4)
        path.write_text(json.dumps(m))
    return {f"{main_init}_seed0": {"metrics": inputs["metrics_json"], "predictions": inputs["predictions_csv"],
                                   "training": inputs["finetune_metrics"]},
            f"{other}_seed0": {"metrics": ablation_dir / "metrics.json", "predictions": ablation_dir / "predictions.csv",
                               "training": inputs["finetune_metrics"]}}


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
    model = d / "t001_model.pt"      # the selection copies only a checked model file of the winner's run
    ckpt.save_atomic(ckpt.model_record(
        state_dict={"w": torch.zeros(1)}, run_id="t001run", stage="finetune", dataset="nih_demo", task="multilabel",
        labels=["Mass"], arch="resnet18", in_channels=1, crop=32, epoch=1, val_metric=0.66,
        val_metric_name="mean_auroc", config={}), model)
    results = []
    for trial, status, val, reason in (("t000", "ok", 0.61, None), ("t001", "ok", 0.66, None),
                                       ("t002", "failed", None, "diverged: non-finite training loss at step 3")):
        r = d / f"{trial}.json"
        r.write_text(json.dumps({"trial": trial, "params": {"optim.lr": {"t000": 1e-3, "t001": 3e-3, "t002": 10.0}[trial]},
                                 "status": status, "val_metric": val, "val_metric_name": "mean_auroc",
                                 "reason": reason, "model": str(model) if trial == "t001" else None,
                                 "run_id": f"{trial}run"}))
        results.append(r)
    sweep.write_selection(results, out_csv=d / "trials.csv", out_json=d / "selection.json", out_model=d / "winner.pt")
    assert (d / "winner.pt").read_bytes() == model.read_bytes()
    return {"scaling_csv": d / "scaling.csv", "scaling_plot": d / "scaling.png", "sweep_table": d / "trials.csv",
            "sweep_selection": d / "selection.json", "sweep_metrics": inputs["metrics_json"]}


def test_study_sections(tmp_path):
    inputs = _make_inputs(tmp_path)
    inputs["config"] = {"finetune": {"init": "pretrained"}}
    out = tmp_path / "r.html"
    _render(out, _with_studies(inputs, _study_inputs(tmp_path, inputs)))
    html = out.read_text()
    for section in ("scaling", "sweep"):
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


def test_no_study_sections_without_inputs(tmp_path):
    inputs = _make_inputs(tmp_path)
    out = tmp_path / "r.html"
    _render(out, inputs)
    html = out.read_text()
    for section in ("scaling", "sweep", "ablation"):
        assert f'id="{section}"' not in html


def test_missing_study_input_is_named(tmp_path):
    inputs = _make_inputs(tmp_path)
    studies = _study_inputs(tmp_path, inputs)
    studies["scaling_plot"].unlink()
    with pytest.raises(render.ReportInputError, match="scaling plot not found"):
        _render(tmp_path / "r.html", _with_studies(inputs, studies))
    with pytest.raises(render.ReportInputError, match="both"):
        _render(tmp_path / "r.html", _with_studies(inputs, {"sweep_table": studies["sweep_table"]}))


def test_input_structure_is_checked_by_name(tmp_path):
    inputs = _make_inputs(tmp_path)
    from test_report import report_inputs
    tree = report_inputs(inputs)
    for bad, message in (({**tree, "extras": {}}, "unknown section 'extras'"),
                         ({**tree, "evaluation": {**tree["evaluation"], "heatmap": "x"}}, r"unknown evaluation input\(s\) \['heatmap'\]"),
                         ({k: v for k, v in tree.items() if k != "training"}, "training.pretrain is required"),
                         ({**tree, "ablation": {"r": {"metrics": "m"}}}, r"unknown ablation input\(s\) \['r'\]"),
                         ({**tree, "ablation": {"comparison": {"r": "m"}}}, "ablation.comparison must be a path")):
        with pytest.raises(render.ReportInputError, match=message):
            render.render_report(tmp_path / "r.html", inputs=bad, config={}, provenance={})


def test_scaling_plot_has_integer_rank_ticks_and_report_names_shared_cores(tmp_path):
    points = []
    for w, ips in ((1, 100.0), (2, 101.0), (3, 99.0)):
        p = tmp_path / f"world{w}.json"
        p.write_text(json.dumps({"world_size": w, "images_per_sec": ips, "images_per_sec_per_rank": ips / w,
                                 "per_rank": [ips / w] * w, "measured_epoch_s": 5.0, "time_per_epoch_s": 60.0,
                                 "epoch_images": 6000, "steps_per_rank": 10, "batch_per_rank": 8, "global_batch": 8 * w,
                                 "nodes": 1, "ranks_per_node": w, "cores_per_node": 2, "threads_per_rank": max(1, 2 // w)}))
        points.append(p)
    df = scaling.summarize([json.loads(p.read_text()) for p in points])
    ticks = scaling.figure(df).axes[0].get_xticks()
    assert list(ticks) == [1.0, 2.0, 3.0]                         # no 1.2, 1.4, ... between ranks
    d = tmp_path / "s"
    d.mkdir()
    scaling.write_summary(points, out_csv=d / "scaling.csv", out_json=d / "scaling.json", out_png=d / "scaling.png")
    inputs = _make_inputs(tmp_path)
    out = tmp_path / "r.html"
    _render(out, _with_studies(inputs, {"scaling_csv": d / "scaling.csv", "scaling_plot": d / "scaling.png"}))
    html = " ".join(out.read_text().split())
    assert "up to 3 ranks shared its 2 CPU core(s)" in html
    assert "(threads per rank: 1 rank(s) &times; 2, 2 rank(s) &times; 1, 3 rank(s) &times; 1)" in html


def test_ablation_gain_with_paired_ci_in_summary(tmp_path):
    """The summary states pretrained - random with the paired patient-bootstrap CI of real predictions,
    the tested epochs of both arms, the one-seed caveat and the per-finding differences with CIs."""
    import numpy as np
    import pandas as pd

    from chexflow.evaluate import metrics as M
    inputs = _make_inputs(tmp_path)
    main = pd.read_csv(inputs["predictions_csv"], dtype={"image": str, "patient": str})
    labels = list(json.loads(inputs["metrics_json"].read_text())["labels"])
    rng = np.random.default_rng(7)
    other = main.copy()
    for lab in labels:          # the random-init run: the same images, noisier scores
        other[f"{lab}_score"] = noisy(main[f"{lab}_score"], rng, 0.6)
    other = other.iloc[::-1]    # row order must not matter (matched by image)
    abl_dir = tmp_path / "abl"
    abl_dir.mkdir()
    other.to_csv(abl_dir / "predictions.csv", index=False)
    per = M.auroc_per_label(other[labels].to_numpy(float), other[[f"{l}_score" for l in labels]].to_numpy(float), labels)
    abl_metrics = json.loads(inputs["metrics_json"].read_text())
    abl_metrics["mean_auroc"] = M.mean_auroc(per)
    (abl_dir / "metrics.json").write_text(json.dumps(abl_metrics))
    inputs["config"] = {"finetune": {"init": "pretrained"}, "evaluate": {"bootstrap_resamples": 400, "seed": 0}}
    out = tmp_path / "r.html"
    _render(out, _with_studies(inputs, {"ablation": _runs(inputs, abl_dir)}))
    html = " ".join(out.read_text().split())
    y = main[labels].to_numpy(float)
    other = other.set_index("image").loc[main["image"]]
    want = M.paired_bootstrap_auroc_diff(y, main[[f"{l}_score" for l in labels]].to_numpy(float),
                                         other[[f"{l}_score" for l in labels]].to_numpy(float),
                                         main["patient"].to_numpy(), labels, n_resamples=400, seed=0)
    lo, hi = want["ci"]
    assert want["diff"] > 0 and lo > 0       # the fixture's noise makes the gain clear
    card = f'<div class="v">{want["diff"]:+.3f}</div> <div class="k">95% CI {lo:+.3f} &ndash; {hi:+.3f} (paired, patients resampled)</div>'
    assert card in html
    assert (f"Pretraining helps on this data: fine-tuning from the pretraining model reaches test mean AUROC "
            f"{want['mean_a']:.3f}, from random init with the same budget {want['mean_b']:.3f}; the gain "
            f"{want['diff']:+.3f} has a 95% CI of {lo:+.3f} to {hi:+.3f}") in html
    assert "This verdict rests on one training seed per arm (tested epochs: pretrained 3, random init 4)" in html
    abl = _table(out.read_text(), "ablation-table")
    assert [r[:2] + r[4:5] for r in abl["tbody"]] == [["Fine-tuned from the pretraining model", "0", "3 of 4"],
                                                      ["Fine-tuned from random init", "0", "4 of 4"]]
    assert abl["tfoot"][0][3] == f"{lo:+.3f} – {hi:+.3f} (paired)"
    per_label = {r[0]: r for r in _table(out.read_text(), "ablation-labels")["tbody"]}
    for lab in want["labels_used"]:          # each finding's difference with its own paired CI
        e = want["labels"][lab]
        assert per_label[lab.replace("_", " ")][3:] == [f"{e['diff']:+.3f}", f"{e['ci'][0]:+.3f} – {e['ci'][1]:+.3f}"]
    assert "Ablation: fine-tuning from random init (seed 0)" in html      # the other arm's training curves
    # the other way round (random init better): said plainly, not implied as a gain
    inputs["config"] = {**inputs["config"], "finetune": {"init": "random"}}
    _render(out, _with_studies(inputs, {"ablation": _runs(inputs, abl_dir, main_init="random")}))
    html = " ".join(out.read_text().split())
    assert "Pretraining HURTS on this data" in html and f"{-want['diff']:+.3f}" in html
    # predictions of other images than the main run's are refused by name
    other.reset_index().iloc[:-3].to_csv(abl_dir / "predictions.csv", index=False)
    with pytest.raises(ablation_compare.ComparisonInputError, match="other test images"):
        _render(out, _with_studies(inputs, {"ablation": _runs(inputs, abl_dir)}))


def test_ablation_verdict_over_seeds(tmp_path):
    """Three seeds per arm: the gain averaged over seeds with its patient CI and the t-interval over
    seeds, computed independently (scikit-learn AUROCs, scipy's t)."""
    import numpy as np
    import pandas as pd
    from scipy import stats

    inputs = _make_inputs(tmp_path)
    main = pd.read_csv(inputs["predictions_csv"], dtype={"image": str, "patient": str})
    labels = [lab for lab in json.loads(inputs["metrics_json"].read_text())["labels"] if lab != "Hernia"]
    rng = np.random.default_rng(3)
    runs, gains = {}, []
    for seed in (0, 1, 2):
        arms = {}
        for init, noise in (("pretrained", 0.2), ("random", 0.8)):
            runs[f"{init}_seed{seed}"], arms[init] = _noisy_arm(tmp_path, inputs, main, labels, rng, init, seed, noise)
        gains.append(arms["pretrained"] - arms["random"])
    inputs["config"] = {"finetune": {"init": "pretrained", "seed": 0}, "evaluate": {"bootstrap_resamples": 200, "seed": 0}}
    out = tmp_path / "r.html"
    _render(out, _with_studies(inputs, {"ablation": runs}))
    html = " ".join(out.read_text().split())
    mean = float(np.mean(gains))
    half = stats.t.ppf(0.975, 2) * np.std(gains, ddof=1) / np.sqrt(3)
    assert f"the gain averaged over seeds is {mean:+.3f} (per seed: {gains[0]:+.3f}, {gains[1]:+.3f}, {gains[2]:+.3f})" in html
    assert f"over training seeds {mean - half:+.3f} to {mean + half:+.3f} (t-interval of the 3 per-seed gains)" in html
    assert "one training seed per arm" not in html
    assert len(_table(out.read_text(), "ablation-table")["tbody"]) == 6


def test_ablation_third_arm_published_weights(tmp_path):
    """init_file set: a third arm (published weights) with the same budget; the report shows published
    weights vs random and own pretraining vs published weights, per seed and over seeds, each a paired
    difference of the test mean AUROC checked against scikit-learn, with a verdict."""
    import numpy as np
    import pandas as pd

    inputs = _make_inputs(tmp_path)
    main = pd.read_csv(inputs["predictions_csv"], dtype={"image": str, "patient": str})
    labels = json.loads(inputs["metrics_json"].read_text())["labels"]
    rng = np.random.default_rng(5)
    runs, mean_auroc = {}, {}
    for seed in (0, 1):
        for init, noise in (("pretrained", 0.1), ("file", 0.4), ("random", 3.0)):
            runs[f"{init}_seed{seed}"], mean_auroc[init, seed] = _noisy_arm(tmp_path, inputs, main, labels, rng, init,
                                                                            seed, noise)
    inputs["config"] = {"finetune": {"init": "pretrained", "seed": 0, "init_file": "w.pth"},
                        "evaluate": {"bootstrap_resamples": 200, "seed": 0}}
    out = tmp_path / "r.html"
    _render(out, _with_studies(inputs, {"ablation": runs}))
    html = out.read_text()
    rows = {r[0]: r for r in _table(html, "ablation-table")["tfoot"]}
    assert len(_table(html, "ablation-table")["tbody"]) == 6
    assert "Fine-tuned from published weights (init_file)" in html
    for seed in (0, 1):
        pub = rows[f"Published weights \u2212 random, seed {seed}"]
        assert pub[2] == f"{mean_auroc['file', seed] - mean_auroc['random', seed]:+.4f}"
        assert pub[-1] == "helps"           # noise 0.4 vs 3.0: far apart
        own = rows[f"Pretraining \u2212 published weights, seed {seed}"]
        assert own[2] == f"{mean_auroc['pretrained', seed] - mean_auroc['file', seed]:+.4f}"
    over = rows["Pretraining \u2212 published weights, mean over seeds"]
    gains = [mean_auroc["pretrained", s] - mean_auroc["file", s] for s in (0, 1)]
    assert over[2] == f"{np.mean(gains):+.4f}"
    assert "(seeds)" in over[3]


def _noisy_arm(tmp_path, inputs, main, labels, rng, init: str, seed: int, noise: float):
    """An ablation arm's files: the main run's predictions with Gaussian noise of ``noise`` on every
    score, its metrics.json marked with the arm; and its test mean AUROC by scikit-learn."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    d = tmp_path / f"{init}{seed}"
    d.mkdir()
    df = main.copy()
    for lab in labels:
        df[f"{lab}_score"] = noisy(main[f"{lab}_score"], rng, noise)
    df.to_csv(d / "predictions.csv", index=False)
    m = json.loads(inputs["metrics_json"].read_text())
    m.update(model_init=init, model_seed=seed, model_epoch=2)
    (d / "metrics.json").write_text(json.dumps(m))
    known = {lab: main[lab].notna() for lab in labels}
    mean = np.mean([roc_auc_score(main.loc[known[lab], lab], df.loc[known[lab], f"{lab}_score"])
                    for lab in labels if main.loc[known[lab], lab].nunique() == 2])
    return {"metrics": d / "metrics.json", "predictions": d / "predictions.csv",
            "training": inputs["finetune_metrics"]}, mean


def test_a_fifo_in_place_of_a_study_file_is_named_for_what_it_is(tmp_path):
    """The scaling plot (read as bytes) and the sweep table (CSV) are opened as regular files only: a
    FIFO is named for what it is and never blocks; a missing file is "not found"."""
    import os
    inputs = _make_inputs(tmp_path)
    studies = _study_inputs(tmp_path, inputs)
    for key in ("scaling_plot", "sweep_table"):
        kept = studies[key].read_bytes()
        studies[key].unlink()
        os.mkfifo(studies[key])
        with pytest.raises(OSError, match=rf"{studies[key].name}: a FIFO \(named pipe\), not a regular file"):
            _render(tmp_path / "r.html", _with_studies(inputs, studies))
        studies[key].unlink()
        with pytest.raises(render.ReportInputError, match=f"not found: {studies[key]}"):
            _render(tmp_path / "r.html", _with_studies(inputs, studies))
        studies[key].write_bytes(kept)
    _render(tmp_path / "r.html", _with_studies(inputs, studies))      # restored: rendered
    assert (tmp_path / "r.html").is_file()
