"""Ablation: fine-tuning from the other initialisation, same budget, evaluated on test."""
from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from chexflow.settings import ConfigError
from chexflow.train import config as ablation
from chexflow.train.config import TrainConfig
from conftest import REPO, job_counts, snakemake
from test_workflow import _finished, tiny_run  # noqa: F401  (tiny_run: a fixture)



_snakemake = functools.partial(snakemake, timeout=900)


def _config(tmp_path: Path, **finetune) -> tuple[dict, Path]:
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["finetune"].update(finetune)
    cfg["ablation"] = {"enabled": True}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cfg, path


def _shell_of(dry_stdout: str, rule: str) -> str:
    block = dry_stdout.split(f"rule {rule}:", 1)[1]
    return re.search(r"^Shell command: (.*)$", block, re.M).group(1)


def test_other_init_is_the_one_the_main_run_does_not_use():
    assert ablation.other_init({"finetune": {"init": "pretrained"}}) == "random"
    assert ablation.other_init({"finetune": {"init": "random"}}) == "pretrained"
    # no finetune.init: the dataclass default, for the workflow and the report alike
    assert ablation.main_init({}) == ablation.main_init({"finetune": None}) == TrainConfig.init
    assert ablation.other_init({}) != TrainConfig.init
    with pytest.raises(ConfigError, match=r"finetune\.init.*'imagenet'"):
        ablation.other_init({"finetune": {"init": "imagenet"}})


def _compared_runs(dry_stdout: str) -> tuple[dict, str]:
    """compare_ablation's runs (--runs-json) and main run (--main); the report gets only their comparison."""
    shell = _shell_of(dry_stdout, "compare_ablation")
    assert "--out results/ablation/comparison.json" in shell
    report = json.loads(re.search(r"--inputs-json '(\{.*?\})' ", _shell_of(dry_stdout, "render_report")).group(1))
    assert report["ablation"] == {"comparison": "results/ablation/comparison.json"}
    assert report["benchmarks"]["compare_ablation"] == "benchmarks/ablation/compare.tsv"
    # every compared file is a target of `all` too: a missing one is made again (kept_files)
    kept = set(re.search(r"^rule all:\n\s+input: (.*)$", dry_stdout, re.M).group(1).split(", "))
    runs = json.loads(re.search(r"--runs-json '(\{.*?\})' ", shell).group(1))
    assert {path for files in runs.values() for path in files.values()} <= kept
    return runs, re.search(r"--main (\S+)", shell).group(1)


def test_ablation_dag_flips_the_init(tmp_path):
    _, cfgfile = _config(tmp_path, init="pretrained")
    dry = _snakemake(tmp_path, "-n", "-p", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["finetune_ablation"] == counts["evaluate_ablation"] == counts["finetune_model"] == 1
    shell = _shell_of(dry.stdout, "finetune_ablation")
    assert '"init": "random"' in shell and "--pretrained" not in shell
    main = _shell_of(dry.stdout, "finetune_model")
    # same budget: the same finetune section apart from init
    strip = lambda s: json.loads(re.search(r"--config-json '(\{.*?\})'", s).group(1))  # noqa: E731
    a, m = strip(shell), strip(main)
    assert a.pop("init") == "random" and m.pop("init") == "pretrained" and a == m
    runs, main_run = _compared_runs(dry.stdout)
    assert main_run == "pretrained_seed0" and counts["compare_ablation"] == 1
    assert runs == {
        "pretrained_seed0": {"metrics": "results/evaluate/metrics.json", "predictions": "results/evaluate/predictions.csv",
                             "training": "results/finetune/metrics.jsonl"},
        "random_seed0": {"metrics": "results/ablation/evaluate/metrics.json",
                         "predictions": "results/ablation/evaluate/predictions.csv",
                         "training": "results/ablation/finetune/metrics.jsonl"}}
    assert "--no-heatmaps" in _shell_of(dry.stdout, "evaluate_ablation")
    assert "--no-heatmaps" not in _shell_of(dry.stdout, "evaluate_model")

    _, cfgfile = _config(tmp_path, init="random")
    dry = _snakemake(tmp_path, "-n", "-p", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    shell = _shell_of(dry.stdout, "finetune_ablation")
    assert '"init": "pretrained"' in shell and "--pretrained results/pretrain/model.pt" in shell


def test_ablation_seeds_run_every_arm_with_every_seed(tmp_path):
    """ablation.seeds: one fine-tuning + evaluation per arm and seed; the finetune seed's runs are the
    main run and results/ablation/ (the default DAG's), the others under results/ablation/seed<s>/<init>/."""
    cfg, cfgfile = _config(tmp_path, init="pretrained", seed=0)
    cfg["ablation"]["seeds"] = [0, 1, 2]
    cfgfile.write_text(yaml.safe_dump(cfg))
    dry = _snakemake(tmp_path, "-n", "-p", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["finetune_model"] == counts["finetune_ablation"] == counts["evaluate_ablation"] == 1
    assert counts["finetune_seed"] == counts["evaluate_seed"] == 4
    runs = re.findall(r"--config-json '(\{[^']*\})' --manifest \S+ ?(--pretrained \S+)? --out-dir (results/ablation/seed\d/\w+)/finetune",
                      dry.stdout)
    got = {(json.loads(c)["init"], json.loads(c)["seed"], bool(p), d) for c, p, d in runs}
    assert got == {(init, seed, init == "pretrained", f"results/ablation/seed{seed}/{init}")
                   for init in ("pretrained", "random") for seed in (1, 2)}
    runs, _ = _compared_runs(dry.stdout)
    assert sorted(runs) == sorted(f"{i}_seed{s}" for i in ("pretrained", "random") for s in (0, 1, 2))
    tree = json.loads(re.search(r"--inputs-json '(\{.*?\})' ", _shell_of(dry.stdout, "render_report")).group(1))
    assert tree["benchmarks"]["evaluate_random_seed2"] == "benchmarks/ablation/seed2/random/evaluate.tsv"
    cfg["ablation"]["seeds"] = [1, 1]
    cfgfile.write_text(yaml.safe_dump(cfg))
    bad = _snakemake(tmp_path, "-n", "--configfile", str(cfgfile))
    assert bad.returncode != 0 and "ablation.seeds" in bad.stdout + bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ablation_rules_tiny(tiny_run):
    """The random-init run (the main run starts from the pretraining model) trained and evaluated on test
    for real, with the main run's budget: in test_workflow's tiny chain (made once per test run), where
    the ablation is on, as in the default demo."""
    work = _finished(tiny_run)
    cfg = yaml.safe_load(tiny_run.cfgfile.read_text())
    assert cfg["ablation"]["enabled"] and cfg["finetune"]["init"] == "pretrained"
    trained = yaml.safe_load((work / "results/ablation/finetune/config.yaml").read_text())
    assert trained["init"] == "random"
    assert (trained["epochs"], trained["batch_size"]) == (cfg["finetune"]["epochs"], cfg["finetune"]["batch_size"])
    metrics = json.loads((work / "results/ablation/evaluate/metrics.json").read_text())
    main = json.loads((work / "results/evaluate/metrics.json").read_text())
    assert 0.0 <= metrics["mean_auroc"] <= 1.0 and metrics["n_images"] == main["n_images"] > 0
    assert metrics["model"] == "results/ablation/finetune/model.pt"
    auroc = (work / "results/ablation/evaluate/auroc.csv").read_text().splitlines()
    assert len(auroc) == 1 + 14 + 1 and auroc[-1].startswith("mean,")


def test_a_weights_file_adds_the_third_arm_and_is_every_run_s_input(tmp_path):
    """finetune.init_file set: the ablation runs random, own pretraining and the published weights
    with the same budget; the file is an input of every job that starts from it (Snakemake tracks it)."""
    weights = tmp_path / "densenet121-a639ec97.pth"
    weights.write_bytes(b"the bytes do not matter to a dry run")
    _, cfgfile = _config(tmp_path, init="pretrained", init_file=str(weights))
    dry = _snakemake(tmp_path, "-n", "-p", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["finetune_seed"] == counts["evaluate_seed"] == 1 and counts["finetune_ablation"] == 1
    block = dry.stdout.split("rule finetune_seed:", 1)[1].split("\n\n", 1)[0]
    assert re.search(rf"input: .*{re.escape(str(weights))}", block)
    shell = _shell_of(dry.stdout, "finetune_seed")
    assert '"init": "file"' in shell and "--out-dir results/ablation/seed0/file/finetune" in shell
    runs, main_run = _compared_runs(dry.stdout)
    assert sorted(runs) == ["file_seed0", "pretrained_seed0", "random_seed0"] and main_run == "pretrained_seed0"

    # the main run from the file: its jobs (training and evaluation) take the file as input; the
    # ablation adds random and own pretraining
    _, cfgfile = _config(tmp_path, init="file", init_file=str(weights))
    dry = _snakemake(tmp_path, "-n", "-p", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    for rule in ("finetune_model", "evaluate_model"):
        block = dry.stdout.split(f"rule {rule}:", 1)[1].split("\n\n", 1)[0]
        assert re.search(rf"input: .*{re.escape(str(weights))}", block), rule
    runs, main_run = _compared_runs(dry.stdout)
    assert sorted(runs) == ["file_seed0", "pretrained_seed0", "random_seed0"] and main_run == "file_seed0"

    # continued pretraining from the file: the pretraining job takes it as input
    cfg = yaml.safe_load(cfgfile.read_text())
    cfg["pretrain"].update(init="file", init_file=str(weights))
    cfgfile.write_text(yaml.safe_dump(cfg))
    dry = _snakemake(tmp_path, "-n", "-p", "--configfile", str(cfgfile))
    assert dry.returncode == 0, dry.stderr[-3000:]
    block = dry.stdout.split("rule pretrain_model:", 1)[1].split("\n\n", 1)[0]
    assert re.search(rf"input: .*{re.escape(str(weights))}", block)
    assert '"init": "file"' in _shell_of(dry.stdout, "pretrain_model")

    weights.unlink()
    bad = _snakemake(tmp_path, "-n", "--configfile", str(cfgfile))
    assert bad.returncode != 0 and f"finetune.init_file: {weights} does not exist" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_the_published_weights_arm_tiny(tmp_path, demo_manifest):
    """The third arm trained from a torchvision-layout file and evaluated on test for real; new bytes
    in the file make Snakemake run it again."""
    from test_init_file import _torchvision_file

    weights = tmp_path / "resnet18-f37072fd.pth"
    cfg, cfgfile = _config(tmp_path, init="pretrained", init_file=str(weights), backend="single", epochs=1,
                           batch_size=16)
    _torchvision_file(weights, cfg["finetune"]["model"]["arch"])
    cfg["finetune"]["data"].update(crop=32, workers=0, samples_per_epoch=64)
    cfg["evaluate"]["bootstrap_resamples"] = 50
    cfgfile.write_text(yaml.safe_dump(cfg))
    shutil.copytree(demo_manifest.parent, tmp_path / "data/shards/nih_demo")
    target = "results/ablation/seed0/file/evaluate/metrics.json"
    proc = _snakemake(tmp_path, "--configfile", str(cfgfile), "--set-resources", "finetune_seed:tasks=1",
                      "--allowed-rules", "finetune_seed", "evaluate_seed", "--", target)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    trained = yaml.safe_load((tmp_path / "results/ablation/seed0/file/finetune/config.yaml").read_text())
    assert trained["init"] == "file" and trained["init_file"] == str(weights) and trained["epochs"] == 1
    log = (tmp_path / "logs/ablation/seed0/file/train.log").read_text()
    assert f"backbone tensors from {weights}" in log
    metrics = json.loads((tmp_path / target).read_text())
    assert metrics["model_init"] == "file" and 0.0 <= metrics["mean_auroc"] <= 1.0
    again = _snakemake(tmp_path, "-n", "--configfile", str(cfgfile), "--", target)
    assert "finetune_seed" not in job_counts(again.stdout)
    _torchvision_file(weights, cfg["finetune"]["model"]["arch"], seed=1)       # new bytes, same name
    again = _snakemake(tmp_path, "-n", "--configfile", str(cfgfile), "--", target)
    assert job_counts(again.stdout).get("finetune_seed") == 1, again.stdout[-3000:]
