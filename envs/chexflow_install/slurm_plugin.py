"""Patch snakemake-executor-plugin-slurm 2.8.0 so that one node failure no longer stops the workflow.

The bug (upstream issue snakemake-executor-plugin-slurm#485, written up with its reproduction on the
local test cluster in envs/patches/slurm-plugin-node-fail.md): when a job ends in NODE_FAIL, the
plugin asks ``sacct -X`` for the job's node list to exclude it from later submissions. With
``--requeue`` (the profile's ``slurm-requeue: true``) SLURM has usually requeued the job by then,
and ``sacct -X`` describes the pending new run: ``None assigned``. That text goes into every later
``sbatch`` as ``--exclude=None assigned``; the shell splits it, sbatch takes ``assigned`` for the
script and every later submission (retries included) fails within a second.

The patch replaces that lookup by a function added to the plugin's module: the node list of the
failed run itself (``sacct -D``, the NODE_FAIL row) and, of those nodes, only the ones SLURM
reports down, drained or not responding now (``sinfo``), so a multi-node job's healthy nodes and
a node already back in service are not excluded for the rest of the workflow.

Applied by ``envs/setup.sh`` (``python -m chexflow_install.slurm_plugin``) as chexflow_install.horovod
patches Horovod: idempotent (a marker says it is applied), only to the release it was written for
(envs/requirements.txt pins it), and failing loudly, with what to do, when the installed plugin is
another version or its code is not the one the patch expects. ``--check`` only reports.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from chexflow.fsutil import write_text_atomic

DIST = "snakemake-executor-plugin-slurm"
PACKAGE = "snakemake_executor_plugin_slurm"
VERSION = "2.8.0"                    # the release this patch is written for (envs/requirements.txt)
WRITEUP = "envs/patches/slurm-plugin-node-fail.md"
MARKER = f"# chexflow patch: node-fail exclusion ({WRITEUP})"
SAY = "slurm-plugin-patch:"

# in Executor.check_active_jobs, branch `status == "NODE_FAIL"` (2.8.0)
ORIGINAL = '''\
                            sacct_output = subprocess.check_output(
                                f"sacct -j {j.external_jobid} -n -X -o nodelist%-256",
                                shell=True,
                                text=True,
                                stderr=subprocess.PIPE,
                            )
                            node = sacct_output.strip()
                            if node:
                                self._failed_nodes.add(node)
'''

REPLACEMENT = f'''\
                            {MARKER}
                            self._failed_nodes.update(_chexflow_failed_nodes(j.external_jobid))
'''

HELPER = f'''

{MARKER}
def _chexflow_failed_nodes(jobid):
    """The nodes to exclude after job `jobid` ended in NODE_FAIL: the nodes of its failed run(s)
    (`sacct -D`: `sacct -X` alone describes the requeued run, "None assigned") that SLURM reports
    down, drained or not responding now. A node back in service, or a healthy node of a multi-node
    job, is not excluded; without `sinfo` nothing is (SLURM does not schedule on a down node)."""
    rows = subprocess.check_output(
        ["sacct", "-j", str(jobid), "-n", "-X", "-D", "-P", "-o", "State,NodeList"],
        text=True,
        stderr=subprocess.PIPE,
    )
    failed = set()
    for row in rows.splitlines():
        state, _, nodes = row.partition("|")
        if state.startswith("NODE_FAIL") and nodes.strip() not in ("", "None assigned", "(null)"):
            failed.add(nodes.strip())
    if not failed:
        return set()
    try:
        down = subprocess.check_output(
            ["sinfo", "-h", "-N", "-n", ",".join(sorted(failed)), "-t", "down,drain,fail,no_respond", "-o", "%N"],
            text=True,
            stderr=subprocess.PIPE,
        )
    except (OSError, subprocess.CalledProcessError):
        return set()
    return set(down.split())
'''


class PatchError(RuntimeError):
    """The installed plugin is not the code this patch was written for; the message says what to do."""


def is_patched(text: str) -> bool:
    return MARKER in text


def patch_text(text: str, *, source: str = f"{PACKAGE}/__init__.py") -> str:
    """``text`` (the plugin's ``__init__.py``) with the patch applied; unchanged if it already is."""
    if is_patched(text):
        return text
    if text.count(ORIGINAL) != 1:
        raise PatchError(f"{source}: the NODE_FAIL node lookup this patch replaces is not there (found "
                         f"{text.count(ORIGINAL)} times): the plugin's code changed. Check upstream issue #485 "
                         f"and {WRITEUP}, then update envs/chexflow_install/slurm_plugin.py")
    return text.replace(ORIGINAL, REPLACEMENT).rstrip("\n") + "\n" + HELPER


def plugin_file() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise PatchError(f"{DIST} is not installed (envs/requirements.txt pins {DIST}=={VERSION})")
    return Path(spec.origin)


def apply(*, check: bool = False) -> str:
    """Patch the installed plugin (``check``: only say whether it is); returns what was found/done."""
    return apply_to(plugin_file(), importlib.metadata.version(DIST), check=check)


def apply_to(path: Path, version: str, *, check: bool = False) -> str:
    """Patch ``path``, the ``__init__.py`` of the plugin's release ``version``."""
    text = path.read_text(encoding="utf-8")
    if is_patched(text):
        return f"{path}: {DIST} {version} is patched"
    if version != VERSION:
        raise PatchError(f"{DIST} {version} is installed; chexflow's patch for its node-failure bug is written "
                         f"for {VERSION} (envs/requirements.txt): install {DIST}=={VERSION}, or check whether "
                         f"{version} fixes upstream issue #485 ({WRITEUP}) and update "
                         "envs/chexflow_install/slurm_plugin.py")
    new = patch_text(text, source=str(path))
    if check:
        raise PatchError(f"{path}: {DIST} {version} is not patched (run `bash envs/setup.sh`)")
    compile(new, str(path), "exec")         # a patch that does not even compile is never written
    write_text_atomic(path, new)
    return f"{path}: patched {DIST} {version} ({WRITEUP})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chexflow_install.slurm_plugin", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report whether the installed plugin is patched")
    args = ap.parse_args(argv)
    try:
        print(SAY, apply(check=args.check))
    except PatchError as exc:
        print(SAY, "ERROR:", exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
