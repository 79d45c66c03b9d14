"""What a process pays to import before its first line of work, with torchvision patched (TorchDynamo imported
when used: envs/patches/torchvision-dynamo-import.md) and as released, in the same run.

Two copies of the installed torchvision go to a temporary directory, one with the patch and one with 0.29.1's
original line; each probe runs --runs times in a fresh process (one thread) with one copy or the other first
on PYTHONPATH, alternated, after one untimed run of each. Per process: CPU seconds (user + system, the
kernel's accounting of the reaped child) and peak memory. Prints medians and the ratio patched / released:

    python bench/import_cost.py                       # ~2 min on a 2-core VM
    python bench/import_cost.py --runs 9 --json out.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "envs"), str(REPO / "workflow")]

from chexflow import host  # noqa: E402
from chexflow_install import torchvision_dynamo as P  # noqa: E402

PROBES = {
    "import torchvision": "import torchvision",
    "chexflow trainer and evaluation": "from chexflow.train import trainer; from chexflow.evaluate import run",
}


def copies(root: Path) -> dict[str, Path]:
    """{'patched': dir, 'released': dir}, each holding a torchvision package."""
    installed = P.module_file().parents[1]               # .../torchvision
    out = {}
    for name in ("patched", "released"):
        shutil.copytree(installed, root / name / "torchvision", ignore=shutil.ignore_patterns("__pycache__"))
        module = root / name / "torchvision" / "ops" / "roi_align.py"
        text = module.read_text().replace(P.REPLACEMENT, P.ORIGINAL)      # as released, whatever is installed
        module.write_text(P.patch_text(text) if name == "patched" else text)
        out[name] = root / name
    return out


def run_once(statement: str, path: Path) -> tuple[float, float]:
    """(CPU seconds, peak MiB) of one fresh process running ``statement`` with ``path`` first on PYTHONPATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(path), str(REPO / "workflow")])}
    proc = subprocess.Popen([sys.executable, "-c", statement], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the probe {statement!r} failed with {path} on PYTHONPATH")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def paired(ways: dict[str, Callable[[], tuple[float, float]]], new: str, old: str, *, runs: int,
           warmup: int = 1, second: tuple[str, str] = ("peak_mib", "MiB")) -> tuple[dict, str]:
    """Each of ``ways`` (a fresh process: its (CPU seconds, a second figure: by default its peak MiB)) run
    ``warmup`` times untimed, then ``runs`` times, alternated: (the medians and each run's CPU per way, with
    ``cpu_ratio`` of ``new`` to ``old``; the line that says so). ``second``: the second figure's key and unit.
    Also used by bench/rank_start.py and bench/rank_threads.py."""
    for _ in range(warmup):
        for way in ways.values():
            way()                                   # warm the page cache and the .pyc files
    seen = {name: [] for name in ways}
    for _ in range(runs):
        for name, way in ways.items():
            seen[name].append(way())
    key, unit = second
    row = {name: {"cpu_s": statistics.median(c for c, _ in got), key: statistics.median(m for _, m in got),
                  "cpu_s_all": [round(c, 2) for c, _ in got]} for name, got in seen.items()}
    row["cpu_ratio"] = row[new]["cpu_s"] / row[old]["cpu_s"]
    line = "; ".join(f"{name} {row[name]['cpu_s']:.2f} CPU-s, {row[name][key]:.0f} {unit}" for name in (new, old))
    return row, f"{line}; ratio {row['cpu_ratio']:.2f} (medians of {runs})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each probe and copy")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    result = {"host": host.describe(), "runs": args.runs, "probes": {}}
    with tempfile.TemporaryDirectory(prefix="chexflow-import-cost-") as tmp:
        paths = copies(Path(tmp))
        for label, statement in PROBES.items():
            ways = {name: functools.partial(run_once, statement, path) for name, path in paths.items()}
            result["probes"][label], line = paired(ways, "patched", "released", runs=args.runs)
            print(f"{label}: {line}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
