"""Faults a cluster delivers, reproduced on one machine with real processes (issue 18; the same
scenarios on the real SLURM cluster are in test_slurm_workflow.py):

* SIGTERM to every process of a training (what SLURM does at a requeue or the time limit) with
  loader workers on: the trainer, not a worker, decides, and its checkpoint is the resume step;
* a signal that arrives before training starts (SLURM's USR1 warning "at once") is caught, not
  fatal, and honoured at the first step;
* one trainer per checkpoint directory (the lease): a second one is refused naming the holder, a
  dead holder's lease is taken over and logged, an unreadable one is not trusted, a lost one stops
  its holder;
* every attempt's log is kept; a workflow rerun names training left running instead of starting
  it again.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chexflow.fsutil import link_numbered
from chexflow.train import checkpoint as ckpt
from chexflow.train import lease
from conftest import REPO, checkpoint_step, cli_env, horovod_available, loader_workers, snakemake

EXIT_PREEMPTED = 143


def train_cmd(manifest: Path, work: Path, **over) -> list[str]:
    """`chexflow train` of one process (backend single) with loader workers on."""
    cfg = {"stage": "finetune", "dataset": "nih_demo", "backend": "single", "epochs": 4, "batch_size": 2,
           "seed": 5, "init": "random", "data": {"crop": 32, "workers": 2, "shuffle_buffer": 16},
           "optim": {"name": "sgd", "lr": 0.05, "reference_batch": 16}, "check_every_steps": 20,
           "checkpoint": {"every_steps": 1000, "keep": 2, "lease_wait_s": 0}}
    for k, v in over.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and k in cfg else v
    return [sys.executable, "-m", "chexflow", "train", "--config-json", json.dumps(cfg), "--manifest", str(manifest),
            "--out-dir", str(work / "out"), "--ckpt-dir", str(work / "ckpt")]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """In a session of its own, so that the test can signal every process of it, as SLURM does."""
    return subprocess.Popen(cmd, env=cli_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(predicate, proc: subprocess.Popen, log: Path, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n" + log.read_text()[-3000:]
        assert time.time() < deadline, f"no {what} within {timeout} s:\n" + log.read_text()[-3000:]
        time.sleep(0.05)


def catches(pid: int, sig: int) -> bool:
    """Has process ``pid`` a handler for ``sig`` (its SigCgt mask)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask >> (sig - 1) & 1)


def signal_step(log: str, name: str) -> int:
    return int(re.search(rf"{name} received: checkpoint written at step (\d+)", log).group(1))


def resumed_at(log: str) -> int:
    return int(re.search(r"resuming from \S+ at step (\d+)", log).group(1))


# ------------------------------------------------------------------------------------ signals

@pytest.mark.slow
def test_sigterm_to_every_process_with_loader_workers_checkpoints_and_resumes(demo_manifest, tmp_path):
    """Was: `RuntimeError: DataLoader worker (pid ...) is killed by signal: Terminated.` and no
    checkpoint (issue 18.1). Now the workers leave SIGTERM to the trainer, which writes its
    checkpoint at the next check, stops its workers and exits 143; the rerun resumes at that step."""
    cmd = train_cmd(demo_manifest, tmp_path)
    log = tmp_path / "first.log"
    proc = start(cmd, log)
    # mid-epoch 2, with the epoch's workers running (80 steps per epoch, checks every 20)
    wait_for(lambda: "epoch 2/4" in log.read_text(), proc, log, "epoch 2")
    time.sleep(2)
    workers = loader_workers(proc.pid)
    # the loaders' workers live for the run: 2 serving training, 2 validation (idle mid-epoch)
    assert len(workers) == 4, f"expected 2 training and 2 validation loader workers, found {workers}"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED, log.read_text()[-3000:]
    first = log.read_text()
    assert "killed by signal" not in first, first[-3000:]
    step = signal_step(first, "SIGTERM")
    assert step > 80 and step % 20 == 0, first[-3000:]         # in epoch 2, at a check
    assert checkpoint_step(ckpt.list_checkpoints(tmp_path / "ckpt")[-1]) == step
    assert not (tmp_path / "out" / "model.pt").exists()
    second = tmp_path / "second.log"
    assert subprocess.run(cmd, env=cli_env(), stdout=open(second, "w"), stderr=subprocess.STDOUT,
                          timeout=600).returncode == 0, second.read_text()[-3000:]
    assert resumed_at(second.read_text()) == step                # nothing lost
    hist = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_signal_before_training_starts_is_honoured_at_the_first_step(demo_manifest, tmp_path, sig):
    """Was: the handler went in after torch was imported (8 s on a busy node): SLURM's USR1 sent "at
    once" (time limit < the 300 s warning) killed both ranks (issue 18.2). Now it is caught from the
    start of `chexflow train` and acted on at the first step: USR1 checkpoints and training goes on,
    TERM checkpoints and ends the run for the retry. (Checks otherwise only every 1000 steps.)"""
    cmd = train_cmd(demo_manifest, tmp_path, epochs=1, check_every_steps=1000)
    log = tmp_path / "run.log"
    proc = start(cmd, log)
    wait_for(lambda: catches(proc.pid, sig), proc, log, f"a {sig.name} handler", timeout=60)
    os.kill(proc.pid, sig)
    code = proc.wait(timeout=600)
    text = log.read_text()
    assert signal_step(text, sig.name) == 1, text[-3000:]
    if sig == signal.SIGUSR1:
        assert code == 0 and "continuing" in text, text[-3000:]
        assert (tmp_path / "out" / "model.pt").exists()
    else:
        assert code == EXIT_PREEMPTED, text[-3000:]
        assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "ckpt")] == [1]


# ------------------------------------------------------------------------------------ the lease

HOLD_PY = """\
import sys, time
from chexflow.train import lease
held = lease.acquire(sys.argv[1], wait_s=0, stale_s=10, log=print)
print("HELD", flush=True)
time.sleep(600)
"""


def hold(ckpt_dir: Path) -> subprocess.Popen:
    """Another process holding ``ckpt_dir``'s lease (the real lease code), until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_PY, str(ckpt_dir)], env=cli_env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "HELD"
    return proc


@pytest.mark.slow
def test_second_trainer_is_refused_naming_the_holder_then_takes_over_when_it_died(demo_manifest, tmp_path):
    holder = hold(tmp_path / "ckpt")
    try:
        cmd = train_cmd(demo_manifest, tmp_path, epochs=1, batch_size=8)
        refused = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert refused.returncode == lease.EXIT_LEASE_HELD, refused.stderr[-3000:]
        assert f"host {socket.gethostname()}, pid {holder.pid}" in refused.stderr, refused.stderr[-3000:]
        assert f"kill {holder.pid}" in refused.stderr                 # what to do about it
        assert not ckpt.list_checkpoints(tmp_path / "ckpt"), "a refused trainer must not write"
        assert not (tmp_path / "out").exists()
    finally:
        holder.kill()                                                 # dies holding it: no release
        holder.wait()
    assert (tmp_path / "ckpt" / lease.LEASE_NAME).exists()
    taken = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert re.search(rf"taking over the lease \S+ \(host \S+, pid {holder.pid}, .*\): process {holder.pid} on this "
                     "host is gone", taken.stderr), taken.stderr[-3000:]
    assert (tmp_path / "out" / "model.pt").exists()
    assert not (tmp_path / "ckpt" / lease.LEASE_NAME).exists(), "released at the end"


def test_lease_waits_for_a_holder_that_ends(tmp_path):
    holder = hold(tmp_path)
    logged = []
    t0 = time.monotonic()
    killer = subprocess.Popen(["sh", "-c", f"sleep 1; kill {holder.pid}"])
    held = lease.acquire(tmp_path, wait_s=60, stale_s=10, log=logged.append, poll_s=0.2)
    killer.wait()
    holder.wait()
    try:
        assert time.monotonic() - t0 < 60
        assert any("in use" in m and "waiting up to 60 s" in m for m in logged), logged
        assert any(f"process {holder.pid} on this host is gone" in m for m in logged), logged
        assert lease.read_holder(tmp_path / lease.LEASE_NAME).pid == os.getpid()
    finally:
        held.release()


def test_lease_heartbeat_renews_and_a_lost_lease_stops_its_holder(tmp_path):
    lost = []
    held = lease.acquire(tmp_path, wait_s=0, stale_s=10, on_lost=lost.append)     # heartbeat every 1 s
    path = tmp_path / lease.LEASE_NAME
    os.utime(path, (time.time() - 100, time.time() - 100))
    deadline = time.time() + 30
    while time.time() - path.stat().st_mtime > 50 and time.time() < deadline:
        time.sleep(0.1)
    assert time.time() - path.stat().st_mtime < 50, "the heartbeat did not renew the lease"
    # another trainer judged it stale and took over: the holder learns it at its next beat
    other = json.loads(path.read_text()) | {"token": "someone-else", "pid": 1, "host": "elsewhere"}
    path.write_text(json.dumps(other))
    while not lost and time.time() < deadline:
        time.sleep(0.1)
    assert lost and "another trainer took over" in lost[0] and "host elsewhere, pid 1" in lost[0], lost
    held.release()
    assert json.loads(path.read_text())["token"] == "someone-else", "release must not remove the new holder's lease"


def test_holder_on_another_host_without_slurm_is_judged_by_its_heartbeat(tmp_path):
    other = lease.Holder(host="node-elsewhere", pid=4242, pid_started=None, slurm_job_id=None, token="t",
                         since=time.time())
    assert lease.holder_alive(other, 30, stale_s=600) == (True, "heartbeat 30 s ago")
    alive, why = lease.holder_alive(other, 601, stale_s=600)
    assert not alive and why == "no heartbeat for 601 s (more than 600 s)"
    # a requeued job's new run meets the lease of its earlier run (same SLURM job, another node)
    me = lease.Holder.this_process()
    earlier = lease.Holder(host="node-elsewhere", pid=4242, pid_started=None, slurm_job_id="88", token="t", since=0)
    assert lease.holder_alive(earlier, 5, stale_s=600, me=lease.Holder(**{**me.__dict__, "slurm_job_id": "88"})) == (
        False, "an earlier run of this SLURM job 88 (requeued) held it")


@pytest.mark.parametrize("content", [b"{not json", b'{"host": "x"}', b"[1, 2]", b"x" * (lease.MAX_BYTES + 1)],
                         ids=["not-json", "missing-keys", "not-object", "too-big"])
def test_unreadable_lease_is_refused_while_fresh_and_replaced_when_old(tmp_path, content):
    path = tmp_path / lease.LEASE_NAME
    path.write_bytes(content)
    with pytest.raises(lease.LeaseHeld, match=rf"{re.escape(str(path))}: .*not a chexflow lease"):
        lease.acquire(tmp_path, wait_s=0, stale_s=60, log=lambda m: None)
    os.utime(path, (time.time() - 120, time.time() - 120))
    logged = []
    held = lease.acquire(tmp_path, wait_s=0, stale_s=60, log=logged.append)
    assert logged and "taking over the lease" in logged[0] and "unreadable" in logged[0], logged
    assert lease.read_holder(path).token == held.holder.token
    held.release()
    assert not path.exists()


def test_two_takers_of_one_stale_lease_one_wins(tmp_path):
    """Both judged the dead holder's lease stale at once: the rename moves it for one of them; the
    other finds the winner's new lease and is refused (it must not remove it)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / lease.LEASE_NAME
    record = {"host": socket.gethostname(), "pid": int(dead.stdout), "pid_started": None, "slurm_job_id": None,
              "token": "dead", "since": 0}
    path.write_text(json.dumps(record))
    first = lease.acquire(tmp_path, wait_s=0, stale_s=60, log=lambda m: None)
    lease._remove_stale(path, "dead")            # the slower taker, still holding its stale judgement
    assert lease.read_holder(path).token == first.holder.token, "the winner's lease was removed"
    first.release()


# ------------------------------------------------------------------------------------ logs, rerun

def test_each_attempt_keeps_its_log(tmp_path):
    log = tmp_path / "logs" / "train.log"
    first = link_numbered(log)
    log.write_text("attempt 1\n")
    log.unlink()                                  # what Snakemake does before the next attempt
    second = link_numbered(log)
    with open(log, "w") as fh:                    # the shell's `> {log}`: same file, truncated
        fh.write("attempt 2\n")
    assert (first.name, second.name) == ("train.1.log", "train.2.log")
    assert first.read_text() == "attempt 1\n" and second.read_text() == "attempt 2\n"
    assert link_numbered(tmp_path / "logs" / "t000").name == "t000.1"


def test_rerun_names_training_left_running_and_submits_nothing(tmp_path):
    """Snakemake killed (-9), its training still running, `--unlock`, the same command again: the
    rerun stopped a second trainer only in the trainer itself; now it stops before submitting
    anything, naming the holder and what to do (issue 18.4; on SLURM: test_slurm_workflow.py)."""
    (tmp_path / "config.yaml").write_text((REPO / "config.yaml").read_text())
    orphan = subprocess.Popen(["sleep", "300"])
    try:
        record = {"host": socket.gethostname(), "pid": orphan.pid, "pid_started": None, "slurm_job_id": None,
                  "token": "t", "since": time.time()}
        (tmp_path / "results/pretrain/checkpoints").mkdir(parents=True)
        (tmp_path / "results/pretrain/checkpoints" / lease.LEASE_NAME).write_text(json.dumps(record))
        proc = snakemake(tmp_path, "results/pretrain/model.pt", timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert f"results/pretrain/checkpoints: host {socket.gethostname()}, pid {orphan.pid}" in out, out[-3000:]
        assert f"`kill {orphan.pid}`" in out
        assert not (tmp_path / "logs").exists() and not (tmp_path / "data").exists(), "a job ran"
    finally:
        orphan.kill()
        orphan.wait()
    assert lease.live_holders(tmp_path / "results", stale_s=600) == [], "its holder is gone: no objection"


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    pytest.param("horovod", marks=pytest.mark.skipif(not horovod_available(), reason="horovod not built")),
    "ddp"])
def test_a_checkpoint_directory_that_cannot_be_made_stops_every_rank_with_one_line(demo_manifest, tmp_path, backend):
    """Was: rank 0 failed making the lease (here: the checkpoint directory's path is a file) and left
    without telling the others; rank 1 waited in the broadcast and died with Horovod's traceback. Now
    rank 0 hands the error to every rank, and each ends with chexflow's one-line refusal (exit 11)."""
    (tmp_path / "ckpt").write_text("not a directory")
    cmd = train_cmd(demo_manifest, tmp_path, backend=backend, epochs=1, data={"workers": 0})
    launch = [sys.executable, "-m", "chexflow", "launch", "--backend", backend, "-n", "2", "--", *cmd]
    proc = subprocess.run(launch, env=cli_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert len(re.findall(r"chexflow train: " + re.escape(str(tmp_path / "ckpt")) + ": File exists", out)) >= 2, \
        out[-4000:]                                      # a line from each rank
    # no rank died otherwise (horovodrun and torchrun add their own traceback of the failed job: theirs only)
    assert not re.search(r'File "[^"]*/chexflow/', out) and "has been shut down" not in out, out[-4000:]
