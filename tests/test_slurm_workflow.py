"""The chexflow workflow itself on the real local SLURM cluster (tests/slurm_cluster/cluster.sh).

The demo chain at tiny scale with `--profile profiles/slurm` and the CI overlay (partition names
and sizes only): every rule is a SLURM job on the partition the profile names, pretraining is one
allocation of 2 nodes x 1 rank forming one Horovod world of 2 (OpenMPI via srun --mpi=pmix), and
a fine-tuning failure fixed afterwards reruns fine-tuning and what follows, never pretraining.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, cli_env, horovod_available
from test_slurm_cluster import CI_OVERLAY, PROFILE, _sacct_rows, slurm_cluster  # noqa: F401
from test_workflow import tiny_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(not horovod_available(), reason="horovod not built")]


def snakemake_slurm(cluster, workdir: Path, cfgfile: Path, *args: str, timeout: float = 1500):
    env = {**cluster.env, "PATH": cli_env()["PATH"], "PYTHONPATH": cli_env()["PYTHONPATH"]}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
           "--profile", str(PROFILE), "--workflow-profile", str(CI_OVERLAY), "--configfile", str(cfgfile),
           *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (workdir / f"snakemake-{len(list(workdir.glob('snakemake-*.log')))}.log").write_text(proc.stdout + proc.stderr)
    return proc


def test_demo_on_slurm_then_rerun_only_what_failed(slurm_cluster, tmp_path):  # noqa: F811
    cfg = tiny_config("horovod")
    cfg["finetune"]["epochs"] = 2
    cfgfile = tmp_path / "config.yaml"
    cfgfile.write_text(yaml.safe_dump(cfg))
    proc = snakemake_slurm(slurm_cluster, tmp_path, cfgfile)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert (tmp_path / "results/report/chexflow_report.html").exists()

    # every rule ran as a SLURM job, on the partition the profile says
    overlay = yaml.safe_load((CI_OVERLAY / "config.yaml").read_text())
    default = overlay["default-resources"]["slurm_partition"]
    run_id = re.search(r"SLURM run ID: (\S+)", log).group(1)
    rules = ["make_demo_release", "download_file", "split_dataset", "write_shards", "gather_shards",
             "pretrain_model", "finetune_model", "evaluate_model", "render_report"]
    n_jobs = int(re.search(r"^total\s+(\d+)$", log, re.M).group(1)) - 1      # minus local rule all
    rows = _sacct_rows(slurm_cluster.env, run_id, n_jobs)
    seen = {}
    for r in rows:
        job = r["Comment"].removeprefix("rule_")        # rule_<name>[_wildcards_...]
        rule = next(x for x in rules if job == x or job.startswith(x + "_wildcards"))
        seen.setdefault(rule, set()).add(r["Partition"])
    for rule in rules:
        expected = overlay["set-resources"].get(rule, {}).get("slurm_partition", default)
        assert seen.get(rule) == {expected}, (rule, seen)
    assert all(r["State"] == "COMPLETED" for r in rows), rows
    pre = next(r for r in rows if r["Comment"].startswith("rule_pretrain_model"))
    assert pre["NNodes"] == "2", pre
    # both ranks were one Horovod job: world size 2 in every epoch, rank 0 alone wrote
    hist = [json.loads(x) for x in (tmp_path / "results/pretrain/metrics.jsonl").read_text().splitlines()]
    assert hist and all(h["world_size"] == 2 for h in hist)
    plog = (tmp_path / "logs/pretrain/train.log").read_text()
    assert "world 2 (horovod)" in plog

    # a configuration error in fine-tuning: it fails; pretraining stays done
    pre_mtime = (tmp_path / "results/pretrain/model.pt").stat().st_mtime_ns
    bad = json.loads(json.dumps(cfg))
    bad["finetune"]["model"]["arch"] = "resnet_that_does_not_exist"
    cfgfile.write_text(yaml.safe_dump(bad))
    proc = snakemake_slurm(slurm_cluster, tmp_path, cfgfile)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Error in rule finetune_model" in log
    assert "resnet_that_does_not_exist" in (tmp_path / "logs/finetune/train.log").read_text()
    assert not (tmp_path / "results/finetune/model.pt").exists()

    # fixed: only fine-tuning and what depends on it run again
    cfgfile.write_text(yaml.safe_dump(cfg))
    proc = snakemake_slurm(slurm_cluster, tmp_path, cfgfile)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    ran = set(re.findall(r"^rule (\w+):", log, re.M)) | set(re.findall(r"^localrule (\w+):", log, re.M))
    assert {"finetune_model", "evaluate_model", "render_report"} <= ran, ran
    assert "pretrain_model" not in ran and "write_shards" not in ran, ran
    assert (tmp_path / "results/pretrain/model.pt").stat().st_mtime_ns == pre_mtime
