"""The Snakemake workflow itself: the DAG in dry-run, and the whole chain at tiny scale."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import roc_auc_score

from conftest import REPO, builds_images, horovod_available, job_counts, once_per_run, snakemake

CHAIN = ["download_file", "write_shards", "gather_shards", "pretrain_model", "finetune_model",
         "evaluate_model", "render_report"]


def tiny_config(backend: str, arch: str = "shufflenet_v2_x0_5") -> dict:
    """The demo at tiny scale. ``arch``: pretraining's and fine-tuning's model (one object in config.yaml,
    a YAML alias). ShuffleNet v2 x0.5 (0.36 M parameters) by default: this file's subject is the chain, the
    same code for every torchvision model, and it costs 18% less CPU than ResNet-18 (docs/benchmarks-log.md);
    the SLURM tests time their faults against ResNet-18's steps and checkpoints and ask for it."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    assert cfg["pretrain"]["model"] is cfg["finetune"]["model"], "config.yaml: fine-tuning's model is pretraining's"
    cfg["pretrain"]["model"]["arch"] = arch
    cfg["demo_release"].update(n_images=1200, image_size=48, images_per_archive=400)
    cfg["demo_pretrain_release"].update(n_images=1200, image_size=32, images_per_archive=600)
    for ds in ("nih_demo", "nih_demo_pretrain"):
        cfg["shards"][ds].update(image_size=32, samples_per_shard=100)
    cfg["training"]["backend"] = backend
    cfg["training"]["checkpoint"]["every_steps"] = 20
    for stage in ("pretrain", "finetune"):
        cfg[stage]["data"]["crop"] = 32
    cfg["pretrain"].update(epochs=2, batch_size=32)
    cfg["finetune"].update(epochs=2, batch_size=16)
    cfg["evaluate"]["bootstrap_resamples"] = 200
    return cfg


def test_dry_run_dag_has_every_stage_in_order(tmp_path):
    (tmp_path / "config.yaml").write_text((REPO / "config.yaml").read_text())
    proc = snakemake(tmp_path, "--rulegraph")
    assert proc.returncode == 0, proc.stderr[-3000:]
    nodes = dict(re.findall(r'^\s*(\d+)\[label = "([a-z_]+)"', proc.stdout, re.M))
    edges = {(nodes[a], nodes[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", proc.stdout, re.M)}
    for rule in CHAIN:
        assert rule in nodes.values(), rule
    for a, b in zip(CHAIN, CHAIN[1:]):
        assert (a, b) in edges, f"no edge {a} -> {b} in the DAG"
    dry = snakemake(tmp_path, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    # the demo pretrains on its own phantom corpus (3 archives) and fine-tunes on the demo release (3)
    assert counts["make_demo_release"] == 2
    assert counts["write_shards"] == 3 + 3
    # per release: 3 archives + 3 tables; the fine-tuning release's box list (localisation) too
    assert counts["download_file"] == 6 + 7
    assert "data/raw/nih_demo/BBox_List_2017.csv" in dry.stdout and "nih_demo_pretrain/BBox_List_2017.csv" not in dry.stdout
    assert "--dataset nih_demo_pretrain" in dry.stdout and "data/shards/nih_demo_pretrain/manifest.json" in dry.stdout
    assert counts["pretrain_model"] == counts["finetune_model"] == counts["render_report"] == 1
    # the ablation (pretrained vs random init) is the demo's headline: on by default; scaling and sweep are off
    assert counts["finetune_ablation"] == counts["evaluate_ablation"] == counts["compare_ablation"] == 1
    # the comparison of the ablation's runs is its own job; the report's inputs as one structure,
    # the ablation's comparison and jobs in it
    assert ('"random_seed0": {"metrics": "results/ablation/evaluate/metrics.json", '
            '"predictions": "results/ablation/evaluate/predictions.csv"') in dry.stdout
    assert '"ablation": {"comparison": "results/ablation/comparison.json"}' in dry.stdout
    assert '"finetune_random_seed0": "benchmarks/ablation/train.tsv"' in dry.stdout
    for rule in ("scale_pretrain", "summarize_scaling", "sweep_trial", "select_sweep", "evaluate_sweep_winner"):
        assert rule not in counts, rule


def test_finetuning_from_random_init_does_not_wait_for_pretraining(tmp_path):
    """finetune.init: random, no ablation: fine-tuning and its evaluation need no pretraining job
    (the report still shows pretraining, so `all` keeps it; its own edges are in the rule graph test)."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["finetune"]["init"] = "random"
    cfg["ablation"] = {"enabled": False}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    dry = snakemake(tmp_path, "-n", "-p", "--configfile", str(tmp_path / "config.yaml"), "--",
                    "results/evaluate/metrics.json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = job_counts(dry.stdout)
    assert counts["finetune_model"] == counts["evaluate_model"] == 1
    assert "pretrain_model" not in counts and "finetune_ablation" not in counts
    finetune = dry.stdout.split("rule finetune_model:", 1)[1].split("\n\n", 1)[0]
    assert "results/pretrain/model.pt" not in finetune and "--pretrained" not in finetune


def test_invalid_config_key_fails_before_any_job(tmp_path):
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["finetune"]["optim"]["learning_rate"] = 0.1
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(tmp_path, "-n", "--configfile", str(tmp_path / "config.yaml"))
    assert proc.returncode != 0
    assert "learning_rate" in proc.stdout + proc.stderr


TRAINING_JOBS = ("pretrain_model", "finetune_model", "finetune_ablation")
# two real ranks of two cores per training job (a workstation's default is one rank on one core): the
# multi-rank chain, in the configuration this file's numbers were validated with (CPU runs are
# deterministic for a given rank and thread count, not across them); every run of tiny_config uses them
RANKS = ("--set-resources", *(f"{rule}:tasks=2" for rule in TRAINING_JOBS),
         "--set-threads", *(f"{rule}=2" for rule in TRAINING_JOBS))


@dataclass(frozen=True)
class TinyRun:
    work: Path
    cfgfile: Path
    proc: subprocess.CompletedProcess


def _make_tiny_run(work: Path) -> None:
    backend = "horovod" if horovod_available() else "ddp"
    cfgfile = work / "config.yaml"
    cfgfile.write_text(yaml.safe_dump(tiny_config(backend)))
    proc = snakemake(work, "--configfile", str(cfgfile), *RANKS)
    (work / "snakemake.json").write_text(json.dumps({"args": proc.args, "returncode": proc.returncode,
                                                     "stdout": proc.stdout, "stderr": proc.stderr}))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """The whole workflow (`snakemake` with no target: every rule of `all`) at tiny scale in a fresh
    directory, once per test run (conftest.once_per_run) for the tests that read it: test_end_to_end_tiny
    checks it, the reproducibility test runs it again beside it, the forcerun test starts from a copy of
    it, and test_container runs it in the image and compares. Read only; its Snakemake's outcome is
    ``proc`` (a failed run fails the tests that read it, each with its log)."""
    work = once_per_run(tmp_path_factory, "tiny-chain", _make_tiny_run)
    rec = json.loads((work / "snakemake.json").read_text())
    return TinyRun(work, work / "config.yaml", subprocess.CompletedProcess(**rec))


def _finished(run: TinyRun) -> Path:
    assert run.proc.returncode == 0, (run.proc.stdout + run.proc.stderr)[-5000:]
    return run.work


def run_facts(work, hosts: bool = False) -> dict:
    """What two runs of one chain share when they are reproducible (docs/studies.md): the test predictions
    (sha256 of their bytes) and metrics, each training stage's weights (sha256 over every tensor's name, dtype,
    shape and bytes) and its per-epoch records; not the timings, nor the host records that say where each
    number was computed (the image's Python is not the host's), nor the evaluated model's run id (fine-tuning's
    hashes the pretraining model's file, its host record included). ``hosts``: those too (two runs on one
    host). Self-contained: test_container runs its source inside the image, on the image's run."""
    import hashlib
    import json
    from pathlib import Path

    import torch
    work = Path(work)
    where = ("images_per_sec", "images_per_sec_per_rank", "epoch_time_s") + \
        (() if hosts else ("host", "training_host", "model_run_id"))
    facts = {"predictions.csv": hashlib.sha256((work / "results/evaluate/predictions.csv").read_bytes()).hexdigest(),
             "metrics.json": {k: v for k, v in json.loads((work / "results/evaluate/metrics.json").read_text()).items()
                              if k not in where}}
    for stage in ("pretrain", "finetune"):
        weights = torch.load(work / f"results/{stage}/model.pt", weights_only=True)["state_dict"]
        digest = hashlib.sha256()
        for name in sorted(weights):
            t = weights[name].detach().cpu().contiguous().reshape(-1)
            digest.update(f"{name} {t.dtype} {tuple(weights[name].shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
        facts[f"{stage} weights"] = digest.hexdigest()
        facts[f"{stage} epochs"] = [{k: v for k, v in json.loads(line).items() if k not in where}
                                    for line in (work / f"results/{stage}/metrics.jsonl").read_text().splitlines()]
    return facts


IMAGE_CHAIN = "tests/test_container.py::test_demo_chain_in_the_image_gives_the_host_metrics"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_chain_twice_gives_identical_metrics(request, tmp_path, tiny_run):
    """What is reproducible (docs/studies.md): the same chain run twice on one machine and software stack, in
    two fresh directories, gives bit-identical models and byte-identical test metrics (run_facts). The first
    run is tiny_run's. Where this test run also runs the chain in the image (IMAGE_CHAIN: every rule again,
    in a fresh directory of a container on this machine), that is the second run and compares run_facts;
    otherwise the second trains and evaluates here, on copies of the first's shards in a directory of its own."""
    a = _finished(tiny_run)
    if builds_images() and any(item.nodeid == IMAGE_CHAIN for item in request.session.items):
        pytest.skip(f"the second run is the image's, its run_facts compared with tiny_run's in {IMAGE_CHAIN}")
    b = tmp_path / "b"
    shutil.copytree(a / "data/shards", b / "data/shards")
    # evaluation reads the release's label table and boxes (subgroups, localisation); copy2 keeps
    # their mtimes older than the shards', as in the build, so no shard job is due
    (b / "data/raw/nih_demo").mkdir(parents=True)
    for table in ("Data_Entry_2017_v2020.csv", "BBox_List_2017.csv"):
        shutil.copy2(a / "data/raw/nih_demo" / table, b / "data/raw/nih_demo" / table)
    shutil.copy2(tiny_run.cfgfile, b / "config.yaml")
    proc = snakemake(b, "--configfile", str(b / "config.yaml"), *RANKS, "--allowed-rules", "pretrain_model",
                     "finetune_model", "evaluate_model", "--", "results/evaluate/metrics.json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert {k: v for k, v in job_counts(proc.stdout + proc.stderr).items() if k != "total"} == {
        "pretrain_model": 1, "finetune_model": 1, "evaluate_model": 1}
    facts = run_facts(a, hosts=True)        # one host: the host records and run ids are equal too
    assert run_facts(b, hosts=True) == facts
    assert (a / "results/evaluate/metrics.json").read_bytes() == (b / "results/evaluate/metrics.json").read_bytes()
    cfg = yaml.safe_load(tiny_run.cfgfile.read_text())
    assert [len(facts[f"{stage} epochs"]) for stage in ("pretrain", "finetune")] == [
        cfg["pretrain"]["epochs"], cfg["finetune"]["epochs"]]
    metrics = json.loads((a / "results/evaluate/metrics.json").read_text())
    assert metrics["n_images"] > 0 and 0.0 <= metrics["mean_auroc"] <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_end_to_end_tiny(tiny_run):
    work = _finished(tiny_run)
    cfgfile = tiny_run.cfgfile
    assert "chexflow launch -n 2 chexflow train" in tiny_run.proc.stdout + tiny_run.proc.stderr

    report = work / "results/report/chexflow_report.html"
    html = report.read_text()
    assert "SYNTHETIC" in html
    table = re.search(r'<table id="auroc-table">(.*?)</table>', html, re.S).group(1)
    body = re.search(r"<tbody>(.*?)</tbody>", table, re.S).group(1)
    rows = re.findall(r'<tr><td class="l">([^<]+)</td><td>([^<]+)</td>', body)
    assert len(rows) == 14
    values = [float(v) for _, v in rows]
    assert all(0.0 <= v <= 1.0 for v in values)
    metrics = json.loads((work / "results/evaluate/metrics.json").read_text())
    print(f"test mean AUROC {metrics['mean_auroc']:.4f}")      # shown with -rP
    assert abs(sum(values) / 14 - metrics["mean_auroc"]) < 0.01
    # the evaluation's numbers are its predictions' own: each finding's AUROC recomputed with scikit-learn
    # from the CSV (which holds the float32 scores exactly) is the record's, over every test image, and
    # the scores are not constant
    pred = pd.read_csv(work / "results/evaluate/predictions.csv")
    recomputed = {c: roc_auc_score(pred[c], pred[f"{c}_score"]) for c in metrics["mean_auroc_labels"]}
    assert recomputed == {c: metrics["labels"][c]["auroc"] for c in metrics["mean_auroc_labels"]}
    assert np.mean(list(recomputed.values())) == pytest.approx(metrics["mean_auroc"], abs=1e-12)
    assert len(pred) == metrics["n_images"] and pred.filter(like="_score").std().min() > 0
    # No bound on the AUROC itself: this chain's 26 pretraining steps leave validation at chance and
    # its test AUROC sat at 0.51-0.56 by numerical luck (one core or two per rank, fused or for-loop
    # Adam). That training learns: test_trainer_paths.py::test_the_trainer_learns_a_learnable_task.
    # Pretraining happened and is in the report; every training job's loss falls
    pre = [json.loads(x) for x in (work / "results/pretrain/metrics.jsonl").read_text().splitlines()]
    # on the demo's phantom corpus: the 14 findings, multi-label
    assert len(pre) == 2 and pre[-1]["val_metric_name"] == "mean_auroc" and pre[-1]["world_size"] == 2
    for stage in ("pretrain", "finetune", "ablation/finetune"):
        hist = [json.loads(x) for x in (work / f"results/{stage}/metrics.jsonl").read_text().splitlines()]
        assert hist[-1]["train_loss"] < hist[0]["train_loss"], stage
        # the job's 2 threads (RANKS: Snakemake's OMP_NUM_THREADS) shared by its 2 ranks: one each, not 2
        assert [(h["world_size"], h["host"]["torch_threads"]) for h in hist] == [(2, 1)] * len(hist), stage
    assert "Pretraining" in html or "pretraining" in html
    # the default ablation: the summary states the gain of pretraining with its paired CI and a verdict
    assert 'id="pretraining-gain"' in html and "(paired, patients resampled)" in html
    assert re.search(r'id="pretraining-verdict"[^>]*>\s*'
                     r'(Pretraining helps|Pretraining HURTS|No gain of pretraining)', html)
    # a second run has nothing to do
    again = snakemake(work, "--configfile", str(cfgfile), *RANKS)
    assert again.returncode == 0
    assert "Nothing to be done" in again.stdout + again.stderr


def _copy_or_link_checkpoint(src: str, dst: str) -> None:
    """copytree's copy function: a checkpoint (``checkpoints/step-*.pt``: written once, atomically, and
    pruned by unlinking) is hard-linked, every other file copied with its mtime (shutil.copy2)."""
    if Path(src).parent.name == "checkpoints" and Path(src).suffix == ".pt":
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_failed_forcerun_is_made_again_by_the_next_run(tmp_path, tiny_run):
    """`snakemake --forcerun finetune_model` that fails deletes the job's outputs; Snakemake alone then
    finds "Nothing to be done" (a missing file whose dependants are up to date is left alone). The
    workflow lists what the report is made from as targets: the next plain run makes the model again,
    then the evaluation, the ablation's comparison and the report. The failed job's log ends with
    chexflow's one-line refusal. On a copy of tiny_run's finished directory (its mtimes and .snakemake
    records kept, its checkpoints hard-linked): the run resumed from them gives the same metrics. The
    forced job runs as one plain process (backend single, one rank; under horovodrun its launcher and
    the other ranks add tracebacks of their own) with Snakemake's mtime trigger only, so that the
    changed backend makes no other job due; the next runs are tiny_run's, two Horovod or DDP ranks."""
    work = tmp_path / "work"
    shutil.copytree(_finished(tiny_run), work, symlinks=True, copy_function=_copy_or_link_checkpoint)
    cfgfile = work / "config.yaml"
    run = ("--configfile", str(cfgfile), *RANKS)
    metrics = (work / "results/evaluate/metrics.json").read_bytes()
    ckpt = work / "results/finetune/checkpoints"
    ckpt.rename(work / "kept")
    ckpt.write_text("not a directory")              # the trainer cannot start: the forced job fails
    single = work / "single.yaml"
    single.write_text(yaml.safe_dump(tiny_config("single")))
    failed = snakemake(work, "--configfile", str(single), "--rerun-triggers", "mtime", "--forcerun", "finetune_model")
    assert failed.returncode != 0
    assert not (work / "results/finetune/model.pt").exists()
    log = (work / "logs/finetune/train.log").read_text()
    refusal = [line for line in log.splitlines() if line.startswith("chexflow train: ")]
    assert len(refusal) == 1 and refusal[0].startswith("chexflow train: results/finetune/checkpoints: "), log[-3000:]
    assert "Traceback" not in log and refusal[0] in failed.stdout + failed.stderr   # the profile shows the log
    ckpt.unlink()
    (work / "kept").rename(ckpt)
    dry = snakemake(work, *run, "-n")
    assert "Nothing to be done" not in dry.stdout + dry.stderr
    assert {k: v for k, v in job_counts(dry.stdout).items() if k != "total"} == {
        "finetune_model": 1, "evaluate_model": 1, "compare_ablation": 1, "render_report": 1, "all": 1}
    again = snakemake(work, *run)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    assert (work / "results/finetune/model.pt").is_file()
    assert (work / "results/evaluate/metrics.json").read_bytes() == metrics    # the same run, resumed
    last = snakemake(work, *run)
    assert "Nothing to be done" in last.stdout + last.stderr
