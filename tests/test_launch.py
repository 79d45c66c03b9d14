"""`chexflow launch`: the local ranks of one job share its threads.

Snakemake sets ``OMP_NUM_THREADS`` and the BLAS libraries' equivalents to a job's ``threads``; every rank
took them all, so a job of 2 ranks on 2 threads ran 4 compute threads on 2 cores (twice the CPU of 2 ranks
of 1 thread for the same steps, BENCHMARKS.md). The trainer records the threads it used
(``host.torch_threads``; test_workflow.py's chain checks them)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chexflow.settings import ConfigError
from chexflow.train.launch import THREAD_VARS, job_threads, rank_threads
from conftest import cli_env, horovod_available


@pytest.mark.parametrize("job, n, share", [(2, 2, 1), (8, 2, 4), (8, 3, 2), (2, 4, 1), (1, 1, 1), (16, 1, 16)])
def test_the_jobs_threads_are_shared_evenly_at_least_one_each(job, n, share):
    env = {"OMP_NUM_THREADS": str(job), "MKL_NUM_THREADS": f" {job} ", "PATH": "/bin"}
    assert rank_threads(env, n) == {"OMP_NUM_THREADS": str(share), "MKL_NUM_THREADS": str(share)}


def test_without_omp_num_threads_the_cores_this_process_may_use_are_shared():
    cores = len(os.sched_getaffinity(0))
    assert job_threads({"OMP_NUM_THREADS": ""}) == (cores, "the cores this process may run on")
    assert rank_threads({}, 2) == {"OMP_NUM_THREADS": str(max(1, cores // 2))}


@pytest.mark.parametrize("bad", ["0", "-2", "4,2", "two", "1.5", "１"])
def test_an_omp_num_threads_that_is_no_count_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match=r"^OMP_NUM_THREADS: '.*' is not a number of threads \(a positive integer\)"):
        rank_threads({"OMP_NUM_THREADS": bad}, 2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    pytest.param("horovod", marks=pytest.mark.skipif(not horovod_available(), reason="horovod not built")), "ddp"])
def test_each_rank_of_a_launched_job_gets_its_share(backend):
    """A job of 2 threads (as Snakemake sets them) launched as 2 ranks by horovodrun or torchrun: 1 each."""
    env = {**cli_env(), **{var: "2" for var in THREAD_VARS}}
    program = f"import os; print('rank threads', *(os.environ[v] for v in {THREAD_VARS!r}))"
    proc = subprocess.run([sys.executable, "-m", "chexflow", "launch", "--backend", backend, "-n", "2", "--",
                           sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("rank threads " + " ".join(["1"] * len(THREAD_VARS))) == 2, proc.stdout
    assert "launch: 2 rank(s) of 1 thread(s): the job's 2 (OMP_NUM_THREADS) shared" in proc.stderr
