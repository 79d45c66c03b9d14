"""The ablation's comparison as its own stage (``chexflow compare-ablation``, rule compare_ablation):
its record ``comparison.json`` holds the paired bootstraps, computed here and not in the report, and
its reader refuses anything but that record, naming the file and the key."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from chexflow.evaluate import metrics as M
from chexflow.evaluate.comparison_record import FORMAT, ComparisonRecordError, read_comparison
from chexflow.studies import ablation_compare
from chexflow.studies.ablation_compare import ComparisonInputError
from conftest import cli_env
from test_report import _make_inputs, noisy

BOOT = {"n_resamples": 200, "seed": 3}


def _arms(tmp_path: Path, seeds=(0,), arms=(("pretrained", 0.2), ("random", 1.5))) -> tuple[dict, dict, list, dict]:
    """Real evaluation files per (arm, seed): the fixture's predictions with noise on every score;
    returns the runs, the inputs, the labels and each run's scores."""
    inputs = _make_inputs(tmp_path)
    main = pd.read_csv(inputs["predictions_csv"], dtype={"image": str, "patient": str})
    labels = list(json.loads(inputs["metrics_json"].read_text())["labels"])
    rng = np.random.default_rng(11)
    runs, scores = {}, {}
    for seed in seeds:
        for init, noise in arms:
            d = tmp_path / f"{init}{seed}"
            d.mkdir()
            df = main.copy()
            for lab in labels:
                df[f"{lab}_score"] = noisy(main[f"{lab}_score"], rng, noise)
            df.sample(frac=1.0, random_state=seed).to_csv(d / "predictions.csv", index=False)   # order must not matter
            m = json.loads(inputs["metrics_json"].read_text())
            m.update(model_init=init, model_seed=seed, model_epoch=seed + 1)
            (d / "metrics.json").write_text(json.dumps(m))
            runs[f"{init}_seed{seed}"] = {"metrics": str(d / "metrics.json"), "predictions": str(d / "predictions.csv"),
                                          "training": str(inputs["finetune_metrics"])}
            scores[init, seed] = df[[f"{lab}_score" for lab in labels]].to_numpy(float)
    return runs, {"y": main[labels].to_numpy(float), "groups": main["patient"].to_numpy()}, labels, scores


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chexflow", *args], capture_output=True, text=True, env=cli_env(),
                          timeout=300)


def test_the_stage_writes_the_paired_comparison_the_report_used_to_compute(tmp_path):
    """Through a real `chexflow compare-ablation` process: per seed and over seeds, the numbers of
    paired_bootstrap_auroc_diff / paired_bootstrap_over_seeds on the same images, read back through
    the record's reader; the main run and its other arm named; every run's files recorded."""
    runs, _, labels, _ = _arms(tmp_path, seeds=(0, 1))
    out = tmp_path / "results/ablation/comparison.json"
    proc = _cli("compare-ablation", "--config-json", json.dumps({"bootstrap_resamples": BOOT["n_resamples"],
                                                                 "seed": BOOT["seed"]}),
                "--runs-json", json.dumps(runs), "--main", "pretrained_seed0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rec = read_comparison(out)
    assert rec["format"] == FORMAT and rec["bootstrap"] == BOOT and rec["labels"] == labels
    assert (rec["main_init"], rec["main_seed"], rec["other_init"], rec["seeds"]) == ("pretrained", 0, "random", [0, 1])
    # the truth, computed independently from the files in the first arm's row order
    ref = pd.read_csv(runs["pretrained_seed0"]["predictions"], dtype={"image": str, "patient": str})
    y, groups = ref[labels].to_numpy(float), ref["patient"].to_numpy()
    cols = [f"{lab}_score" for lab in labels]

    def aligned(name):
        df = pd.read_csv(runs[name]["predictions"], dtype={"image": str, "patient": str})
        return df.set_index("image").loc[ref["image"]][cols].to_numpy(float)

    pairs = [(aligned(f"pretrained_seed{s}"), aligned(f"random_seed{s}")) for s in (0, 1)]
    for d, (a, b), seed in zip(rec["per_seed"], pairs, (0, 1)):
        want = M.paired_bootstrap_auroc_diff(y, a, b, groups, labels, **BOOT)
        assert d["seed"] == seed and d["diff"] == pytest.approx(want["diff"], abs=1e-12)
        assert d["ci"] == pytest.approx(want["ci"], abs=1e-12) and d["labels_used"] == want["labels_used"]
        assert d["verdict"] == ("helps" if want["ci"][0] > 0 else "hurts" if want["ci"][1] < 0 else "inconclusive")
        assert d["epochs"] == {"pretrained": seed + 1, "random": seed + 1}
    over = M.paired_bootstrap_over_seeds(y, pairs, groups, labels, **BOOT)
    assert rec["over_seeds"]["diff"] == pytest.approx(over["diff"], abs=1e-12)
    assert rec["over_seeds"]["t_ci"] == pytest.approx(over["t_ci"], abs=1e-12)
    assert [(r["init"], r["seed"]) for r in rec["runs"]] == [("pretrained", 0), ("random", 0), ("pretrained", 1),
                                                               ("random", 1)]
    assert all(r["n_epochs"] >= 1 and r["metrics"] == runs[r["name"]]["metrics"] for r in rec["runs"])
    assert rec["published"] == []
    assert f"pretrained - random, seed 0: {rec['per_seed'][0]['diff']:+.4f}" in proc.stdout


def test_the_published_weights_arm_is_compared_with_both_others(tmp_path):
    runs, _, labels, _ = _arms(tmp_path, arms=(("pretrained", 0.1), ("random", 3.0), ("file", 0.4)))
    rec = ablation_compare.compare(runs, main="pretrained_seed0", **BOOT)
    assert [(c["a"], c["b"]) for c in rec["published"]] == [("file", "random"), ("pretrained", "file")]
    assert rec["published"][0]["per_seed"][0]["verdict"] == "helps"        # noise 0.4 vs 3.0
    assert rec["published"][0]["over_seeds"] is None                       # one seed
    del runs["random_seed0"]                                               # a file arm without a seed with both others
    with pytest.raises(ComparisonInputError, match="no seed with both arms"):
        ablation_compare.compare(runs, main="pretrained_seed0", **BOOT)


def test_runs_that_cannot_be_compared_are_refused_by_name_and_nothing_is_written(tmp_path):
    runs, _, _, _ = _arms(tmp_path)
    out = tmp_path / "comparison.json"

    def refused(bad: dict, match: str, main: str = "pretrained_seed0", error=ComparisonInputError) -> None:
        with pytest.raises(error, match=match):
            ablation_compare.write_comparison(bad, out, main=main, **BOOT)
        assert not out.exists()

    refused(runs, "do not include the main run 'random_seed1'", main="random_seed1")
    refused({**runs, "x": {"metrics": "m"}}, r"ablation run 'x' must name exactly \['metrics', 'predictions', 'training'\]")
    twin = {**runs, "again": dict(runs["random_seed0"])}
    refused(twin, "a second run of arm random with seed 0")
    pred = Path(runs["random_seed0"]["predictions"])
    df = pd.read_csv(pred, dtype={"image": str, "patient": str})
    df.iloc[:-2].to_csv(pred, index=False)
    refused(runs, f"{pred}: the ablation's predictions.csv holds other test images")
    from chexflow.evaluate.record import PredictionsRecordError
    dup = pd.concat([df.iloc[:-1], df.iloc[:1]])              # as many rows, one image twice, one missing
    dup.to_csv(pred, index=False)
    refused(runs, f"{pred}: 2 rows name an image another row names too \\(first: {df.at[0, 'image']!r}\\)",
            error=PredictionsRecordError)
    df.drop(columns=["Mass_score"]).to_csv(pred, index=False)
    refused(runs, r"missing column\(s\) \['Mass_score'\]", error=PredictionsRecordError)
    df.to_csv(pred, index=False)
    m = Path(runs["random_seed0"]["metrics"])
    good = m.read_text()
    m.write_text(json.dumps({**json.loads(good), "model_seed": "0"}))
    refused(runs, f"{m}: names no init/seed")
    m.write_text(json.dumps({**json.loads(good), "model_init": "pretrained"}))
    refused(runs, "a second run of arm pretrained with seed 0")
    m.write_text(good)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    from chexflow.train.epochs import EpochsRecordError
    refused({**runs, "random_seed0": {**runs["random_seed0"], "training": str(empty)}}, "no epochs recorded",
            error=EpochsRecordError)
    ablation_compare.write_comparison(runs, out, main="pretrained_seed0", **BOOT)   # restored: compared
    assert read_comparison(out)["seeds"] == [0]


def _record(tmp_path: Path) -> tuple[dict, Path]:
    runs, _, _, _ = _arms(tmp_path, seeds=(0, 1), arms=(("pretrained", 0.2), ("random", 1.5), ("file", 0.5)))
    out = tmp_path / "comparison.json"
    return ablation_compare.write_comparison(runs, out, main="pretrained_seed0", **BOOT), out


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(format="chexflow ablation comparison 0"), "format: expected 'chexflow ablation comparison 1'"),
    (lambda r: r.pop("per_seed"), r"top level: missing key\(s\) \['per_seed'\]"),
    (lambda r: r.update(main_init="imagenet"), "main_init: expected one of"),
    (lambda r: r.update(seeds=[]), "seeds: no seed with both arms"),
    (lambda r: r.update(seeds=[1, 0]), r"per_seed: expected one difference per seed of 'seeds' \[1, 0\]"),
    (lambda r: r["per_seed"][0].update(verdict="maybe"), r"per_seed\[0\].verdict: expected one of"),
    (lambda r: r["per_seed"][1].update(ci=[0.2, 0.1]), r"per_seed\[1\].ci: low 0.2 is above high 0.1"),
    (lambda r: r["per_seed"][0].update(diff=float("nan")), r"per_seed\[0\].diff: expected a finite number"),
    (lambda r: r["per_seed"][0]["labels"].pop(r["per_seed"][0]["labels_used"][0]), r"per_seed\[0\].labels: missing key"),
    (lambda r: r["runs"][2].update(n_epochs="4"), r"runs\[2\].n_epochs: expected an integer, got '4'"),
    (lambda r: r["runs"][0].update(seed=True), r"runs\[0\].seed: expected an integer"),
    (lambda r: r["over_seeds"].update(per_seed=[0.1]), r"over_seeds.per_seed: expected n_seeds \(2\) differences"),
    (lambda r: r["published"][1]["per_seed"][0].pop("mean_b"), r"published\[1\].per_seed\[0\]: missing key"),
    (lambda r: r["published"][0].update(over_seeds=[]), r"published\[0\].over_seeds: expected an object, got list"),
])
def test_a_record_that_is_not_the_writers_is_refused_by_key(tmp_path, edit, message):
    rec, path = _record(tmp_path)
    read_comparison(path)                    # the writer's record reads back
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ComparisonRecordError, match=rf"^{path}: {message}"):
        read_comparison(path)


def test_what_is_not_a_record_file_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "comparison.json"
    path.write_text('{"format": ')
    with pytest.raises(ComparisonRecordError, match="is not valid JSON"):
        read_comparison(path)
    path.write_text("[1, 2]")
    with pytest.raises(ComparisonRecordError, match="top level: expected an object, got list"):
        read_comparison(path)
    path.unlink()
    os.mkfifo(path)                          # a FIFO planted where the record should be: never blocks
    with pytest.raises(OSError, match="FIFO"):
        read_comparison(path)


def test_the_report_refuses_a_tampered_record_with_status_7(tmp_path):
    """Through `chexflow report`: a record edited by hand is one line naming the file and the key."""
    from test_report import report_inputs
    rec, path = _record(tmp_path)
    (tmp_path / "report").mkdir()
    inputs = _make_inputs(tmp_path / "report")
    tree = {**report_inputs(inputs), "ablation": {"comparison": str(path)}}
    rec["per_seed"][0]["verdict"] = "certainly"
    path.write_text(json.dumps(rec))
    proc = _cli("report", "--out", str(tmp_path / "r.html"), "--inputs-json", json.dumps(tree))
    assert proc.returncode == 7, proc.stderr
    assert f"{path}: per_seed[0].verdict: expected one of ['helps', 'hurts', 'inconclusive'], got 'certainly'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r.html").exists()


def test_a_run_whose_scores_are_logits_is_refused_with_status_7_and_nothing_is_written(tmp_path):
    """Through a real `chexflow compare-ablation` process: one arm's predictions.csv holding a logit where the
    evaluation writes a probability (its AUROC alone would not notice) is one line naming the file, the column
    and the first image; no comparison is written."""
    runs, _, labels, _ = _arms(tmp_path)
    path = Path(runs["random_seed0"]["predictions"])
    df = pd.read_csv(path, dtype={"image": str, "patient": str})
    df.loc[3, f"{labels[1]}_score"] = 1.7
    df.to_csv(path, index=False)
    out = tmp_path / "comparison.json"
    proc = _cli("compare-ablation", "--config-json", json.dumps({"bootstrap_resamples": BOOT["n_resamples"],
                                                                 "seed": BOOT["seed"]}),
                "--runs-json", json.dumps(runs), "--main", "pretrained_seed0", "--out", str(out))
    assert proc.returncode == 7, proc.stderr
    line = f"{path}: column '{labels[1]}_score': 1 row(s) outside what the evaluation writes (a score is a " \
           f"probability in [0, 1]); the first: image {df.at[3, 'image']!r}, 1.7"
    assert line in proc.stderr and "Traceback" not in proc.stderr and not out.exists(), proc.stderr


@pytest.mark.parametrize("role", ["metrics", "predictions", "training"])
def test_a_fifo_or_a_folder_in_place_of_a_runs_file_is_named_for_what_it_is(tmp_path, role):
    """Each of a run's files is read only if it is a regular file: a FIFO never blocks the stage, and
    neither it nor a folder is reported as missing; a missing file is."""
    runs, _, _, _ = _arms(tmp_path)
    target = Path(runs["random_seed0"][role])
    if role == "training":                       # the fixture's runs share one training log: give this run its own
        target = tmp_path / "random_training.jsonl"
        runs["random_seed0"]["training"] = str(target)
    else:
        target.unlink()
    os.mkfifo(target)
    with pytest.raises(OSError, match=r"FIFO \(named pipe\), not a regular file; not read"):
        ablation_compare.compare(runs, main="pretrained_seed0", **BOOT)
    target.unlink()
    target.mkdir()
    with pytest.raises(OSError, match="directory, not a regular file; not read"):
        ablation_compare.compare(runs, main="pretrained_seed0", **BOOT)
    target.rmdir()
    with pytest.raises(ValueError, match=f"not found: {target}"):
        ablation_compare.compare(runs, main="pretrained_seed0", **BOOT)
