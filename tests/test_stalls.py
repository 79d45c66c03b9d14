"""No job hangs (issue 48): loader workers that cannot inherit a held lock, and the stall watchdog that
turns any stall into one line, a stack dump and exit 14 within a bound the run derives from itself.

Every fault here is reached on progress (a checkpoint written, a worker started), never on an assumed
speed; the bound itself is the run's (``floor_s`` or ``factor`` x its slowest gap), so a slow host
only makes it longer.
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

import stall_helpers
from chexflow import errors, watchdog
from chexflow.data import workers
from chexflow.settings import ConfigError
from chexflow.train import checkpoint as ckpt
from conftest import checkpoint_step, cli_env, horovod_available, loader_workers
from test_faults import start, train_cmd, wait_for

EXIT_STALLED = 14
# the tests' bound: 30 s, or 10 x the run's slowest gap between two steps when that is longer (an epoch's end
# writes the best model and a checkpoint, tens of MB each: seconds on a slow disk, near a 10 s floor)
TEST_WATCHDOG = json.dumps({"start_s": 600, "floor_s": 30, "factor": 10})


# ------------------------------------------------------------------------ (a) the deadlock, on purpose
def _first_batch_with_the_lock_held_at_the_fork(**loader_args) -> list:
    """A thread holds stall_helpers.LOCK while the loader starts its worker, then lets it go; the worker's
    dataset takes the lock. ``timeout``: torch's own bound on waiting for a batch."""
    held, release = threading.Event(), threading.Event()

    def holder():
        with stall_helpers.LOCK:
            held.set()
            release.wait()

    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    loader = DataLoader(stall_helpers.NeedsTheLock(), batch_size=4, num_workers=1, timeout=20, **loader_args)
    try:
        it = iter(loader)               # the worker starts here, while the lock is held
        release.set()                   # ... and is free again in this process from now on
        return next(it).tolist()
    finally:
        release.set()
        t.join()
        del loader


def test_a_worker_forked_beside_a_thread_holding_a_lock_waits_forever_and_chexflows_does_not():
    """With fork (the old start method), the child inherits LOCK held by a thread that does not exist
    in the child: it waits for ever, whatever the host's speed (torch's 20 s timeout only ends the
    wait). chexflow's workers come from a fork server that runs no thread: the same dataset reads."""
    with pytest.raises(RuntimeError, match="DataLoader timed out after 20 seconds"):
        _first_batch_with_the_lock_held_at_the_fork(multiprocessing_context="fork")
    assert _first_batch_with_the_lock_held_at_the_fork(**workers.loader_processes(1)) == [0, 1, 2, 3]


def test_the_fork_server_runs_one_thread_and_its_workers_start_with_the_stop_signals_blocked():
    """The workers' parent is the fork server, not this (threaded) process; it runs one thread, and
    SIGTERM/SIGUSR1/SIGINT are blocked in it (so a worker never dies of a signal meant for the trainer
    before it has set its handlers)."""
    loader = DataLoader(stall_helpers.NeedsTheLock(), batch_size=2, num_workers=2, persistent_workers=True,
                        **workers.loader_processes(2))
    it = iter(loader)
    assert sorted(b.tolist() for b in it) == [[0, 1], [0, 1], [2, 3], [2, 3]]     # each worker its own copy
    pids = [w.pid for w in it._workers]
    server = {psutil.Process(pid).ppid() for pid in pids}
    assert len(server) == 1 and server != {os.getpid()}
    (server,) = server
    assert psutil.Process(server).num_threads() == 1
    blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", open(f"/proc/{server}/status").read(), re.M).group(1), 16)
    assert all(blocked >> (s - 1) & 1 for s in workers.PARENT_SIGNALS)
    it._shutdown_workers()



def test_a_fork_server_started_again_after_it_died_starts_with_the_stop_signals_blocked_too():
    """multiprocessing starts the fork server again when it died: that one must block the signals as well."""
    def server_of_a_new_loader():
        loader = DataLoader(stall_helpers.NeedsTheLock(), batch_size=2, num_workers=1, **workers.loader_processes(1))
        it = iter(loader)
        next(it)
        (server,) = {psutil.Process(w.pid).ppid() for w in it._workers}
        it._shutdown_workers()
        return server

    first = server_of_a_new_loader()
    server = psutil.Process(first)
    server.kill()
    deadline = time.time() + 60          # not reaped here: multiprocessing reaps it, and so learns it died
    while server.status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.05)
    second = server_of_a_new_loader()
    assert second not in (first, os.getpid())
    blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", open(f"/proc/{second}/status").read(), re.M).group(1), 16)
    assert all(blocked >> (s - 1) & 1 for s in workers.PARENT_SIGNALS), f"SigBlk {blocked:x}"

# ------------------------------------------------------------------------ the bound and the line
def test_the_bound_is_start_s_until_the_first_mark_then_the_floor_or_factor_times_the_slowest_gap():
    now = [100.0]
    dog = watchdog.Watchdog(watchdog.WatchdogConfig(start_s=50, floor_s=20, factor=10), command="train",
                            clock=lambda: now[0])
    assert dog.bound() == 50
    now[0] = 149.0
    assert dog.stalled_for() is None
    now[0] = 150.5
    assert dog.stalled_for() == pytest.approx(50.5)
    dog.beat("training")            # the first mark: no gap measured yet, the floor holds
    assert dog.bound() == 20
    now[0] += 1.5
    dog.beat("training")
    now[0] += 3.0
    dog.beat("validation")          # slowest gap 3 s: 10 x 3 = 30 > 20
    assert (dog.bound(), dog.phase) == (30, "validation")
    assert dog.why_bound() == "max(floor_s 20 s, factor 10 x the slowest gap 3.00 s)"
    now[0] += 30.5
    assert dog.stalled_for() == pytest.approx(30.5)


def test_the_settings_come_from_the_environment_checked():
    assert watchdog.config_from_env({}) == watchdog.WatchdogConfig()
    cfg = watchdog.config_from_env({watchdog.ENV: TEST_WATCHDOG})
    assert (cfg.start_s, cfg.floor_s, cfg.factor) == (600, 30, 10)
    with pytest.raises(ConfigError, match=r"watchdog\.factor: 0\.5 is not >= 1"):
        watchdog.config_from_env({watchdog.ENV: '{"factor": 0.5}'})
    with pytest.raises(Exception, match="CHEXFLOW_WATCHDOG: not JSON"):
        watchdog.config_from_env({watchdog.ENV: "{"})


@pytest.mark.parametrize("text, line", [
    ("DataLoader worker (pid 4242) is killed by signal: Killed. ", "loader worker pid 4242 was killed by signal Killed"),
    ("DataLoader worker (pid(s) 17, 18) exited unexpectedly", "loader worker pid 17, 18 exited unexpectedly"),
    ("DataLoader worker (pid 9) is killed by signal: Segmentation fault. ",
     "loader worker pid 9 was killed by signal Segmentation fault"),
])
def test_every_way_a_worker_ends_is_one_line_with_its_own_exit_status(text, line):
    exc = workers.worker_death(RuntimeError(text))
    assert isinstance(exc, workers.LoaderWorkerDied) and str(exc).startswith(line)
    refusal = errors.refusal_of(exc)
    assert refusal.code == 15
    (shown,) = errors.refusal_lines("train", exc, refusal)
    assert shown.startswith(f"chexflow train: {line}") and "\n" not in shown
    other = RuntimeError("CUDA out of memory")
    assert workers.worker_death(other) is other


# ------------------------------------------------------------------------ (b) a worker stopped
def _stopped_run(cmd: list[str], log, pick, settings: str = TEST_WATCHDOG) -> tuple[int, str, int]:
    """Start ``cmd``; once ``pick(pid)`` names a loader worker, SIGSTOP it; (exit status, log, its pid)."""
    env = {**cli_env(), watchdog.ENV: settings}
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        chosen = []
        wait_for(lambda: chosen.append(pick(proc.pid)) or chosen[-1] is not None, proc, log, "the worker to stop")
        os.kill(chosen[-1], signal.SIGSTOP)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text(), chosen[-1]


def _after_first_checkpoint(work):
    def pick(pid):
        if not ckpt.list_checkpoints(work / "ckpt"):
            return None
        found = loader_workers(pid)
        return found[0] if found else None
    return pick


def _validation_worker(pid):
    """A worker of the validation loader: the ones started after the training loader's two."""
    found = loader_workers(pid)
    return found[-1] if len(found) >= 4 else None


def _weights(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _assert_the_line(text: str, phase: str, waiting: str) -> None:
    last = [line for line in text.splitlines() if line.startswith("chexflow train: ")][-1]
    assert re.fullmatch(rf"chexflow train: rank 0 of \d+ \(pid \d+\): no progress for \d+ s in {phase} \(bound \d+ s: "
                        rf"max\(floor_s 30 s, factor 10 x the slowest gap [\d.]+ s\)\): {waiting} \(stacks above\) "
                        r"\(a stall: the job exits 14 .*\)", last), last
    assert "every thread's stack" in text and 'File "' in text and "Thread 0x" in text, text[-3000:]
    assert "Traceback (most recent call last)" not in text, text[-3000:]


@pytest.mark.slow
def test_a_stopped_training_worker_ends_the_job_within_its_bound_and_the_rerun_matches_an_uninterrupted_run(
        demo_manifest, tmp_path):
    cfg = dict(epochs=2, checkpoint={"every_steps": 20})
    ref = tmp_path / "ref"
    assert subprocess.run(train_cmd(demo_manifest, ref, **cfg), env=cli_env(), capture_output=True,
                          timeout=900).returncode == 0
    work = tmp_path / "run"
    cmd = train_cmd(demo_manifest, work, **cfg)
    code, text, pid = _stopped_run(cmd, tmp_path / "first.log", _after_first_checkpoint(work))
    assert code == EXIT_STALLED, text[-3000:]
    _assert_the_line(text, "training", rf"waiting for loader worker pid {pid} \(worker \d of 2\)")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE   # stopped by it
    step = checkpoint_step(ckpt.list_checkpoints(work / "ckpt")[-1])
    second = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"at step {step}" in second.stdout + second.stderr
    a, b = _weights(ref / "out" / "model.pt"), _weights(work / "out" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_stopped_validation_worker_ends_the_job_within_its_bound(demo_manifest, tmp_path):
    cmd = train_cmd(demo_manifest, tmp_path, epochs=6)
    code, text, pid = _stopped_run(cmd, tmp_path / "first.log", _validation_worker)
    assert code == EXIT_STALLED, text[-3000:]
    _assert_the_line(text, "validation", rf"waiting for loader worker pid {pid} \(worker \d of 2\)")
    second = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]


# ------------------------------------------------------------------------ (c) a rank stopped
@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    pytest.param("horovod", marks=pytest.mark.skipif(not horovod_available(), reason="horovod not built")),
    "ddp"])
def test_a_stopped_rank_ends_the_job_within_the_bound_and_the_rerun_resumes(demo_manifest, tmp_path, backend):
    """Rank 1 stopped after the first checkpoint: rank 0 waits in a collective, its watchdog ends it
    (exit 14, the line naming the collective), the launcher stops the rest, and `chexflow launch`
    exits 14; the rerun resumes from the checkpoint and finishes with the weights of an uninterrupted run."""
    def launch_of(work):
        cmd = train_cmd(demo_manifest, work, backend=backend, epochs=2, data={"workers": 0},
                        checkpoint={"every_steps": 10})
        return [sys.executable, "-m", "chexflow", "launch", "--backend", backend, "-n", "2", "--", *cmd]

    ref = subprocess.run(launch_of(tmp_path / "ref"), env=cli_env(), capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    tmp_path = tmp_path / "run"
    tmp_path.mkdir()
    launch = launch_of(tmp_path)

    def rank_1(pid):
        if not ckpt.list_checkpoints(tmp_path / "ckpt"):
            return None
        ranks = [p for p in psutil.Process(pid).children(recursive=True) if p.name().startswith("python")
                 and " train " in " ".join(p.cmdline()) and "launch" not in p.cmdline()]
        ranks = [p for p in ranks if p.environ().get("HOROVOD_RANK", p.environ().get("RANK")) == "1"]
        return ranks[0].pid if ranks else None

    # a 10 s floor: below Horovod's own 30 s gloo timeout (HOROVOD_GLOO_TIMEOUT_SECONDS), which would
    # otherwise end the waiting rank first, with Horovod's traceback instead of the watchdog's line
    code, text, pid = _stopped_run(launch, tmp_path / "first.log", rank_1,
                                   json.dumps({"start_s": 600, "floor_s": 10, "factor": 10}))
    assert code == EXIT_STALLED, text[-4000:]
    assert re.search(r"chexflow train: rank 0 of 2 \(pid \d+\): no progress for \d+ s in \w+ \(bound \d+ s: .*\): "
                     r"collective \w+ \(\w+\.py:\d+\)", text), text[-4000:]
    deadline = time.time() + 120
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "rank 1 left behind"
    step = checkpoint_step(ckpt.list_checkpoints(tmp_path / "ckpt")[-1])
    second = subprocess.run(launch, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert f"at step {step}" in second.stdout + second.stderr
    a, b = _weights(tmp_path.parent / "ref" / "out" / "model.pt"), _weights(tmp_path / "out" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stall_in_this_process_is_one_line_a_stack_dump_and_exit_14(tmp_path):
    """The watchdog in a plain process whose main thread sleeps past the bound: its line names the phase
    and the bound; the process exits 14 from the watchdog's thread."""
    code = ("import time; from chexflow import watchdog\n"
            "watchdog.arm('evaluate', watchdog.WatchdogConfig(start_s=60, floor_s=2, factor=10))\n"
            "watchdog.beat('evaluation'); time.sleep(0.2); watchdog.beat('evaluation'); time.sleep(600)")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_STALLED, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"chexflow evaluate: pid \d+: no progress for \d+ s in evaluation \(bound \d+ s: max\(floor_s 2 s, "
                        r"factor 10 x the slowest gap \d+\.\d\d s\)\) \(stacks above\) \(a stall: .*\)", last), last
    assert 'File "<string>", line 3 in <module>' in proc.stderr


def test_time_a_process_spends_stopped_is_not_a_stall(tmp_path):
    """SLURM suspends a job with SIGSTOP (`scontrol suspend`, gang scheduling): stopped for 8 s, past its
    2 s bound, the process goes on when resumed and ends normally."""
    code = ("import sys, time; from chexflow import watchdog\n"
            "watchdog.arm('train', watchdog.WatchdogConfig(start_s=60, floor_s=2, factor=1))\n"
            "print('ready', flush=True)\n"
            "for _ in range(60):\n    watchdog.beat('training'); time.sleep(0.1)\n"
            "print('done', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], env=cli_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(8)
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=300) == 0 and proc.stdout.read() == "done\n"


def test_a_process_past_its_last_paced_mark_is_bounded_by_start_s_and_its_gaps_set_no_pace():
    """Evaluation's statistics after its last batch (minutes at ChestX-ray14's size) are no stall at a
    bound its batches set: start_s bounds them, and their marks do not become the run's slowest gap."""
    now = [0.0]
    dog = watchdog.Watchdog(watchdog.WatchdogConfig(start_s=50, floor_s=2, factor=10), command="evaluate",
                            clock=lambda: now[0])
    dog.beat("evaluation")
    now[0] += 0.1
    dog.beat("evaluation")
    assert dog.bound() == 2                  # max(2, 10 x 0.1)
    now[0] += 0.1
    dog.unpace("statistics")
    assert (dog.bound(), dog.phase) == (50, "statistics")
    assert dog.why_bound() == "start_s 50 s in statistics, which marks no pace"
    now[0] += 49
    assert dog.stalled_for() is None
    dog.beat("evaluation")                   # a batch of the heatmaps' inputs: still no pace
    assert (dog.slowest, dog.bound()) == (pytest.approx(0.1), 50)
    now[0] += 50.5
    assert dog.stalled_for() == pytest.approx(50.5)
