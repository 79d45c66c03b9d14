"""The chexflow workflow itself on the real local SLURM cluster (tests/slurm_cluster/cluster.sh).

The demo chain at tiny scale with `--profile profiles/slurm` and the CI overlay (partition names
and sizes only): every rule is a SLURM job on the partition the profile names, pretraining is one
allocation of 2 nodes x 1 rank forming one Horovod world of 2 (OpenMPI via srun --mpi=pmix).
The demo runs once per module (fixture ``slurm_demo``); the tests after it build on its state.
Each fault scenario costs a training run, so the faults that can share one are one sequence, its
phases named in the failure messages:

- one fine-tuning run: a fine-tuning failure fixed afterwards reruns fine-tuning and what follows,
  never pretraining; the fixed job cancelled mid-run (Ctrl-C of Snakemake) leaves no output and the
  same command resumes from its checkpoint; that job requeued mid-run (preemption) resumes again;
- one pretraining run: a TIMEOUT after the warning signal, the retry resumes; a node of the retry set
  down, SLURM requeues it, it resumes and the workflow runs through to the report;
- one more pretraining run: Snakemake killed (kill -9) while it runs, then rerun.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import REPO, checkpoint_step, cli_env, horovod_available, module_scratch
from test_slurm_cluster import CI_OVERLAY, PROFILE, SNAKEMAKE_ON_SLURM, _sacct_rows, slurm_cluster  # noqa: F401
from test_workflow import tiny_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(not horovod_available(), reason="horovod not built")]


def snakemake_slurm(cluster, workdir: Path, cfgfile: Path, *args: str, timeout: float = 1500):
    cmd, env = snakemake_slurm_cmd(cluster, workdir, cfgfile, *args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (workdir / f"snakemake-{len(list(workdir.glob('snakemake-*.log')))}.log").write_text(proc.stdout + proc.stderr)
    return proc


def snakemake_slurm_cmd(cluster, workdir: Path, cfgfile: Path, *args: str) -> tuple[list[str], dict]:
    # the jobs' verification stamps in the work directory (sbatch passes the environment on), not in ~/.cache
    env = {**cluster.env, "PATH": cli_env()["PATH"], "PYTHONPATH": cli_env()["PYTHONPATH"],
           "CHEXFLOW_VERIFIED_DIR": str(workdir / "verified")}
    # targets first: --configfile takes several values and would swallow them
    return [*SNAKEMAKE_ON_SLURM, *args, "-s", str(REPO / "Snakefile"), "-d", str(workdir),
            "--profile", str(PROFILE), "--workflow-profile", str(CI_OVERLAY), "--configfile", str(cfgfile)], env


FINETUNE_ONLY = "results/finetune/model.pt"     # the preemption tests stop at fine-tuning


@pytest.fixture(scope="module")
def slurm_demo(slurm_cluster, tmp_path_factory, request):  # noqa: F811
    """The demo workflow, run once on the cluster: (cluster, workdir, config, config file, log)."""
    cfg = tiny_config("horovod", arch="resnet18")     # the faults are timed against its steps and checkpoints
    cfg["finetune"]["epochs"] = 2
    # one archive per release: every rule is still a job on its partition, with 7 jobs fewer than 3 + 2 archives
    # (each job's two Snakemake processes cost more than its work)
    for release in ("demo_release", "demo_pretrain_release"):
        cfg[release]["images_per_archive"] = cfg[release]["n_images"]
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
    overlay = yaml.safe_load((CI_OVERLAY / "profile.yaml").read_text())
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
    assert [p.name for p in _attempt_logs(work, "pretrain")] == ["train.1.log"]     # one attempt, kept
    assert (work / "logs/pretrain/train.1.log").read_text() == plog


def _running_job(env, rule: str, work: Path) -> str | None:
    """The SLURM id of this workflow's running job of ``rule``: the plugin's comment ``rule_<name>`` (or
    ``rule_<name>_wildcards_...``) and its working directory ``work`` (the plugin submits with ``-D``
    the workflow's directory). The rule name alone picked another workflow's job on a shared cluster."""
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i|%k|%Z"], env=env, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        job, comment, workdir = line.split("|", 2)
        if (comment == f"rule_{rule}" or comment.startswith(f"rule_{rule}_wildcards_")) \
                and Path(workdir).resolve() == Path(work).resolve():
            return job
    return None


def test_running_job_is_this_workflows(slurm_cluster, tmp_path):  # noqa: F811
    """Two workflows on one cluster each run a fine-tuning job: each test picks its own (by working
    directory), never the other's (the rule name alone requeued another workflow's job)."""
    dirs = [tmp_path / "ours", tmp_path / "theirs", tmp_path / "elsewhere"]
    jobs = []
    for d, comment in zip(dirs, ["rule_finetune_model", "rule_finetune_model", "rule_finetune_model_x"]):
        d.mkdir()
        out = subprocess.run(["sbatch", "--parsable", f"--chdir={d}", f"--comment={comment}", "--output=/dev/null",
                              "--wrap", "sleep 120"], env=slurm_cluster.env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        jobs.append(out.stdout.strip().split(";")[0])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i"], env=slurm_cluster.env,
                                     capture_output=True, text=True).stdout.split()
            if set(jobs) <= set(running):
                break
            time.sleep(0.5)
        assert _running_job(slurm_cluster.env, "finetune_model", dirs[0]) == jobs[0]
        assert _running_job(slurm_cluster.env, "finetune_model", dirs[1]) == jobs[1]
        # a rule whose name only starts like it (rule_finetune_model_x) is another rule
        assert _running_job(slurm_cluster.env, "finetune_model", dirs[2]) is None
        assert _running_job(slurm_cluster.env, "pretrain_model", dirs[0]) is None
    finally:
        subprocess.run(["scancel", *jobs], env=slurm_cluster.env)


def _start_snakemake(cluster, work: Path, cfgfile: Path, *args: str, overlay: Path | None = None):
    """Snakemake in the background (its log: snakemake-<n>.log). ``overlay``: a profile applied after the
    CI overlay (production, CI overlay, this one: each replaces the keys it names)."""
    cmd, env = snakemake_slurm_cmd(cluster, work, cfgfile, *args)
    if overlay is not None:
        at = cmd.index("--workflow-profile")
        cmd[at:at + 2] = ["--profile", str(CI_OVERLAY), "--workflow-profile", str(overlay)]
    log = work / f"snakemake-{len(list(work.glob('snakemake-*.log')))}.log"
    # SIGINT back to its default for Snakemake: a test run started in the background of a
    # non-interactive shell (`nohup ... &`) ignores SIGINT, its children inherit that, and the
    # Ctrl-C of the cancellation test would never reach Snakemake (it waited forever, twice)
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def _job_mid_training(cluster, work: Path, proc, log: Path, rule: str, stage: str, t0: float,
                      min_step: int = 1, timeout: float = 900) -> str:
    """Wait until ``rule``'s job runs and has written a checkpoint at ``min_step`` or later (after ``t0``);
    ``proc``: the Snakemake that submitted it, None when that one is gone (killed)."""
    ckdir, job = work / f"results/{stage}/checkpoints", None
    deadline = time.time() + timeout
    while time.time() < deadline and (proc is None or proc.poll() is None):
        job = job or _running_job(cluster.env, rule, work)
        fresh = [p for p in ckdir.glob("step-*.pt") if _mtime(p) > t0]
        if job and fresh and max(checkpoint_step(p) for p in fresh) >= min_step:
            return job
        time.sleep(0.5)
    raise AssertionError(f"{rule} finished or failed before it could be interrupted:\n" + log.read_text()[-4000:])


def _mtime(path: Path) -> float:
    """A file's mtime, 0 for one gone (a checkpoint the trainer's rotation just removed)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _start_requeued_now(env, job: str) -> None:
    """SLURM holds a requeued batch job ~2 min (BeginTime); let it start as soon as it is pending."""
    for _ in range(120):
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True,
                               text=True).stdout
        if "BeginTime" in state:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env)
            return
        time.sleep(0.5)


def _ranks(job: str) -> list[psutil.Process]:
    """The training ranks of SLURM job ``job`` (the local cluster's nodes are this machine)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            name = proc.info["name"] or ""
            rank = name == "chexflow" or name.startswith("python")      # (srun's line names the command too)
            if rank and "train" in cmd and "--config-json" in cmd and "launch" not in cmd \
                    and proc.environ().get("SLURM_JOB_ID") == job:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _paused(job: str, ranks: int = 2) -> list[psutil.Process]:
    """SIGSTOP the job's ranks: they make no step until the test lets them go (a fault reached on
    progress, not on the machine's speed)."""
    deadline = time.time() + 60
    while len(found := _ranks(job)) < ranks and time.time() < deadline:
        time.sleep(0.2)
    assert len(found) == ranks, f"job {job}: ranks {found}"
    for proc in found:
        proc.send_signal(signal.SIGSTOP)
    return found


def _go_on_once_signalled(ranks: list[psutil.Process], sig: int, timeout: float = 120) -> None:
    """SIGCONT the stopped ranks once SLURM's ``sig`` is pending in each (or SLURM woke them itself)."""
    def pending(proc) -> bool:
        try:
            status = open(f"/proc/{proc.pid}/status").read()
        except OSError:
            return True
        masks = re.findall(r"^(?:ShdPnd|SigPnd):\s*([0-9a-f]+)", status, re.M)
        woke = re.search(r"^State:\s*([A-Z])", status, re.M).group(1) not in "T"
        return woke or any(int(m, 16) >> (sig - 1) & 1 for m in masks)
    deadline = time.time() + timeout
    while not all(pending(p) for p in ranks) and time.time() < deadline:
        time.sleep(0.2)
    for proc in ranks:
        try:
            proc.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass


def _resumed_from(train_log: Path) -> list[int]:
    return [int(n) for n in re.findall(r"resuming from \S+ at step (\d+)", train_log.read_text())]


def _attempt_logs(work: Path, stage: str) -> list[Path]:
    """logs/<stage>/train.<n>.log, one per attempt (chexflow keep-log), in attempt order."""
    logs = (work / "logs" / stage).glob("train.*.log")
    return sorted(logs, key=lambda p: int(p.name.split(".")[1]))


def _last_step(text: str, steps_per_epoch: int) -> int:
    """The furthest step an attempt's log shows: its checkpoints and its progress bar (every 5 s)."""
    steps = [int(n) for n in re.findall(r"\(step (\d+)\)", text)]
    steps += [(int(e) - 1) * steps_per_epoch + int(k) for e, k in re.findall(r"epoch (\d+)/\d+: +\d+%\|[^|]*\| *(\d+)/",
                                                                          text)]
    return max(steps, default=0)


def _steps_lost(scenario: str, interrupted: Path, resumed: Path, steps_per_epoch: int) -> int:
    """Steps trained by the interrupted attempt that the next one trains again (for BENCHMARKS.md)."""
    reached = _last_step(interrupted.read_text(), steps_per_epoch)
    resume = _resumed_from(resumed)[0]
    print(f"STEPS LOST {scenario}: interrupted attempt reached step {reached}, resumed at {resume}, "
          f"lost {reached - resume}")
    return reached - resume


def _signal_step(text: str, name: str) -> int | None:
    found = re.findall(rf"{name} received: checkpoint written at step (\d+)", text)
    return int(found[-1]) if found else None


def _steps_per_epoch(text: str) -> int:
    return int(re.search(r"(\d+) steps/epoch", text).group(1))


def _ran(log: str) -> set[str]:
    """The rules a Snakemake run's log shows it ran (jobs and local rules)."""
    return set(re.findall(r"^rule (\w+):", log, re.M)) | set(re.findall(r"^localrule (\w+):", log, re.M))


def test_finetuning_failed_fixed_cancelled_requeued_resumes_and_never_redoes_pretraining(slurm_demo):
    """One fine-tuning run through three faults, each phase named in its failure messages:

    1. failure: fine-tuning fails on its data (a batch larger than the training split: only the job
       can know, settings alone fail before any job); no fine-tuned model.
    2. cancel: fixed (and another seed: a run of its own), the whole workflow again; `scancel` of the
       job mid-run, which the plugin (2.8.0) never takes for a failure: the user stops Snakemake with
       Ctrl-C (SIGINT); no final outputs; pretraining not run.
    3. rerun + requeue: the same command again resumes from the cancelled job's checkpoint; mid-run
       `scontrol requeue` (what preemption does): SIGTERM to every process of the job, loader workers
       included (on by default); the trainer's checkpoint is the step the requeued run resumes at
       (issue 18.1: the workers died first, the trainer crashed, 17 steps lost), each run its own log;
       no attempt hashes a shard again (the demo's did); the workflow finishes: fine-tuning, evaluation
       and the report ran again, pretraining and the shards never, pretraining's model untouched."""
    cluster, work, cfg, cfgfile, _ = slurm_demo
    pre_mtime = (work / "results/pretrain/model.pt").stat().st_mtime_ns
    bad = json.loads(json.dumps(cfg))
    bad["finetune"]["batch_size"] = 100000
    cfgfile.write_text(yaml.safe_dump(bad))
    proc = snakemake_slurm(cluster, work, cfgfile)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, "failure: the workflow succeeded with a batch larger than the data"
    assert "Error in rule finetune_model" in log, "failure: " + log[-4000:]
    assert "too little data for one step" in (work / "logs/finetune/train.log").read_text(), "failure"
    assert not (work / "results/finetune/model.pt").exists(), "failure: a fine-tuned model was written"

    # fixed: another seed (another run id: nothing of the demo's to resume), checks every 2 steps (a
    # signal acted on within KillWait on a loaded machine), checkpoints every 5
    fixed = json.loads(json.dumps(cfg))
    fixed["finetune"]["seed"] = cfg["finetune"]["seed"] + 1
    fixed["finetune"]["checkpoint"] = {"every_steps": 5}      # over training.checkpoint, for this stage
    fixed["finetune"]["check_every_steps"] = 2
    assert fixed["training"]["data"]["workers"] >= 1, "the scenario needs loader workers (the default)"
    cfgfile.write_text(yaml.safe_dump(fixed))
    before = len(_attempt_logs(work, "finetune"))
    t0 = time.time()
    proc, log = _start_snakemake(cluster, work, cfgfile)
    job = _job_mid_training(cluster, work, proc, log, "finetune_model", "finetune", t0)
    subprocess.run(["scancel", job], env=cluster.env, check=True)
    # snakemake-executor-plugin-slurm 2.8.0 never takes sacct's "CANCELLED by <uid>" for a failure
    # and would wait forever (docs/cluster.md): the user stops it with Ctrl-C
    deadline = time.time() + 120
    while time.time() < deadline:
        state = subprocess.run(["sacct", "-X", "-P", "-n", "-j", job, "-o", "State"], env=cluster.env,
                               capture_output=True, text=True).stdout
        if state.startswith("CANCELLED"):
            break
        time.sleep(1)
    assert state.startswith("CANCELLED"), f"cancel: job {job} is {state!r}"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=180) != 0, "cancel: Snakemake succeeded after its job was cancelled"
    assert not (work / "results/finetune/model.pt").exists(), "cancel: a fine-tuned model was written"
    assert not (work / "results/finetune/metrics.jsonl").exists(), "cancel: fine-tuning metrics were written"
    ran = _ran(log.read_text())
    assert "pretrain_model" not in ran and "write_shards" not in ran, f"cancel: {ran}"

    # the same command again: fine-tuning resumes from the checkpoint the cancelled job left
    t1 = time.time()
    proc, log = _start_snakemake(cluster, work, cfgfile)
    text = _newest_attempt_shows(work, "finetune", r"resuming from \S+ at step \d+", proc, timeout=900,
                                 after=before + 1)
    steps = _resumed_from(_attempt_logs(work, "finetune")[-1])
    assert len(steps) == 1 and steps[0] > 0, "rerun: " + text[-3000:]
    # mid-run (a checkpoint of its own, past the step it resumed at): requeued
    job = _job_mid_training(cluster, work, proc, log, "finetune_model", "finetune", t1, min_step=steps[0] + 1)
    subprocess.run(["scontrol", "requeue", job], env=cluster.env, check=True)
    _start_requeued_now(cluster.env, job)
    assert proc.wait(timeout=900) == 0, "requeue: " + log.read_text()[-6000:]
    attempts = _attempt_logs(work, "finetune")[before:]
    assert len(attempts) == 3, f"requeue: {attempts}"      # cancelled, rerun (requeued), requeued
    cancelled, first, second = (p.read_text() for p in attempts)
    assert _resumed_from(attempts[0]) == [], "cancel: the fixed run resumed from another run's checkpoint"
    assert "killed by signal" not in first and "HorovodInternalError" not in first, "requeue: " + first[-4000:]
    step = _signal_step(first, "SIGTERM")
    assert step and _resumed_from(attempts[2]) == [step], ("requeue", first[-3000:], second[-3000:])
    assert second == (work / "logs/finetune/train.log").read_text(), "requeue: train.log is not the last attempt's"
    # the demo's first fine-tuning hashed every train and val shard once; no attempt here hashed any
    hashed = r"(\d+) shards checked against the manifest's sha256: (\d+) hashed"
    n, once = map(int, re.search(hashed, _attempt_logs(work, "finetune")[0].read_text()).groups())
    assert n == once > 0
    assert [re.search(hashed, text).groups() for text in (cancelled, first, second)] == [(str(n), "0")] * 3, \
        ("shards hashed again", cancelled, first, second)
    _steps_lost("scancel during fine-tuning", attempts[0], attempts[1], _steps_per_epoch(cancelled))
    _steps_lost("requeue during fine-tuning", attempts[1], attempts[2], _steps_per_epoch(first))
    hist = [json.loads(x) for x in (work / "results/finetune/metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == list(range(1, cfg["finetune"]["epochs"] + 1)), \
        f"requeue: epochs {hist}"
    restarts = subprocess.run(["scontrol", "show", "job", job], env=cluster.env, capture_output=True,
                              text=True).stdout
    assert re.search(r"Restarts=[1-9]", restarts), "requeue: " + restarts
    # what the fix reran: fine-tuning and what depends on it, never pretraining
    ran = _ran(log.read_text())
    assert {"finetune_model", "evaluate_model", "render_report"} <= ran, f"rerun: {ran}"
    assert "pretrain_model" not in ran and "write_shards" not in ran, f"rerun: {ran}"
    assert (work / "results/pretrain/model.pt").stat().st_mtime_ns == pre_mtime, "pretraining's model rewritten"


# ------------------------------------------------------------------ pretraining faults (issue 18)
# Each scenario pretrains afresh (another seed: another run id) with checks every 2 steps, so a
# signal is acted on well within the test cluster's KillWait (30 s) even on a loaded machine.

def _pretrain_variant(cfg: dict, seed: int, epochs: int) -> dict:
    out = json.loads(json.dumps(cfg))
    pre = out["pretrain"]
    pre.update(seed=seed, epochs=epochs, check_every_steps=2)
    pre["checkpoint"] = {**pre.get("checkpoint", {}), "every_steps": 5, "lease_wait_s": 5}   # over training's
    return out


def _newest_attempt_shows(work: Path, stage: str, pattern: str, proc, timeout: float = 180, after: int = 0) -> str:
    """The newest attempt log of ``stage`` once it shows ``pattern``; only attempts after the first ``after``."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        logs = _attempt_logs(work, stage)
        text = logs[-1].read_text() if len(logs) > after else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.5)
    logs = _attempt_logs(work, stage)
    newest = logs[-1].read_text() if len(logs) > after else f"(no attempt after the first {after})"
    raise AssertionError(f"no {pattern!r} in the newest {stage} log:\n" + newest[-4000:])


def test_time_limit_then_node_failure_during_pretraining_resume_and_run_through_to_the_report(slurm_demo, tmp_path):
    """One 2-node pretraining with loader workers (the whole workflow, --retries 1) through two faults:

    1. time limit: a real TIMEOUT (issue 18.1: a worker died first, the rank crashed, no checkpoint),
       after a time limit shorter than the 300 s warning (issue 18.2: SLURM's USR1 "at once" killed
       both ranks). The job's end is moved while it runs (`scontrol update EndTime=...`: SLURM's own
       warning and TIMEOUT at its next checks, whatever the machine's speed): first 4 minutes ahead
       (USR1: checkpoint, go on), then to now (TIMEOUT: SIGTERM). The retry resumes at the SIGTERM
       checkpoint. The time limits (`-t 9`, then `-t 10`) come from a merging overlay profile, one
       line (issue 18.5).
    2. node failure: `scontrol update nodename=<node> state=down` under the retry (issue 18.3): SLURM
       requeues the job (NODE_FAIL), it resumes and finishes (COMPLETED); the plugin (patched by
       envs/setup.sh) then submits fine-tuning, evaluation and the report normally instead of
       `--exclude=None assigned`, and the report is made again."""
    cluster, work, cfg, cfgfile, _ = slurm_demo
    # 4 epochs of 15 steps (60). The ranks pause from each move of the job's end until SLURM's signal is
    # there, so the SIGUSR1 and the SIGTERM checkpoints come a check (2 steps) after the first checkpoint
    # (step 5) and after the SIGUSR1 one, on any host: the retry resumes near step 9, its node goes down
    # after its next checkpoint (5 steps on), and the attempt after the node failure trains the ~45 left.
    epochs = 4
    variant = _pretrain_variant(cfg, seed=11, epochs=epochs)
    variant["finetune"]["epochs"] = 1       # what follows pretraining runs again: its cheapest budget
    cfgfile.write_text(yaml.safe_dump(variant))
    overlay = tmp_path / "limits"
    overlay.mkdir()
    (overlay / "profile.yaml").write_text(
        "__use_yte__: true\n__definitions__:\n  - from chexflow.profiles import set_resources\n"
        "__variables__:\n  changes:\n    pretrain_model: {runtime: '9 if attempt == 1 else 10'}\n"
        f"set-resources: ?set_resources({str(CI_OVERLAY)!r}, changes)\n")
    before = len(_attempt_logs(work, "pretrain"))
    report = work / "results/report/chexflow_report.html"
    report_mtime = report.stat().st_mtime
    t0 = time.time()
    proc, log = _start_snakemake(cluster, work, cfgfile, "--retries", "1", "--verbose", overlay=overlay)
    job = _job_mid_training(cluster, work, proc, log, "pretrain_model", "pretrain", t0)
    # the ranks paused from each move of the end until SLURM's signal is there: the steps between are
    # the few of one check, on any host (a fast one trained 104 of 120 steps before the TIMEOUT came)
    ranks = _paused(job)
    subprocess.run(["scontrol", "update", f"JobId={job}", "EndTime=now+4minutes"], env=cluster.env, check=True)
    _go_on_once_signalled(ranks, signal.SIGUSR1)
    _newest_attempt_shows(work, "pretrain", r"SIGUSR1 received: checkpoint written at step \d+; continuing", proc)
    ranks = _paused(job)
    subprocess.run(["scontrol", "update", f"JobId={job}", "EndTime=now"], env=cluster.env, check=True)
    _go_on_once_signalled(ranks, signal.SIGTERM)
    # the retry (another job): once it resumed and wrote a checkpoint of its own, one of its nodes goes down
    t1 = time.time()
    text = _newest_attempt_shows(work, "pretrain", r"resuming from \S+ at step \d+", proc, timeout=900,
                                 after=before + 1)
    resumed = _resumed_from(_attempt_logs(work, "pretrain")[-1])
    assert len(resumed) == 1, "time limit: " + text[-3000:]
    retry = _job_mid_training(cluster, work, proc, log, "pretrain_model", "pretrain", t1, min_step=resumed[0] + 1)
    assert retry != job, f"time limit: job {job} still runs after its TIMEOUT"
    nodes = subprocess.run(["squeue", "-h", "-j", retry, "-o", "%N"], env=cluster.env, capture_output=True,
                           text=True).stdout.strip()
    victim = subprocess.run(["scontrol", "show", "hostnames", nodes], env=cluster.env, capture_output=True,
                            text=True).stdout.split()[-1]
    try:
        subprocess.run(["scontrol", "update", f"nodename={victim}", "state=down", "reason=chexflow test"],
                       env=cluster.env, check=True)
        _start_requeued_now(cluster.env, retry)
        assert proc.wait(timeout=1500) == 0, "node failure: " + log.read_text()[-6000:]
    finally:
        subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], env=cluster.env)
    text = log.read_text()
    sbatch = [line for line in text.splitlines() if "sbatch call:" in line and "rule_pretrain_model" in line]
    assert len(sbatch) == 2 and [bool(re.search(r" -t 9 ", sbatch[0])), bool(re.search(r" -t 10 ", sbatch[1]))] \
        == [True, True], f"time limit: {sbatch}"
    state = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], env=cluster.env,
                           capture_output=True, text=True).stdout.split()
    assert state == ["TIMEOUT"], f"time limit: job {job} {state}"
    attempts = _attempt_logs(work, "pretrain")[before:]
    assert len(attempts) == 3, f"time limit + node failure: {attempts}"     # TIMEOUT, NODE_FAIL, completed
    first = attempts[0].read_text()
    assert "User defined signal" not in first and "killed by signal" not in first, "time limit: " + first[-4000:]
    step = _signal_step(first, "SIGTERM")
    assert step and step > _signal_step(first, "SIGUSR1") and _resumed_from(attempts[1]) == [step], \
        "time limit: " + first[-4000:]
    _steps_lost("time limit during pretraining", attempts[0], attempts[1], _steps_per_epoch(first))
    # the node failure
    assert "None assigned" not in text, "node failure: " + text[-6000:]
    assert report.stat().st_mtime > report_mtime, "node failure: the report was not made again"
    rows = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", retry, "-o", "State"], env=cluster.env,
                          capture_output=True, text=True).stdout.split()
    assert rows[0] == "NODE_FAIL" and rows[-1] == "COMPLETED", f"node failure: job {retry} {rows}"
    assert _resumed_from(attempts[2]), "node failure: " + attempts[2].read_text()[-4000:]
    _steps_lost("node failure during pretraining", attempts[1], attempts[2], _steps_per_epoch(first))
    hist = [json.loads(x) for x in (work / "results/pretrain/metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == list(range(1, epochs + 1)), hist
    assert all(h["world_size"] == 2 for h in hist), hist


def test_killed_snakemake_then_rerun_names_the_orphaned_job_and_never_doubles_it(slurm_demo):
    """kill -9 of Snakemake while pretraining runs, then what a user does: the same command (told to
    `--unlock`), again. Was: a second 2-node pretraining job trained into the same checkpoint directory
    (issue 18.4). Now the rerun names the running job and what to `scancel`, submitting nothing;
    a job submitted anyway (hooks off) finds the lease held and stops naming the holder; after the
    advice is followed the rerun resumes; every attempt's log is kept. The orphan is suspended
    while the reruns run (it stays a live job, whatever the machine's speed)."""
    cluster, work, cfg, cfgfile, _ = slurm_demo
    # 2 epochs (30 steps): the orphan stops by SIGTERM a few steps after its second checkpoint (step 10,
    # one after the suspension), and the rerun resumes there and trains the rest
    cfgfile.write_text(yaml.safe_dump(_pretrain_variant(cfg, seed=13, epochs=2)))
    target = "results/pretrain/model.pt"
    before = len(_attempt_logs(work, "pretrain"))
    t0 = time.time()
    proc, log = _start_snakemake(cluster, work, cfgfile, target)
    orphan = _job_mid_training(cluster, work, proc, log, "pretrain_model", "pretrain", t0)
    proc.kill()                                             # kill -9: its job keeps running
    proc.wait()
    env = cluster.env
    subprocess.run(["scontrol", "suspend", orphan], env=env, check=True)
    try:
        locked = snakemake_slurm(cluster, work, cfgfile, target)
        assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr
        unlock = snakemake_slurm(cluster, work, cfgfile, target, "--unlock")
        assert unlock.returncode == 0, unlock.stderr[-3000:]
        rerun = snakemake_slurm(cluster, work, cfgfile, target, "--verbose")
        out = rerun.stdout + rerun.stderr
        assert rerun.returncode != 0, out[-4000:]
        assert f"results/pretrain/checkpoints: SLURM job {orphan}, host" in out, out[-4000:]
        assert f"`scancel {orphan}`" in out, out[-4000:]
        assert "sbatch call" not in out, "the rerun submitted a job"
        # submitted anyway (a Snakemake without the check: hooks off): its trainer finds the lease
        anyway = snakemake_slurm(cluster, work, cfgfile, target, "--no-hooks")
        assert anyway.returncode != 0
        refused = _attempt_logs(work, "pretrain")[-1].read_text()
        assert f"in use by another trainer (SLURM job {orphan}, host" in refused, refused[-4000:]
        assert "Two trainers must not write one checkpoint directory" in refused
        assert "resuming from" not in refused and "checkpoint results" not in refused, refused[-4000:]
    finally:
        resumed = time.time()
        subprocess.run(["scontrol", "resume", orphan], env=env)
    # the user cancels a job that runs: the orphan trains again (a checkpoint after the resume). A
    # `scancel` a few ms after `scontrol resume` once reached neither rank: slurmd (22.05) ended the
    # batch step (srun with it) and never signalled the step, so no SIGTERM checkpoint, lease left behind
    _job_mid_training(cluster, work, None, _attempt_logs(work, "pretrain")[before], "pretrain_model",
                      "pretrain", resumed, timeout=180)
    subprocess.run(["scancel", orphan], env=env, check=True)          # the advice, followed
    deadline = time.time() + 120
    while time.time() < deadline and subprocess.run(["squeue", "-h", "-j", orphan], env=env, capture_output=True,
                                                    text=True).stdout.strip():
        time.sleep(1)
    final = snakemake_slurm(cluster, work, cfgfile, target)
    assert final.returncode == 0, (final.stdout + final.stderr)[-6000:]
    attempts = _attempt_logs(work, "pretrain")[before:]
    assert len(attempts) == 3, attempts                  # the orphan, the refused one, the resumed one
    orphan_log = attempts[0].read_text()
    assert "pretrain: world 2" in orphan_log            # the first job's log is kept
    step = _signal_step(orphan_log, "SIGTERM")          # scancel: SIGTERM, then the checkpoint
    assert step and _resumed_from(attempts[2]) == [step], (orphan_log[-3000:], attempts[2].read_text()[-3000:])
    _steps_lost("scancel of the orphaned pretraining job", attempts[0], attempts[2], _steps_per_epoch(orphan_log))
    jobs = subprocess.run(["sacct", "-X", "-n", "-P", "-S", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
                           "-o", "JobID,Comment"], env=env, capture_output=True, text=True).stdout.splitlines()
    pretrain_jobs = [j for j in jobs if j.endswith("|rule_pretrain_model")]
    assert len(pretrain_jobs) == 3, pretrain_jobs       # the orphan, the hooks-off one, the resumed one
    assert not (work / "results/pretrain/checkpoints/lease.json").exists()


# ------------------------------------------------------------------ a stall (issue 48)
def _loader_worker(job: str) -> int | None:
    """A loader worker of SLURM job ``job``: a child of a rank's fork server (chexflow.data.workers)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "forkserver" in " ".join(proc.info["cmdline"] or []) and proc.environ().get("SLURM_JOB_ID") == job \
                    and "forkserver" in " ".join(proc.parent().cmdline()):
                return proc.pid
        except (psutil.Error, AttributeError):
            continue
    return None


def test_a_stalled_training_job_is_ended_by_its_watchdog_resubmitted_and_the_workflow_reaches_the_report(
        slurm_demo):
    """A loader worker of fine-tuning stopped (SIGSTOP) after the job's first checkpoint: the job would
    hold its nodes until the time limit. Its rank's watchdog ends it within its bound (exit 14, one line
    naming the worker, the stacks in the log), the profile's retry resubmits it, it resumes from the
    checkpoint, and the workflow runs through to the report unattended."""
    cluster, work, cfg, cfgfile, _ = slurm_demo
    variant = yaml.safe_load(cfgfile.read_text())      # the tests before left their pretraining: not run again
    variant["finetune"]["seed"] = cfg["finetune"]["seed"] + 3          # a run of its own
    variant["finetune"]["checkpoint"] = {"every_steps": 5}
    variant["finetune"]["check_every_steps"] = 2
    variant["watchdog"] = {"floor_s": 30, "factor": 10, "start_s": 600}    # margin for an epoch end's writes
    cfgfile.write_text(yaml.safe_dump(variant))
    report = work / "results/report/chexflow_report.html"
    report_mtime = report.stat().st_mtime
    before = len(_attempt_logs(work, "finetune"))
    t0 = time.time()
    proc, log = _start_snakemake(cluster, work, cfgfile, "--retries", "1")
    job = _job_mid_training(cluster, work, proc, log, "finetune_model", "finetune", t0)
    deadline = time.time() + 60
    while (worker := _loader_worker(job)) is None and time.time() < deadline:
        time.sleep(0.2)
    assert worker, f"job {job}: no loader worker found"
    os.kill(worker, signal.SIGSTOP)
    assert proc.wait(timeout=1500) == 0, "stall: " + log.read_text()[-6000:]
    attempts = _attempt_logs(work, "finetune")[before:]
    assert len(attempts) == 2, f"stall: {attempts}"         # the stalled one, the resubmitted one
    stalled, resumed = (p.read_text() for p in attempts)
    assert re.search(rf"chexflow train: rank \d of 2 \(pid \d+\): no progress for \d+ s in (training|validation) "
                     rf"\(bound \d+ s: .*\): waiting for loader worker pid {worker} ", stalled), stalled[-4000:]
    assert "every thread's stack" in stalled and "Traceback (most recent call last)" not in stalled, stalled[-4000:]
    # the job failed (srun's own status: it stopped the other rank, --kill-on-bad-exit), so the retry came
    state = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], env=cluster.env,
                           capture_output=True, text=True).stdout.split()
    assert state == ["FAILED"], f"stall: job {job} {state}"
    assert _resumed_from(attempts[1]), "stall: the resubmitted job did not resume: " + resumed[-3000:]
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert report.stat().st_mtime > report_mtime, "stall: the report was not made again"
