"""Where a command's CPU goes, process by process: every Python process it starts, SLURM's jobs included.

    python bench/suite_processes.py --log procs.jsonl -- bash .ci/run      # run and record, then the table
    python bench/suite_processes.py --log procs.jsonl                      # the table of a recorded run

The test suite's own accounting (tests/conftest.py) counts a test's CPU and that of the processes it
waited for; the jobs of the local SLURM cluster run under slurmd and are not counted there. This puts a
``sitecustomize`` module first on ``PYTHONPATH``: each Python process that inherits it (the tests pass
the environment on, sbatch exports it to the jobs) appends one JSON line at exit with its own CPU (not
its children's), its wall time, its first arguments, the test it ran under (``PYTEST_CURRENT_TEST``),
its SLURM job and whether it imported torch. A process killed by a signal it does not handle writes
nothing, and processes started without the environment (inside a container) are not seen.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RECORDER = '''\
import atexit, json, os, sys, time
_start = time.time()
def _chexflow_record():
    try:
        t = os.times()
        rec = {"argv": sys.argv[:3], "cpu": round(t.user + t.system, 3), "wall": round(time.time() - _start, 3),
               "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
               "slurm_job": os.environ.get("SLURM_JOB_ID", ""), "torch": "torch" in sys.modules}
        with open(os.environ["CHEXFLOW_PROCESS_LOG"], "a") as log:
            log.write(json.dumps(rec) + "\\n")
    except Exception:
        pass
atexit.register(_chexflow_record)
'''


def kind(rec: dict) -> str:
    """What a process was: ``chexflow <subcommand>``, ``snakemake``, a script's name, ``python -c``."""
    argv = rec["argv"] or [""]
    first = argv[0]
    if first.endswith("__main__.py"):           # python -m <package>
        package = Path(first).parent.name
        if package == "chexflow" and len(argv) > 1:
            return f"chexflow {argv[1]}"
        return package
    name = Path(first).name
    if name == "chexflow" and len(argv) > 1:
        return f"chexflow {argv[1]}"
    if name == "-c":
        return "python -c" + (" (torch)" if rec["torch"] else "")
    return name or "?"


def table(records: list[dict], rows: int = 30) -> str:
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    for rec in records:
        row = by_kind[kind(rec) + (" [SLURM job]" if rec["slurm_job"] else "")]
        row[0] += 1
        row[1] += rec["cpu"]
        row[2] += rec["torch"]
    total = sum(r["cpu"] for r in records)
    slurm = sum(r["cpu"] for r in records if r["slurm_job"])
    jobs = len({r["slurm_job"] for r in records if r["slurm_job"]})
    lines = [f"{len(records)} Python processes, {total / 60:.1f} CPU-minutes; {jobs} SLURM jobs: "
             f"{slurm / 60:.1f} CPU-minutes", f"{'CPU s':>8}  {'processes':>9}  {'torch':>5}  {'s each':>6}  kind"]
    for name, (n, cpu, torch) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"{cpu:8.1f}  {n:9d}  {torch:5d}  {cpu / n:6.2f}  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, required=True, help="the JSON lines (appended to when a command runs)")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run and record")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    status = 0
    if command:
        with tempfile.TemporaryDirectory(prefix="chexflow-processes-") as tmp:
            (Path(tmp) / "sitecustomize.py").write_text(RECORDER)
            env = {**os.environ, "CHEXFLOW_PROCESS_LOG": str(args.log.resolve()),
                   "PYTHONPATH": os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH", "")) if p)}
            status = subprocess.run(command, env=env).returncode
    if not args.log.exists():
        print(f"{args.log}: no process recorded", file=sys.stderr)
        return status or 1
    records = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    print(table(records, args.rows))
    return status


if __name__ == "__main__":
    sys.exit(main())
