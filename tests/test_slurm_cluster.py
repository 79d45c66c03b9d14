"""Tests against a real local SLURM cluster started by tests/slurm_cluster/cluster.sh.

The cluster (3 emulated nodes x 2 fake GPUs, partitions cpu/gpu, slurmdbd accounting) is
started once per session and left running if it was already up; it is stopped at the end
only when this session started it.  Needs root (daemons, apt-get); skipped otherwise.

    pytest -m slurm tests/test_slurm_cluster.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import cli_env

# starting the local cluster takes ~40 s: the whole module is in the slow tier
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SH = REPO / "tests" / "slurm_cluster" / "cluster.sh"
PROFILE = REPO / "profiles" / "slurm"
CI_OVERLAY = REPO / "tests" / "slurm_cluster" / "ci-overlay"
# Snakemake with the SLURM plugin checking its jobs every 2 s (the module says why): the tests' runs on the cluster
SNAKEMAKE_ON_SLURM = [sys.executable, str(REPO / "tests" / "slurm_cluster" / "snakemake_polling.py")]
NODES = {"node1", "node2", "node3"}
ACCOUNT = "chexflow"

# prints rank, node, visible GPUs and partition of the rank it runs in
RANK_INFO_PY = """\
import os
keys = ("SLURM_PROCID", "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_PARTITION")
print("RANK", *(os.environ.get(k) or "-" for k in keys), flush=True)
"""

MPI_HELLO_C = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
  int rank, size, sum = 0;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  const char *node = getenv("SLURMD_NODENAME");
  printf("MPI rank=%d size=%d sum=%d node=%s\n", rank, size, sum, node ? node : "-");
  MPI_Finalize();
  return 0;
}
"""

# Tiny workflow using real chexflow rule names, so the CI overlay's resources apply as is.
# The jobs are independent (one round of submissions keeps the test short).
SNAKEFILE = """\
localrules: all

rule all:
    input: "gather.txt", "write_shards.txt", "pretrain.txt", "finetune.txt"

rule gather_shards:
    output: "gather.txt"
    shell: "echo $SLURM_JOB_PARTITION $SLURMD_NODENAME > {output}"

rule write_shards:
    output: "write_shards.txt"
    shell: "echo $SLURM_CPUS_PER_TASK > {output}"

rule pretrain_model:
    output: "pretrain.txt"
    resources: tasks=99, mpi="false"   # replaced by the profile
    shell: "{resources.mpi} -n {resources.tasks} python3 rank_info.py > {output}"

rule finetune_model:
    output: "finetune.txt"
    resources: tasks=99, mpi="false"   # replaced by the profile
    shell: "{resources.mpi} -n {resources.tasks} python3 rank_info.py > {output}"
"""


def _write_workflow(directory: Path) -> Path:
    (directory / "rank_info.py").write_text(RANK_INFO_PY)
    snakefile = directory / "Snakefile"
    snakefile.write_text(SNAKEFILE)
    return snakefile


@dataclass(frozen=True)
class Cluster:
    """A running local cluster and the environment its clients need."""

    env: dict[str, str]


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True,
                          text=True, check=False)


def _checked(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (
        f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc.stdout


def _client_env(exports: str) -> dict[str, str]:
    """os.environ without SLURM job variables, plus `cluster.sh env`'s exports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    for line in exports.splitlines():
        match = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if match:
            env[match.group(1)] = match.group(2)
    return env


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (starts munged/slurmctld/slurmd, "
                    "may apt-get install); run pytest as root")
    was_running = _run([str(CLUSTER_SH), "status"]).returncode == 0
    _checked(_run([str(CLUSTER_SH), "start"], timeout=600))
    yield Cluster(env=_client_env(_checked(_run([str(CLUSTER_SH), "env"]))))
    if not was_running:
        _run([str(CLUSTER_SH), "stop"], timeout=120)


def _rank_lines(text: str) -> list[tuple[int, str, str, str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("RANK "):
            _, rank, node, gpus, partition = line.split()
            rows.append((int(rank), node, gpus, partition))
    return sorted(rows)


# the states a job ends in (squeue(1), JOB STATE CODES); any other is on the way: SIGNALING too, which a
# job shows while slurmctld delivers its --signal (a list of the transient ones took it for the end)
JOB_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
             "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


def _sbatch_wait(cluster: Cluster, tmp_path: Path, script: str, *options: str,
                 timeout: float = 90) -> str:
    """Submit `script` with sbatch, wait until it finished, return the job's output."""
    (tmp_path / "job.sh").write_text("#!/bin/bash\nset -euo pipefail\n" + script)
    out = tmp_path / "job.out"
    job_id = _checked(_run(["sbatch", "--parsable", f"--output={out}", f"--chdir={tmp_path}",
                            *options, str(tmp_path / "job.sh")], env=cluster.env)).strip()
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:  # (sbatch --wait polls only every few seconds)
        info = _checked(_run(["scontrol", "show", "job", "-o", job_id], env=cluster.env))
        state = re.search(r"JobState=(\S+)", info).group(1)
        if state in JOB_ENDED:
            break
        time.sleep(0.25)
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", f"job {job_id} ended {state or 'never'}; output:\n{text}"
    return text


@pytest.mark.slurm
def test_sinfo_shows_three_nodes_in_cpu_and_gpu(slurm_cluster: Cluster) -> None:
    out = _checked(_run(["sinfo", "-h", "-N", "-o", "%N %P %t %G"], env=slurm_cluster.env))
    rows = [line.split() for line in out.splitlines()]
    by_partition: dict[str, set[str]] = {}
    for node, partition, _state, gres in rows:
        by_partition.setdefault(partition, set()).add(node)
        assert gres.startswith("gpu:2"), f"{node} should advertise 2 fake GPUs, has {gres}"
    assert by_partition == {"cpu*": NODES, "gpu": NODES}, out  # '*' marks the default


@pytest.mark.slurm
def test_sbatch_two_nodes_one_gpu_per_rank(slurm_cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "rank_info.py").write_text(RANK_INFO_PY)
    text = _sbatch_wait(slurm_cluster, tmp_path,
                        "srun --mpi=pmix -n 2 python3 rank_info.py\n",
                        "--partition=gpu", "--nodes=2", "--ntasks=2", "--gpus-per-task=1",
                        "--mem-per-cpu=200", "--time=2")
    ranks = _rank_lines(text)
    assert [r[0] for r in ranks] == [0, 1], text
    assert len({r[1] for r in ranks}) == 2 and {r[1] for r in ranks} <= NODES, text
    for _rank, _node, gpus, partition in ranks:
        assert re.fullmatch(r"\d", gpus), f"each rank must see exactly one GPU: {text}"
        assert partition == "gpu"


@pytest.mark.slurm
def test_openmpi_program_across_emulated_nodes(slurm_cluster: Cluster, tmp_path: Path) -> None:
    if shutil.which("mpicc") is None:
        pytest.skip("mpicc not installed (apt-get install libopenmpi-dev openmpi-bin)")
    (tmp_path / "hello.c").write_text(MPI_HELLO_C)
    _checked(_run(["mpicc", "-o", str(tmp_path / "hello"), str(tmp_path / "hello.c")]))
    text = _sbatch_wait(slurm_cluster, tmp_path, f"srun --mpi=pmix -n 2 {tmp_path / 'hello'}\n",
                        "--partition=gpu", "--nodes=2", "--ntasks=2", "--gpus-per-task=1",
                        "--mem-per-cpu=200", "--time=2")
    lines = sorted(line for line in text.splitlines() if line.startswith("MPI "))
    assert len(lines) == 2, text
    assert all("size=2 sum=1" in line for line in lines), text  # Allreduce worked
    assert len({line.rsplit("node=", 1)[1] for line in lines}) == 2, text


@pytest.mark.slurm
@pytest.mark.slow
def test_warning_signal_reaches_srun_ranks(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """--signal=USR1@T (no 'B:'), as in the profile's slurm_extra, reaches srun'd ranks.

    @60 with a 1-minute limit makes the signal due at once; slurmctld sends due signals
    from its 30 s periodic time-limit check, so it arrives within ~30 s.
    """
    trap = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: (print('USR1', os.environ['SLURM_PROCID'],"
            " flush=True), sys.exit(0)))\n"
            "time.sleep(100)\n")
    (tmp_path / "trap.py").write_text(trap)
    start = time.monotonic()
    text = _sbatch_wait(slurm_cluster, tmp_path, f"srun -n 2 python3 {tmp_path / 'trap.py'}\n",
                        "--partition=gpu", "--nodes=2", "--ntasks=2", "--mem-per-cpu=200",
                        "--time=1", "--signal=USR1@60")
    assert sorted(text.split()) == ["0", "1", "USR1", "USR1"], text
    assert time.monotonic() - start < 60, "signal arrived only at the time limit"


def _sacct_rows(env: dict[str, str], run_id: str, n_expected: int) -> list[dict[str, str]]:
    """Allocation rows of one snakemake run; waits until slurmdbd has all of them."""
    fields = ["JobID", "Comment", "Partition", "AllocCPUS", "AllocTRES", "NNodes", "State"]
    deadline = time.monotonic() + 30
    while True:
        out = _checked(_run(["sacct", "-X", "-P", "-n", "--name", run_id,
                             "--format=" + ",".join(fields)], env=env))
        rows = [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line]
        complete = [r for r in rows if r["Comment"] and r["Partition"] and r["State"] == "COMPLETED"]
        if len(complete) >= n_expected or time.monotonic() > deadline:
            return rows
        time.sleep(1)


@pytest.mark.slurm
@pytest.mark.slow
def test_snakemake_workflow_with_ci_overlay(slurm_cluster: Cluster, tmp_path: Path) -> None:
    snakefile = _write_workflow(tmp_path)
    proc = _run([*SNAKEMAKE_ON_SLURM, "--snakefile", str(snakefile),
                 "--profile", str(PROFILE), "--workflow-profile", str(CI_OVERLAY), "--verbose"],
                env=slurm_cluster.env, cwd=tmp_path, timeout=170)
    log = proc.stdout + proc.stderr
    (tmp_path / "snakemake.log").write_text(log)
    assert proc.returncode == 0, f"snakemake failed (log: {tmp_path / 'snakemake.log'}):\n{log[-6000:]}"

    # pretrain: 2 ranks on 2 different nodes, one fake GPU each; finetune: 2 ranks, 1 node
    pre = _rank_lines((tmp_path / "pretrain.txt").read_text())
    assert [r[0] for r in pre] == [0, 1] and len({r[1] for r in pre}) == 2, pre
    assert all(re.fullmatch(r"\d", r[2]) for r in pre), pre
    fine = _rank_lines((tmp_path / "finetune.txt").read_text())
    assert [r[0] for r in fine] == [0, 1] and len({r[1] for r in fine}) == 1, fine
    assert sorted(r[2] for r in fine) == ["0", "1"], fine
    assert (tmp_path / "write_shards.txt").read_text().split() == ["2"]  # set-threads -> cpus

    # the exact sbatch line for the multi-node GPU rule
    sbatch = next(line for line in log.splitlines()
                  if "sbatch call:" in line and "--comment rule_pretrain_model" in line)
    for option in ("-A chexflow", "-p gpu", "--mem-per-cpu 500", "--nodes=2", "--requeue",
                   "--ntasks-per-gpu=1", "--ntasks=2", "--cpus-per-task=1",
                   "--signal=USR1@300", "--gpus=2"):
        assert f" {option} " in sbatch, f"{option!r} missing in: {sbatch[:600]}"

    # each rule ran on the partition the overlay names (checked in slurmdbd via sacct)
    overlay = yaml.safe_load((CI_OVERLAY / "profile.yaml").read_text())
    default_partition = overlay["default-resources"]["slurm_partition"]
    expected = {rule: overlay["set-resources"].get(rule, {}).get("slurm_partition",
                                                                 default_partition)
                for rule in ("gather_shards", "write_shards", "pretrain_model", "finetune_model")}
    run_id = re.search(r"SLURM run ID: (\S+)", log).group(1)
    rows = _sacct_rows(slurm_cluster.env, run_id, len(expected))
    ran_on = {r["Comment"].removeprefix("rule_"): r["Partition"] for r in rows}
    assert ran_on == expected, rows
    assert all(r["State"] == "COMPLETED" for r in rows), rows
    nodes = {r["Comment"]: r["NNodes"] for r in rows}
    assert nodes["rule_pretrain_model"] == "2" and nodes["rule_finetune_model"] == "1", rows
    assert all("gres/gpu=2" in r["AllocTRES"] for r in rows if r["Partition"] == "gpu"), rows
    assert list((tmp_path / "logs" / "slurm").glob("efficiency_report_*.csv")), \
        "the profile's --slurm-efficiency-report wrote nothing"


def test_production_profile_resolves_resources(tmp_path: Path) -> None:
    """Dry run: the production profile's anchors resolve to the intended resources."""
    snakefile = _write_workflow(tmp_path)
    proc = _run([sys.executable, "-m", "snakemake", "--snakefile", str(snakefile),
                 "--profile", str(PROFILE), "--workflow-profile", "none", "--dry-run",
                 "--executor", "local", "--cores", "8"], cwd=tmp_path, timeout=120)
    out = _checked(proc) + proc.stderr
    resources = dict(re.findall(r"rule (\w+):\n(?:.*\n)*?\s+resources: (.*)", out))
    pre = resources["pretrain_model"]
    for item in ("slurm_partition=gpu", "nodes=2", "gpu=8", "tasks=8", "tasks_per_gpu=1",
                 "cpus_per_task=8", "mem_mb_per_cpu=4000", "runtime=1440",
                 "mpi=srun --mpi=pmix --kill-on-bad-exit=1 --gpu-bind=single:1",
                 "slurm_extra=--signal=USR1@300"):
        assert item in pre, f"{item} not in pretrain_model resources: {pre}"
    assert "gpu_model" not in pre and "constraint" not in pre  # null site values: not passed
    assert "slurm_partition=cpu" in resources["gather_shards"]
    assert "cpus_per_task=8" in resources["write_shards"]  # set-threads 8 -> cpus_per_task


def _dry_run_resources(tmp_path: Path, *args: str) -> dict[str, str]:
    """Each rule's resources in a dry run of the tiny workflow with the production profile and ``args``."""
    tmp_path.mkdir()
    snakefile = _write_workflow(tmp_path)
    proc = _run([sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--profile", str(PROFILE),
                 *args, "--workflow-profile", "none", "--dry-run", "--executor", "local", "--cores", "8"],
                env=cli_env(), cwd=tmp_path, timeout=120)       # the overlay imports this checkout's chexflow
    out = _checked(proc) + proc.stderr
    return dict(re.findall(r"rule (\w+):\n(?:.*\n)*?\s+resources: (.*)", out))


def test_overlay_profile_changes_one_rule_resource_and_keeps_the_rest(tmp_path: Path) -> None:
    """Issue 18.5: `--set-resources pretrain_model:runtime=1` replaces the profile's whole
    set-resources (pretraining then runs on the CPU partition, one task, no warning signal);
    profiles/slurm-overrides merges instead: its one `changes:` line changes one key of one rule."""
    intact = ("slurm_partition=gpu", "nodes=2", "tasks=8", "gpu=8", "cpus_per_task=8", "mem_mb_per_cpu=4000",
              "mpi=srun --mpi=pmix", "slurm_extra=--signal=USR1@300")
    cli = _dry_run_resources(tmp_path / "cli", "--set-resources", "pretrain_model:runtime=1")
    assert "runtime=1," in cli["pretrain_model"]
    assert not any(item in cli["pretrain_model"] for item in intact), cli["pretrain_model"]   # Snakemake's way

    overlay = tmp_path / "my-overrides"
    overlay.mkdir()
    text = (REPO / "profiles/slurm-overrides/profile.yaml").read_text()
    line = "    pretrain_model: {runtime: 1440}"
    assert text.count(line) == 1
    (overlay / "profile.yaml").write_text(text.replace(line, "    pretrain_model: {runtime: 1}"))
    merged = _dry_run_resources(tmp_path / "overlay", "--profile", str(overlay))
    assert "runtime=1," in merged["pretrain_model"], merged["pretrain_model"]
    for item in intact:
        assert item in merged["pretrain_model"], f"{item} lost: {merged['pretrain_model']}"
    reference = _dry_run_resources(tmp_path / "reference")
    items = {rule: set(text.split(", ")) for rule, text in merged.items()}
    for rule in ("finetune_model", "gather_shards", "write_shards"):
        assert items[rule] == set(reference[rule].split(", ")), rule
    assert items["pretrain_model"] == set(reference["pretrain_model"].replace("runtime=1440", "runtime=1").split(", "))


@pytest.mark.slurm
@pytest.mark.slow
def test_node_failure_of_a_requeued_job_excludes_the_failed_node_not_none_assigned(slurm_cluster: Cluster,
                                                                                   tmp_path: Path) -> None:
    """Issue 18.3 at the plugin's level: a 2-node job with --requeue, one node set down. By the time
    snakemake-executor-plugin-slurm 2.8.0 asks `sacct -X` for the failed job's nodes, SLURM has
    requeued it and the answer is "None assigned", which the plugin put into every later sbatch as
    `--exclude=None assigned`. The patched lookup (chexflow_install.slurm_plugin) reads the failed
    run's row (`sacct -D`) and excludes exactly the node SLURM reports unusable."""
    from chexflow_install import slurm_plugin
    import snakemake_executor_plugin_slurm as plugin
    env = slurm_cluster.env
    (tmp_path / "job.sh").write_text("#!/bin/bash\nsrun -n 2 sleep 300\n")
    job = _checked(_run(["sbatch", "--parsable", "--requeue", "-p", "gpu", "-N", "2", "-n", "2", "--mem-per-cpu=100",
                         "-t", "5", f"--output={tmp_path / 'job.out'}", str(tmp_path / "job.sh")], env=env)).strip()
    victim = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            nodes = _checked(_run(["squeue", "-h", "-j", job, "-t", "RUNNING", "-o", "%N"], env=env)).strip()
            if nodes:
                break
            time.sleep(0.5)
        assert nodes, f"job {job} never ran"
        victim = _checked(_run(["scontrol", "show", "hostnames", nodes], env=env)).split()[-1]
        _checked(_run(["scontrol", "update", f"nodename={victim}", "state=down", "reason=chexflow test"], env=env))
        query = slurm_plugin.ORIGINAL.split('f"', 1)[1].split('"', 1)[0].replace("{j.external_jobid}", job)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:      # the plugin's own query, once SLURM has requeued the job
            seen = _checked(_run(query.split(), env=env)).strip()
            if seen == "None assigned":
                break
            time.sleep(0.5)
        assert seen == "None assigned", f"2.8.0's query answered {seen!r}"
        # the node stays unusable (drained) while the patched lookup runs; SLURM let it back in before
        _checked(_run(["scontrol", "update", f"nodename={victim}", "state=drain", "reason=chexflow test"], env=env))
        assert plugin._chexflow_failed_nodes(job) == {victim}
        _checked(_run(["scontrol", "update", f"nodename={victim}", "state=resume"], env=env))
        victim = None
        deadline = time.monotonic() + 60       # (it answers SLURM's ping again within seconds)
        while plugin._chexflow_failed_nodes(job) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert plugin._chexflow_failed_nodes(job) == set(), "a node back in service is not excluded"
    finally:
        _run(["scancel", job], env=env)
        if victim:
            _run(["scontrol", "update", f"nodename={victim}", "state=resume"], env=env)
