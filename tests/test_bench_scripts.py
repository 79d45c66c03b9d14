"""The benchmark scripts that bench/gpu_check.sh runs on a GPU machine also run here, on CPU, small.

A GPU lease is minutes long: a script that breaks on its first line there costs the figures of the
whole lease. bench/train_throughput.py did (its hand-written manifest lacked fields the run id
reads, found on an H200 on 2026-11-28); this runs it for real, tiny, on CPU.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_throughput_runs_its_three_measurements(tmp_path):
    out = tmp_path / "throughput.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_throughput.py"), "--arch", "resnet18",
                           "--crop", "32", "--stored", "40", "--batch", "8", "--steps", "3", "--warmup", "1",
                           "--workers", "1", "--backend", "single", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["arch"], r["batch"], r["backend"], r["precision"]) == ("resnet18", 8, "single", "fp32")
    assert r["bare_img_s"] > 0 and r["full_img_s"] > 0 and r["loader_img_s"] > 0
    # the ratios are of the unrounded rates, written to 3 decimals (5e-4); the rates to 0.1 img/s (0.05
    # of each, relative to it)
    def slack(a: float, b: float) -> float:
        return 5e-4 + a / b * (0.05 / a + 0.05 / b)
    for ratio, a, b in (("full_over_bare", "full_img_s", "bare_img_s"),
                        ("loader_over_full", "loader_img_s", "full_img_s")):
        assert r[ratio] == pytest.approx(r[a] / r[b], abs=slack(r[a], r[b])), ratio
    assert "chexflow full" in proc.stdout and "loader alone" in proc.stdout


def test_machine_speed_prints_its_figure_and_host(tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "machine_speed.py"), "--batch", "4", "--steps", "1",
                           "--warmup", "1", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    cores = r["cores"]
    assert r["img_s_1_thread"] > 0 and r[f"img_s_{cores}_threads"] > 0
    assert r["host"]["cores"] == cores and "machine speed:" in proc.stdout and r["host"]["cpu_model"] in proc.stdout


def test_loader_epoch_start_compares_the_same_passes(tmp_path):
    out = tmp_path / "start.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "loader_epoch_start.py"), "--workers", "1",
                           "--batch", "4", "--steps", "3", "--passes", "2", "--size", "16", "--arch", "resnet18", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["workers"], r["batch"], r["batches_per_pass"]) == (1, 4, 3)
    assert r["pass_ratio_fresh_over_kept"] == pytest.approx(r["fresh"]["pass_s"] / r["kept"]["pass_s"])
    assert r["start_saved_per_pass_s"] == pytest.approx(r["fresh"]["pass_s"] - r["kept"]["pass_s"])
    assert "fresh / kept" in proc.stdout


def test_import_cost_compares_a_patched_copy_with_the_released_one(tmp_path):
    """bench/import_cost.py's two copies of torchvision: the released one imports TorchDynamo, the patched
    one does not, and they differ in that line alone (what its ratio measures)."""
    spec = importlib.util.spec_from_file_location("import_cost", ROOT / "bench" / "import_cost.py")
    import_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(import_cost)
    paths = import_cost.copies(tmp_path)
    probe = "import sys, torchvision; sys.exit(10 + ('torch._dynamo' in sys.modules))"
    for name, dynamo in (("patched", False), ("released", True)):
        proc = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(paths[name])}, timeout=300)
        assert proc.returncode == 10 + dynamo, name
    texts = {name: (path / "torchvision/ops/roi_align.py").read_text().splitlines() for name, path in paths.items()}
    diff = [line for line in texts["patched"] if line not in texts["released"]]
    assert diff[0].startswith("# chexflow patch: dynamo imported when used") and len(diff) == 4, diff
    assert set(texts["released"]) - set(texts["patched"]) == {"from torch._dynamo.utils import is_compile_supported"}
    cpu, mib = import_cost.run_once("pass", paths["patched"])
    assert 0 < cpu < 60 and mib > 0


def test_suite_processes_records_every_python_process_it_starts_and_tells_them_apart(tmp_path):
    """bench/suite_processes.py: a command that starts three Python processes (itself a `python -c`, a
    child that starts the third, a grandchild that burns 0.3 CPU-s with SLURM_JOB_ID set, as in a SLURM
    job) gives three records, each with its own CPU, kind and job; the table sums them and names the
    SLURM job's."""
    log = tmp_path / "procs.jsonl"
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    grandchild = f"import os, sys, subprocess; subprocess.run([sys.executable, '-c', {burn!r}], " \
                 "env={**os.environ, 'SLURM_JOB_ID': '77'}, check=True)"
    command = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}],"
               " check=True)"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench/suite_processes.py"), "--log", str(log), "--", *command],
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 3 and [r["slurm_job"] for r in records].count("77") == 1
    job = next(r for r in records if r["slurm_job"] == "77")
    assert job["cpu"] >= 0.3 and job["argv"] == ["-c"] and job["torch"] is False
    assert all(r["test"] == "" for r in records)
    first = proc.stdout.splitlines()[0]
    assert first.startswith("3 Python processes,") and "1 SLURM jobs:" in first, proc.stdout
    assert "python -c [SLURM job]" in proc.stdout
    # the table of a recorded run, without running anything
    again = subprocess.run([sys.executable, str(ROOT / "bench/suite_processes.py"), "--log", str(log)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == proc.stdout


def test_rank_start_times_a_real_rank_both_ways(tmp_path):
    """bench/rank_start.py: a real `chexflow train` as installed and with what torch as released imported first
    (TorchDynamo, Inductor's configuration): one run of each, both trained, their figures and ratio written."""
    out = tmp_path / "rank.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/rank_start.py"), "--runs", "1", "--warmup", "0",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["runs"] == 1 and r["steps"] == 10 and r["host"]["cpu_capability"]
    assert r["rank"]["cpu_ratio"] == pytest.approx(r["rank"]["now"]["cpu_s"] / r["rank"]["before"]["cpu_s"])
    assert all(0 < r["rank"][way]["cpu_s"] < 300 and r["rank"][way]["peak_mib"] > 0 for way in ("now", "before"))
    assert "a training rank (10 steps, ResNet-18, 32 px): now" in proc.stdout


def test_rank_threads_times_a_real_job_both_ways(tmp_path):
    """bench/rank_threads.py: a real 2-rank `chexflow launch ... chexflow train` job whose ranks share its 2 threads,
    and one whose ranks take 2 each (the bench checks each rank's recorded threads): one run of each, the smallest
    model and data, both trained, their figures and ratio written."""
    out = tmp_path / "threads.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/rank_threads.py"), "--runs", "1", "--warmup", "0",
                           "--arch", "shufflenet_v2_x0_5", "--images", "128", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["runs"], r["ranks"], r["steps"], r["arch"]) == (1, 2, 4, "shufflenet_v2_x0_5") and r["host"]["cores"]
    assert r["job"]["cpu_ratio"] == pytest.approx(r["job"]["shared"]["cpu_s"] / r["job"]["each"]["cpu_s"])
    assert all(0 < r["job"][way]["cpu_s"] < 300 and r["job"][way]["wall_s"] > 0 for way in ("shared", "each"))
    assert "a 2-rank training job (" in proc.stdout and "4 steps of 32 per rank, shufflenet_v2_x0_5, 32 px): shared" \
        in proc.stdout


_COUNT_HOGS = """
import os, sys, time
tag = sys.argv[1]
def hogs():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[:-1]
        except OSError:
            continue
        if args[-2:] == [b"while True: pass", tag.encode()]:
            found.append(int(pid))
    return found
deadline = time.monotonic() + 5          # slow_host waits for its hogs; a second look costs nothing
seen = hogs()
while len(seen) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
    seen = hogs()
open(sys.argv[2], "w").write(" ".join(map(str, seen)))
sys.exit(3)
"""


def test_slow_host_runs_the_command_beside_its_hogs_and_stops_them(tmp_path):
    """The command runs while exactly --hogs busy loops do, its exit status is the script's, and no hog
    outlives it."""
    spec = importlib.util.spec_from_file_location("slow_host", ROOT / "bench" / "slow_host.py")
    slow_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slow_host)
    seen = tmp_path / "hogs"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "slow_host.py"), "--hogs", "2", "--",
                           sys.executable, "-c", _COUNT_HOGS, slow_host.HOG_TAG, str(seen)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    hogs = [int(p) for p in seen.read_text().split()]
    assert len(hogs) == 2 and "slow_host: 2 busy loop(s) beside" in proc.stderr
    assert not [p for p in hogs if Path(f"/proc/{p}").exists()], "a hog outlived the command"
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "slow_host.py"), "--hogs", "1"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "no command: give it after --" in bad.stderr
