"""Wall time of ``snakemake -n`` (DAG building) for the full NIH study and for a 1,000-shard DAG.

* ``nih``: ``study.finetune_dataset: nih`` with ``datasets.nih.mirror`` pointing at a directory
  holding the three NIH tables (the label CSV from the torchxrayvision wheel, split lists made
  from it: every 5th patient is test). Target < 2 s.
* ``shards1000``: ``study.pretrain_dataset: imagenet`` with ``shards.imagenet.train_parts: 999``,
  i.e. 999 train parts + val = 1,000 ``write_shards`` jobs (plus the NIH-demo ones). Target < 5 s.

The ``-q`` variants add ``--quiet rules``: the same DAG, the job-count table only, no printed
block per job (printing 1,000 job blocks is most of a plain ``-n`` of the big DAG). ``snakemake
--version`` is timed too: the floor of interpreter start + Snakemake import under every run.

Each is run ``--repeats`` times in a fresh working directory (no ``.snakemake`` state), the
median counts. ``--profile`` runs the slowest case under cProfile inside this process (the
Snakemake API) and prints where the time goes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/dag_dryrun.py
"""
from __future__ import annotations

import argparse
import gzip
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
TARGETS = {"nih": 2.0, "shards1000": 5.0, "nih-q": 2.0, "shards1000-q": 5.0}
QUIET = ("--quiet", "rules")   # the "-q" cases: DAG + job table, no per-job block (what -n prints most)


def nih_mirror(dest: Path) -> Path:
    """The three NIH tables: the real label file (torchxrayvision) + split lists made from it."""
    from chexflow.data import nih
    dest.mkdir(parents=True, exist_ok=True)
    csv = dest / nih.LABEL_CSV_NAME
    csv.write_bytes(gzip.decompress(nih.find_label_csv().read_bytes()))
    table = nih.read_label_table(csv)
    test = table["Patient ID"].astype(int) % 5 == 0
    (dest / "train_val_list.txt").write_text("\n".join(table.loc[~test, "Image Index"]) + "\n")
    (dest / "test_list.txt").write_text("\n".join(table.loc[test, "Image Index"]) + "\n")
    return dest


def case_config(case: str, work: Path) -> dict:
    case = case.removesuffix("-q")
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["study"]["finetune_dataset"] = "nih"
    cfg["datasets"]["nih"]["mirror"] = str(nih_mirror(work / "nih_mirror"))
    if case == "shards1000":
        cfg["study"]["finetune_dataset"] = "nih_demo"
        cfg["study"]["pretrain_dataset"] = "imagenet"
        mirror = work / "imagenet_mirror"
        mirror.mkdir(exist_ok=True)
        cfg["datasets"]["imagenet"]["mirror"] = str(mirror)
        cfg["shards"]["imagenet"]["train_parts"] = 999
    return cfg


def snakemake_cmd(workdir: Path, configfile: Path, quiet: bool = False) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
            "--profile", str(REPO / "profiles/default"), "--cores", "2", "-n",
            "--configfile", str(configfile), *(QUIET if quiet else ())]


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_case(case: str, work: Path, repeats: int) -> tuple[list[float], list[float], dict[str, int]]:
    cfgfile = work / f"{case}.yaml"
    cfgfile.write_text(yaml.safe_dump(case_config(case, work)))
    times, cpus, counts = [], [], {}
    for r in range(repeats):
        wd = work / f"{case}-run{r}"
        wd.mkdir()
        cmd = snakemake_cmd(wd, cfgfile, quiet=case.endswith("-q"))
        t0, c0 = time.perf_counter(), _child_cpu()
        proc = subprocess.run(cmd, env=env(), capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        cpus.append(_child_cpu() - c0)
        if proc.returncode != 0:
            raise SystemExit(f"{case}: snakemake -n failed:\n{proc.stderr[-3000:]}")
        counts = {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)$", proc.stdout, re.M)}
    return times, cpus, counts


def startup_time(repeats: int) -> tuple[float, float]:
    """``snakemake --version``: the interpreter + Snakemake import floor under every dry run
    (median wall, median CPU seconds)."""
    ts, cs = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), _child_cpu()
        subprocess.run([sys.executable, "-m", "snakemake", "--version"], env=env(), capture_output=True, check=True)
        ts.append(time.perf_counter() - t0)
        cs.append(_child_cpu() - c0)
    return statistics.median(ts), statistics.median(cs)


def profile_case(case: str, work: Path, top: int) -> None:
    import cProfile
    import pstats
    cfgfile = work / f"{case}.yaml"
    wd = work / f"{case}-profile"
    wd.mkdir()
    argv = snakemake_cmd(wd, cfgfile, quiet=case.endswith("-q"))[3:]
    from snakemake.cli import main as sm_main
    prof = cProfile.Profile()
    old = os.getcwd()
    prof.enable()
    try:
        sm_main(argv)
    except SystemExit:
        pass
    finally:
        prof.disable()
        os.chdir(old)
    stats = pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative")
    stats.print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--profile", choices=list(TARGETS), default=None, help="cProfile one case afterwards")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="chexflow-bench-dag-"))
    try:
        floor, floor_cpu = startup_time(args.repeats)
        print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f}; python -m snakemake --version: {floor:.2f} s wall, {floor_cpu:.2f} s CPU "
              f"(median of {args.repeats})")
        for case in args.cases:
            times, cpus, counts = run_case(case, work, args.repeats)
            med = statistics.median(times)
            ok = "OK" if med < TARGETS[case] else "MISSED"
            jobs = sum(v for k, v in counts.items() if k != "total")
            print(f"{case:12s} median {med:.2f} s wall, {statistics.median(cpus):.2f} s CPU "
                  f"(runs: {', '.join(f'{t:.2f}' for t in times)}) "
                  f"target < {TARGETS[case]:.0f} s: {ok}; {counts.get('total', jobs)} jobs, "
                  f"write_shards {counts.get('write_shards')}, download_file {counts.get('download_file')}")
        if args.profile:
            profile_case(args.profile, work, args.top)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
