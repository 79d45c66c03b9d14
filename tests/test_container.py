"""chexflow's OCI image and running the rules in a container.

Fast: config.yaml's ``container.image`` (checked, fed to Snakemake's ``container:`` directive for
every rule; null = none) and the Apptainer profile overlay as Snakemake reads it.
Slow (``-m container``, root with buildah and mmdebstrap, installed by ``envs/setup.sh --test``): the
image built for real by ``envs/build-image.sh`` on a Debian base made by mmdebstrap; inside it, with
no network, ``chexflow --help``, the demo's chain at tiny scale (the host's predictions and test metrics,
from test_workflow's run of it) and Horovod with 2 ranks;
the commit and pins it records; a second build of the same checkout taken whole from the cache.
"""
from __future__ import annotations

import inspect
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import roc_auc_score

from chexflow.config import check_study
from chexflow.settings import ConfigError
from conftest import REPO, builds_images, cli_env
from test_workflow import RANKS, _finished, run_facts, tiny_run  # noqa: F401  (tiny_run: a fixture)


def _config(**container) -> dict:
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    if container:
        cfg["container"] = container
    return cfg


# --------------------------------------------------------------------------- config and directive

def test_container_image_is_null_by_default_and_takes_sif_files_and_uris():
    assert yaml.safe_load((REPO / "config.yaml").read_text())["container"] == {"image": None}
    assert check_study(_config()).container.image is None
    for good in ("/shared/containers/chexflow.sif", "docker://registry.example.org/chexflow:1a2b3c",
                 "oras://ghcr.io/site/chexflow:1", "library://site/chexflow/chexflow:latest"):
        assert check_study(_config(image=good)).container.image == good


@pytest.mark.parametrize("bad, message", [
    ("", r"container\.image: '' is empty or holds whitespace"),
    ("/shared/my image.sif", r"container\.image: '/shared/my image\.sif' is empty or holds whitespace"),
    ("chexflow:latest", r"container\.image: 'chexflow:latest' is neither a \.sif file nor an image URI"),
    ("s3://bucket/chexflow.sif", r"container\.image: 's3://bucket/chexflow\.sif': Apptainer pulls no s3://"),
    (42, r"container\.image: expected"),
])
def test_container_image_refused_with_its_key(bad, message):
    with pytest.raises(ConfigError, match=message):
        check_study(_config(image=bad))
    with pytest.raises(ConfigError, match=r"container\.imag: unknown"):
        check_study(_config(imag="docker://x/y"))


_RULE_CONTAINERS = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings
with SnakemakeApi(OutputSettings(quiet={"all"})) as api:
    wf = api.workflow(resource_settings=ResourceSettings(), snakefile=Path(sys.argv[1]), workdir=Path(sys.argv[2]),
                      config_settings=ConfigSettings(configfiles=[Path(sys.argv[2]) / "config.yaml"]))
    print(json.dumps({r.name: r.container_img for r in wf._workflow.rules}))
"""


def _rule_containers(tmp_path: Path, cfg: dict) -> dict:
    """Each rule's container image as Snakemake parses the workflow with ``cfg`` as config.yaml."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-c", _RULE_CONTAINERS, str(REPO / "Snakefile"), str(tmp_path)],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_directive_puts_every_rule_in_the_configured_image_and_none_by_default(tmp_path):
    plain = _rule_containers(tmp_path, _config())
    assert len(plain) > 20 and set(plain.values()) == {None}
    image = "/shared/containers/chexflow.sif"
    inside = _rule_containers(tmp_path, _config(image=image))
    assert inside.keys() == plain.keys()
    assert set(inside.values()) == {image}


def _parsed_profiles(*profiles: str):
    from snakemake.cli import parse_args
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        return parse_args([arg for p in profiles for arg in ("--profile", p)] + ["-n"])[1]
    finally:
        os.chdir(cwd)


def test_apptainer_overlay_sets_the_deployment_method_and_its_arguments(tmp_path):
    from snakemake.settings.types import DeploymentMethod
    args = _parsed_profiles("profiles/slurm", "profiles/slurm-with-apptainer")
    assert args.software_deployment_method == {DeploymentMethod.APPTAINER}
    assert args.apptainer_args == "--nv"
    assert args.executor == "slurm"                  # the SLURM profile's settings stay
    overlay = tmp_path / "apptainer"
    overlay.mkdir()
    text = (REPO / "profiles/slurm-with-apptainer/profile.yaml").read_text()
    text = text.replace("  binds: []", "  binds: [/scratch, /data/chestxray14]")
    text = text.replace("  slurm_client: []", "  slurm_client: [/etc/slurm, /run/munge]")
    (overlay / "profile.yaml").write_text(text)
    args = _parsed_profiles("profiles/slurm", str(overlay))
    assert args.apptainer_args == "--nv --bind /scratch,/data/chestxray14,/etc/slurm,/run/munge"


# --------------------------------------------------------------------------- the image, built and run

needs_buildah = pytest.mark.skipif(not builds_images(),
                                   reason="needs root with buildah and mmdebstrap (envs/setup.sh --test installs them)")
TAG = "localhost/chexflow-test:tests"


def in_image(test):
    """The marks of a test of the image: its first test also builds it (15 min cold on 2 loaded cores)."""
    for mark in (pytest.mark.timeout(3600), needs_buildah, pytest.mark.container, pytest.mark.slow):
        test = mark(test)
    return test


def _build_command(tag: str) -> list[str]:
    """``bash envs/build-image.sh`` as documented, with no option but the name: a Debian bookworm base
    made by mmdebstrap, Debian's python3 (3.11.2)."""
    return ["bash", str(REPO / "envs/build-image.sh"), "--tag", tag]


def _build(tag: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(_build_command(tag), cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc, time.monotonic() - start


def _image_id(tag: str) -> str:
    return subprocess.run(["buildah", "images", "--format", "{{.ID}}", tag], capture_output=True, text=True,
                          check=True).stdout.split()[0]


@pytest.fixture(scope="module")
def image():
    """The image of this checkout, cold or from the cache of an earlier run. It is kept afterwards, as
    the cache of the next run (the pinned packages' layer depends on envs/setup.sh and
    envs/requirements.txt alone, so another commit reuses it); images no tag names any more (an earlier
    commit's) are removed."""
    proc, seconds = _build(TAG)
    assert proc.stdout.strip().splitlines()[-1] == TAG           # the name is the last line
    print(f"image {TAG} built in {seconds:.0f} s")
    yield TAG
    subprocess.run(["buildah", "rmi", "--prune"], capture_output=True)


def run_in(image: str, script: str, timeout: float = 1200) -> str:
    """``script`` (bash) in a fresh container of ``image``, with no network (a namespace holding only
    loopback) and the host's name, as under Apptainer (buildah's own name for the container resolves
    nowhere, and Horovod's gloo start-up crashes on that); the container is removed afterwards.
    Returns stdout + stderr; a failure fails the test."""
    ctr = subprocess.run(["buildah", "from", image], capture_output=True, text=True, check=True).stdout.strip()
    try:
        inner = f"ip link set lo up && exec buildah run --isolation chroot --uts host {ctr} -- bash -c {_quote(script)}"
        proc = subprocess.run(["unshare", "--net", "bash", "-c", inner], capture_output=True, text=True,
                              timeout=timeout)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


@needs_buildah
def test_build_refuses_to_start_without_room_for_the_image_and_leaves_nothing():
    before = subprocess.run(["buildah", "containers", "--quiet"], capture_output=True, text=True).stdout
    proc = subprocess.run(_build_command("localhost/chexflow-test:no-room"), cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "CHEXFLOW_IMAGE_FREE_GB": "1000000"}, timeout=120)
    assert proc.returncode == 1
    assert re.search(r"build-image: /\S+ has \d+ GB free, the build needs about 1000000 GB", proc.stderr)
    assert "buildah rmi --prune" in proc.stderr
    assert subprocess.run(["buildah", "containers", "--quiet"], capture_output=True, text=True).stdout == before


@in_image
def test_second_build_of_the_same_checkout_is_taken_from_the_cache(image):
    first = _image_id(image)
    proc, seconds = _build(image)
    steps = [line for line in proc.stderr.splitlines() if line.startswith("STEP ")]
    cached = [line for line in proc.stderr.splitlines() if line.startswith("--> Using cache")]
    print(f"cached build: {seconds:.0f} s, {len(cached)} of {len(steps) - 1} steps from the cache")
    assert len(cached) == len(steps) - 1 > 10                     # every step but FROM
    assert _image_id(image) == first


@in_image
def test_image_records_the_commit_and_the_pins(image):
    info = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True,
                                     text=True, check=True).stdout)
    labels = info["OCIv1"]["config"]["Labels"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert labels["org.opencontainers.image.revision"] in (head, f"{head}-dirty")
    pins = dict(line.split("==") for line in (REPO / "envs/requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert dict(p.split("==") for p in labels["io.chexflow.pins"].split()) == pins
    out = run_in(image, "cat /usr/share/chexflow/image.txt; echo ====; cat /usr/share/chexflow/pip-freeze.txt")
    recorded, freeze = out.split("====\n", 1)
    assert f"commit: {labels['org.opencontainers.image.revision']}" in recorded
    installed = dict(line.split("==", 1) for line in freeze.splitlines() if "==" in line)
    installed = {name.lower().replace("_", "-"): v for name, v in installed.items()}
    assert {name: installed.get(name.lower()) for name in pins} == pins      # what envs/setup.sh pinned
    horovod = [line for line in freeze.splitlines() if line.lower().startswith("horovod")]
    assert len(horovod) == 1 and "0.28.1" in horovod[0], horovod         # (from the wheel cache: a file URL)


@in_image
def test_the_image_carries_the_installers_patches(image):
    """envs/setup.sh's edits of installed packages, made inside the image as on a workstation: the SLURM plugin's
    node-failure fix, torchvision and torch without TorchDynamo when nothing compiles (`--check` exits 1 if not)."""
    out = run_in(image, "cd /opt/chexflow && for m in slurm_plugin torchvision_dynamo torch_dynamo; do "
                        "PYTHONPATH=envs python -m chexflow_install.$m --check || echo NOT $m; done")
    assert "NOT" not in out, out[-3000:]
    assert out.count("torch 2.14.1 is patched") == 3 and "torchvision 0.29.1 is patched" in out, out[-3000:]


@in_image
def test_chexflow_help_in_the_image(image):
    out = run_in(image, "/opt/chexflow/envs/container-entrypoint.sh --help && cd /tmp && chexflow --help "
                        "&& snakemake --version && python -c 'import sys; print(sys.prefix)'")
    assert out.count("usage: chexflow") == 2 and "launch" in out
    assert "9.27.1" in out and "/opt/chexflow/.venv" in out


@in_image
def test_horovod_in_the_image_runs_two_ranks(image):
    """Two ranks started by `chexflow launch` (horovodrun, gloo) allreduce their rank + 1: 1 + 2 = 3."""
    program = ("import horovod.torch as hvd, torch; hvd.init(); "
               "s = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum); "
               "print(f'rank {hvd.rank()} of {hvd.size()}: sum {s.item():g}', flush=True)")
    out = run_in(image, f"cd /tmp && chexflow launch --backend horovod -n 2 -- python -c {_quote(program)}")
    assert "rank 0 of 2: sum 3" in out and "rank 1 of 2: sum 3" in out, out[-3000:]


@in_image
def test_demo_chain_in_the_image_gives_the_host_metrics(image, tiny_run):
    """The demo's workflow, every rule of `all` (`snakemake --profile profiles/default`, 2 Horovod ranks
    per training job), offline inside the image, at the tiny scale of test_workflow's chain: the host's
    run of the same config in this test run (conftest.once_per_run: the suite runs it once for both).
    The same machine, so the same kernels: the same models, predictions and test metrics, bit for bit
    (test_workflow.run_facts, computed inside the image on its run: this is also the reproducibility
    test's second run, test_workflow.IMAGE_CHAIN), finding by finding (no figure from another host is
    pinned); each finding's AUROC recomputed here from the predictions the image wrote (scikit-learn).
    The default demo's own size is a user's run (README command 1); this is its chain, on the smallest
    data and model that run every rule."""
    host_work = _finished(tiny_run)
    host = json.loads((host_work / "results/evaluate/metrics.json").read_text())
    config = tiny_run.cfgfile.read_text()
    facts_program = inspect.getsource(run_facts) + "\nimport json\nprint(json.dumps(run_facts('/tmp/tiny')))\n"
    assert "\nEOF\n" not in config + facts_program
    out = run_in(image, f"mkdir /tmp/tiny && cat > /tmp/tiny/config.yaml <<'EOF'\n{config}EOF\n"
                        "cd /opt/chexflow && snakemake --profile profiles/default -d /tmp/tiny --cores 2 "
                        f"--configfile /tmp/tiny/config.yaml {' '.join(RANKS)} > /tmp/demo.log 2>&1 "
                        "|| { tail -n 80 /tmp/demo.log; exit 1; }; cd /tmp/tiny/results/evaluate && "
                        "cat metrics.json; echo; echo ====; cat predictions.csv; echo ====; "
                        f"python - <<'EOF'\n{facts_program}EOF\n",
                 timeout=2000)
    metrics_text, csv, facts = out.split("====\n")
    metrics = json.loads(metrics_text[metrics_text.index("{"):])
    assert metrics["n_images"] == host["n_images"] > 0
    labels = metrics["mean_auroc_labels"]
    print("finding: AUROC in the image / on the host")
    for label in labels:
        print(f"  {label}: {metrics['labels'][label]['auroc']!r} / {host['labels'][label]['auroc']!r}")
    assert labels == host["mean_auroc_labels"] and len(labels) == 14
    assert {c: metrics["labels"][c]["auroc"] for c in labels} == {c: host["labels"][c]["auroc"] for c in labels}
    assert metrics["mean_auroc"] == host["mean_auroc"]
    assert csv == (host_work / "results/evaluate/predictions.csv").read_text()
    # (run_in returns stdout, then stderr: the facts are the section's first JSON line)
    image_facts, host_facts = json.loads(next(line for line in facts.splitlines() if line.startswith("{"))), \
        run_facts(host_work)
    image_m, host_m = image_facts["metrics.json"], host_facts["metrics.json"]
    assert image_facts == host_facts, {k: (image_m.get(k), host_m.get(k)) for k in image_m.keys() | host_m.keys()
                                       if image_m.get(k) != host_m.get(k)}     # the metrics that differ, if any
    pred = pd.read_csv(io.StringIO(csv))
    assert len(pred) == metrics["n_images"]
    for label in labels:        # the file holds the scores exactly (evaluate.record.FLOAT_FORMAT): so does its AUROC
        assert roc_auc_score(pred[label], pred[f"{label}_score"]) == metrics["labels"][label]["auroc"], label
    assert np.mean([metrics["labels"][c]["auroc"] for c in labels]) == pytest.approx(metrics["mean_auroc"], abs=1e-12)
