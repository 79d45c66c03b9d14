"""The chexflow workflow itself on the real local SLURM cluster (tests/slurm_cluster/cluster.sh).

The demo chain at tiny scale with `--profile profiles/slurm` and the CI overlay (partition names
and sizes only): every rule is a SLURM job on the partition the profile names, pretraining is one
allocation of 2 nodes x 1 rank forming one Horovod world of 2 (OpenMPI via srun --mpi=pmix), and
a fine-tuning failure fixed afterwards reruns fine-tuning and what follows, never pretraining,
and a fine-tuning job requeued (preemption) or cancelled mid-run resumes from its checkpoint.
The demo runs once per module (fixture ``slurm_demo``); the tests after it build on its state.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, cli_env, horovod_available, module_scratch
from test_slurm_cluster import CI_OVERLAY, PROFILE, _sacct_rows, slurm_cluster  # noqa: F401
from test_workflow import tiny_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(not horovod_available(), reason="horovod not built")]


def snakemake_slurm(cluster, workdir: Path, cfgfile: Path, *args: str, timeout: float = 1500):
    cmd, env = snakemake_slurm_cmd(cluster, workdir, cfgfile, *args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (workdir / f"snakemake-{len(list(workdir.glob('snakemake-*.log')))}.log").write_text(proc.stdout + proc.stderr)
    return proc


def snakemake_slurm_cmd(cluster, workdir: Path, cfgfile: Path, *args: str) -> tuple[list[str], dict]:
    env = {**cluster.env, "PATH": cli_env()["PATH"], "PYTHONPATH": cli_env()["PYTHONPATH"]}
    # targets first: --configfile takes several values and would swallow them
    return [sys.executable, "-m", "snakemake", *args, "-s", str(REPO / "Snakefile"), "-d", str(workdir),
            "--profile", str(PROFILE), "--workflow-profile", str(CI_OVERLAY), "--configfile", str(cfgfile)], env


FINETUNE_ONLY = "results/finetune/model.pt"     # the preemption tests stop at fine-tuning


@pytest.fixture(scope="module")
def slurm_demo(slurm_cluster, tmp_path_factory, request):  # noqa: F811
    """The demo workflow, run once on the cluster: (cluster, workdir, config, config file, log)."""
    cfg = tiny_config("horovod")
    cfg["finetune"]["epochs"] = 2
    # SLURM mechanics only: the ablation (on in the default demo) has its own tests and would run
    # fine-tuning twice on the small cluster
    cfg["ablation"]["enabled"] = False
    with module_scratch(tmp_path_factory, request, "slurm-demo") as work:     # up to 1.7 GB of checkpoints
        cfgfile = work / "config.yaml"
        cfgfile.write_text(yaml.safe_dump(cfg))
        proc = snakemake_slurm(slurm_cluster, work, cfgfile)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        yield slurm_cluster, work, cfg, cfgfile, log


def test_demo_on_slurm_every_rule_a_job_on_its_partition(slurm_demo):
    cluster, work, cfg, cfgfile, log = slurm_demo
    assert (work / "results/report/chexflow_report.html").exists()
    overlay = yaml.safe_load((CI_OVERLAY / "config.yaml").read_text())
    default = overlay["default-resources"]["slurm_partition"]
    run_id = re.search(r"SLURM run ID: (\S+)", log).group(1)
    rules = ["make_demo_release", "download_file", "split_dataset", "write_shards", "gather_shards",
             "pretrain_model", "finetune_model", "evaluate_model", "render_report"]
    n_jobs = int(re.search(r"^total\s+(\d+)$", log, re.M).group(1)) - 1      # minus local rule all
    rows = _sacct_rows(cluster.env, run_id, n_jobs)
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
    hist = [json.loads(x) for x in (work / "results/pretrain/metrics.jsonl").read_text().splitlines()]
    assert hist and all(h["world_size"] == 2 for h in hist)
    plog = (work / "logs/pretrain/train.log").read_text()
    assert "world 2 (horovod)" in plog


def test_rerun_after_a_failure_redoes_only_what_failed(slurm_demo):
    cluster, work, cfg, cfgfile, _ = slurm_demo
    # fine-tuning fails on its data (a batch larger than the training split: only the job can know,
    # settings alone fail before any job); pretraining stays done
    pre_mtime = (work / "results/pretrain/model.pt").stat().st_mtime_ns
    bad = json.loads(json.dumps(cfg))
    bad["finetune"]["batch_size"] = 100000
    cfgfile.write_text(yaml.safe_dump(bad))
    proc = snakemake_slurm(cluster, work, cfgfile)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Error in rule finetune_model" in log
    assert "too little data for one step" in (work / "logs/finetune/train.log").read_text()
    assert not (work / "results/finetune/model.pt").exists()

    # fixed: only fine-tuning and what depends on it run again
    cfgfile.write_text(yaml.safe_dump(cfg))
    proc = snakemake_slurm(cluster, work, cfgfile)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    ran = set(re.findall(r"^rule (\w+):", log, re.M)) | set(re.findall(r"^localrule (\w+):", log, re.M))
    assert {"finetune_model", "evaluate_model", "render_report"} <= ran, ran
    assert "pretrain_model" not in ran and "write_shards" not in ran, ran
    assert (work / "results/pretrain/model.pt").stat().st_mtime_ns == pre_mtime


def _finetune_job(env) -> str | None:
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %k"], env=env, capture_output=True,
                         text=True).stdout
    return next((line.split()[0] for line in out.splitlines() if "rule_finetune_model" in line), None)


def _interrupt_finetune_mid_run(cluster, work: Path, cfg: dict, cfgfile: Path, action: list[str]):
    """Start the workflow with a longer fine-tuning, wait for a fresh checkpoint, then `action` the job."""
    cfgfile.write_text(yaml.safe_dump(cfg))
    cmd, env = snakemake_slurm_cmd(cluster, work, cfgfile, FINETUNE_ONLY)
    log = open(work / f"snakemake-{len(list(work.glob('snakemake-*.log')))}.log", "w")
    t0 = time.time()
    # SIGINT back to its default for Snakemake: a test run started in the background of a
    # non-interactive shell (`nohup ... &`) ignores SIGINT, its children inherit that, and the
    # Ctrl-C of the cancellation test would never reach Snakemake (it waited forever, twice)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ckdir, job = work / "results/finetune/checkpoints", None
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        job = job or _finetune_job(cluster.env)
        if job and any(p.stat().st_mtime > t0 for p in ckdir.glob("step-*.pt")):
            break
        time.sleep(0.5)
    assert job and proc.poll() is None, "fine-tuning finished or failed before it could be interrupted"
    subprocess.run([*action, job], env=cluster.env, check=True)
    return proc, job


def _resumed_from(train_log: Path) -> list[int]:
    return [int(n) for n in re.findall(r"resuming from \S+ at step (\d+)", train_log.read_text())]


def test_requeued_training_job_resumes_from_its_checkpoint(slurm_demo):
    """`scontrol requeue` (what preemption does): SIGTERM -> checkpoint; the job restarts and resumes."""
    cluster, work, cfg, cfgfile, _ = slurm_demo
    longer = json.loads(json.dumps(cfg))
    longer["finetune"]["epochs"] = 4
    longer["finetune"]["checkpoint"] = {"every_steps": 5}      # over training.checkpoint, for this stage
    proc, job = _interrupt_finetune_mid_run(cluster, work, longer, cfgfile, ["scontrol", "requeue"])
    # SLURM holds a requeued batch job ~2 min (EligibleTime); let it start as soon as it is pending
    for _ in range(60):
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=cluster.env, capture_output=True,
                               text=True).stdout
        if "BeginTime" in state:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster.env)
            break
        time.sleep(0.5)
    assert proc.wait(timeout=900) == 0, (work / "logs/finetune/train.log").read_text()[-4000:]
    train_log = work / "logs/finetune/train.log"
    steps = _resumed_from(train_log)
    assert len(steps) == 1 and steps[0] > 0, train_log.read_text()[-4000:]
    hist = [json.loads(x) for x in (work / "results/finetune/metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4]
    restarts = subprocess.run(["scontrol", "show", "job", job], env=cluster.env, capture_output=True,
                              text=True).stdout
    assert re.search(r"Restarts=[1-9]", restarts), restarts


def test_cancelled_training_job_leaves_no_output_and_rerun_resumes(slurm_demo):
    cluster, work, cfg, cfgfile, _ = slurm_demo
    longer = json.loads(json.dumps(cfg))
    longer["finetune"]["epochs"] = 5
    longer["finetune"]["checkpoint"] = {"every_steps": 5}      # over training.checkpoint, for this stage
    proc, job = _interrupt_finetune_mid_run(cluster, work, longer, cfgfile, ["scancel"])
    # snakemake-executor-plugin-slurm 2.8.0 never takes sacct's "CANCELLED by <uid>" for a failure
    # and would wait forever (README, "Running on your cluster"): the user stops it with Ctrl-C
    deadline = time.time() + 120
    while time.time() < deadline:
        state = subprocess.run(["sacct", "-X", "-P", "-n", "-j", job, "-o", "State"], env=cluster.env,
                               capture_output=True, text=True).stdout
        if state.startswith("CANCELLED"):
            break
        time.sleep(1)
    assert state.startswith("CANCELLED"), state
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=180) != 0
    assert not (work / "results/finetune/model.pt").exists()
    assert not (work / "results/finetune/metrics.jsonl").exists()
    # the same command again: fine-tuning resumes from the checkpoint the cancelled job left
    proc = snakemake_slurm(cluster, work, cfgfile, FINETUNE_ONLY)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    steps = _resumed_from(work / "logs/finetune/train.log")
    assert len(steps) == 1 and steps[0] > 0
    hist = [json.loads(x) for x in (work / "results/finetune/metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4, 5]
