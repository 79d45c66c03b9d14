"""Steps lost when a node really dies under multi-node pretraining, on the local SLURM cluster.

The SLURM tests set a node down with its slurmd still running, so SLURM still signals the job's
processes there and the trainer checkpoints (nothing lost). A node that dies gives its rank no
signal: this kills the ranks on the job's last node (SIGKILL) and sets the node down at once, as a
power loss would; SLURM records NODE_FAIL and requeues the job, which resumes from the last
periodic checkpoint. Prints the furthest step the first attempt reached (its checkpoint lines and
progress bar) and the step the requeued run resumed at.

    tests/slurm_cluster/cluster.sh start
    python bench/slurm_node_death.py WORKDIR    # WORKDIR: a finished demo run (its data/ is reused)

The pretraining section of WORKDIR/config.yaml gets another seed (a fresh run), checks every 2
steps and a periodic checkpoint every ``--every-steps``; the kill comes ``--after`` seconds past the
first periodic checkpoint. Results: BENCHMARKS.md (steps lost per fault; bench/benchmarks-log.md).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def cluster_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    out = subprocess.run([str(REPO / "tests/slurm_cluster/cluster.sh"), "env"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if m:
            env[m.group(1)] = m.group(2)
    return env


def run(cmd: list[str], env: dict) -> str:
    return subprocess.run(cmd, env=env, capture_output=True, text=True).stdout


def ranks_on(job: str, node: str) -> list[int]:
    """PIDs of the job's `chexflow train` processes on emulated node ``node`` (all nodes share this host)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            raw = (d / "environ").read_bytes().decode(errors="replace")
            env = dict(x.split("=", 1) for x in raw.split("\0") if "=" in x)
            cmdline = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, NotADirectoryError):
            continue
        if env.get("SLURM_JOB_ID") == job and env.get("SLURMD_NODENAME") == node and "train" in cmdline \
                and any(c.endswith("chexflow") for c in cmdline):
            pids.append(int(d.name))
    return pids


def last_step(text: str, steps_per_epoch: int) -> int:
    steps = [int(n) for n in re.findall(r"\(step (\d+)\)", text)]
    bars = re.findall(r"epoch (\d+)/\d+: +\d+%\|[^|]*\| *(\d+)/", text)     # tqdm, every 5 s
    steps += [(int(e) - 1) * steps_per_epoch + int(k) for e, k in bars]
    return max(steps, default=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--every-steps", type=int, default=10)
    ap.add_argument("--after", type=float, default=6.0, help="seconds past the first periodic checkpoint")
    ap.add_argument("--seed", type=int, default=21)
    args = ap.parse_args()
    work, env = args.workdir.resolve(), cluster_env()
    cfg = yaml.safe_load((work / "config.yaml").read_text())
    cfg["pretrain"].update(seed=args.seed, check_every_steps=2)
    cfg["pretrain"]["checkpoint"].update(every_steps=args.every_steps)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    shutil.rmtree(work / "logs/pretrain", ignore_errors=True)
    cmd = [sys.executable, "-m", "snakemake", "results/pretrain/model.pt", "-s", str(REPO / "Snakefile"),
           "-d", str(work), "--profile", str(REPO / "profiles/slurm"),
           "--workflow-profile", str(REPO / "tests/slurm_cluster/ci-overlay"),
           "--configfile", str(work / "config.yaml")]
    log = open(work / "node-death.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    ckpts, t0, job = work / "results/pretrain/checkpoints", time.time(), None
    while proc.poll() is None:
        for line in run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %k %N"], env).splitlines():
            if "rule_pretrain_model" in line:
                job, _, nodes = line.split()
        fresh = [p for p in ckpts.glob("step-*.pt") if p.stat().st_mtime > t0] if ckpts.is_dir() else []
        if job and fresh:
            break
        time.sleep(0.5)
    time.sleep(args.after)
    victim = run(["scontrol", "show", "hostnames", nodes], env).split()[-1]
    pids = ranks_on(job, victim)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    subprocess.run(["scontrol", "update", f"nodename={victim}", "state=down", "reason=node death (bench)"], env=env)
    print(f"job {job} on {nodes}: killed the ranks on {victim} (pids {pids}) and set it down", flush=True)
    for _ in range(240):            # a requeued job waits ~2 min (BeginTime): start it now
        if "BeginTime" in run(["squeue", "-h", "-j", job, "-o", "%T %r"], env):
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env)
            break
        time.sleep(0.5)
    code = proc.wait()
    subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], env=env, capture_output=True)
    rows = run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State"], env).split()
    print("snakemake exit", code, "| job rows:", rows)
    logs = sorted((work / "logs/pretrain").glob("train.*.log"), key=lambda p: int(p.name.split(".")[1]))
    first, second = logs[0].read_text(), logs[-1].read_text()
    spe = int(re.search(r"(\d+) steps/epoch", first).group(1))
    reached = last_step(first, spe)
    resumed = int(re.search(r"resuming from \S+ at step (\d+)", second).group(1))
    print(f"first attempt reached step {reached} (at least), the requeued run resumed at {resumed}: "
          f"{reached - resumed} steps lost (checkpoint.every_steps {args.every_steps})")
    return code


if __name__ == "__main__":
    sys.exit(main())
