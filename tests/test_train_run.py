"""One way into training: chexflow.train.run.start runs a training run, in this process (a rank) or
through a launcher, and returns its outcome; `chexflow train`, the scaling study and the sweep all
use it, and the exit codes and the divergence marker exist once."""
from __future__ import annotations

import ast
import json
import os
import signal
import threading
import time

import pytest

from chexflow.settings import from_dict
from chexflow.train import checkpoint as ckpt
from chexflow.train import trainer as T
from chexflow.train import identity
from chexflow.train.config import TrainConfig
from chexflow.train.run import start
from conftest import REPO, cli_env
from test_distributed import train_cfg

PACKAGE = REPO / "workflow" / "chexflow"


def _cfg(**over) -> TrainConfig:
    base = {"channels_last": "auto", "epochs": 1, "max_steps": 4, "checkpoint": {"every_steps": 2, "keep": 3}}
    return from_dict(TrainConfig, train_cfg("single", **{**base, **over}))


def _paths(tmp_path, manifest) -> T.TrainPaths:
    return T.TrainPaths(manifest=manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt")


@pytest.mark.slow
def test_finished_and_diverged_runs_in_this_process(demo_manifest, tmp_path):
    cfg = _cfg()
    done = start(cfg, _paths(tmp_path, demo_manifest))
    assert (done.status, done.exit_code, done.finished) == ("finished", 0, True)
    assert done.run_id == identity.run_id(cfg, demo_manifest, None)
    assert done.model == tmp_path / "out/model.pt" and done.model.is_file()

    bad = _cfg(optim={"lr": 1e30}, check_every_steps=1, max_steps=None)
    out = start(bad, _paths(tmp_path / "bad", demo_manifest))
    assert (out.status, out.exit_code, out.model) == ("diverged", T.EXIT_DIVERGED, None)
    marker = json.loads((tmp_path / "bad/out" / T.DIVERGED_MARKER).read_text())
    assert out.detail == f"non-finite training loss at step {marker['step']}"
    assert not (tmp_path / "bad/out/model.pt").exists()


@pytest.mark.slow
def test_a_stop_signal_ends_as_interrupted_with_a_checkpoint(demo_manifest, tmp_path):
    """SIGTERM once the first periodic checkpoint exists: the run stops at its next check, checkpoints
    and says it was interrupted (exit 143: the job fails and a retry resumes)."""
    cfg = _cfg(max_steps=None, epochs=3)
    paths = _paths(tmp_path, demo_manifest)

    def stop_after_first_checkpoint():
        while not ckpt.list_checkpoints(paths.ckpt_dir):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_after_first_checkpoint, daemon=True).start()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        out = start(cfg, paths)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (out.status, out.exit_code, out.model) == ("interrupted", T.EXIT_PREEMPTED, None)
    assert len(ckpt.list_checkpoints(paths.ckpt_dir)) >= 2 and not (tmp_path / "out/model.pt").exists()


@pytest.mark.slow
def test_through_a_launcher_the_ranks_verdict_comes_back(demo_manifest, tmp_path, monkeypatch):
    """`chexflow launch -n 1 chexflow train ...` (what a sweep trial runs): finished with the model,
    and ranks that fail on a broken manifest as crashed, with their last lines."""
    for key in ("PATH", "PYTHONPATH"):
        monkeypatch.setenv(key, cli_env()[key])
    cfg = _cfg()
    done = start(cfg, _paths(tmp_path, demo_manifest), launcher=["chexflow", "launch"], ranks=1)
    assert (done.status, done.exit_code) == ("finished", 0) and done.model.is_file()
    assert done.run_id == identity.run_id(cfg, demo_manifest, None)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    out = start(cfg, _paths(tmp_path / "b", broken), launcher=["chexflow", "launch"], ranks=1)
    assert out.status == "crashed" and out.exit_code not in (0, T.EXIT_DIVERGED) and out.model is None
    assert any("broken.json" in line for line in out.log_tail), out.log_tail


def _calls(name: str, *, methods: bool = True) -> dict[str, int]:
    """Package modules calling ``name(...)`` (a function or class; ``methods``: also ``x.name(...)``),
    with the count."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        n = sum(1 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
                and (getattr(node.func, "id", None) == name or methods and getattr(node.func, "attr", None) == name))
        if n:
            found[path.relative_to(PACKAGE).as_posix()] = n
    return found


def test_one_way_into_training():
    """Only train/run.py builds a Trainer; the three entries call its start()."""
    assert _calls("Trainer") == {"train/run.py": 1}
    # (imported by name, as the next lines check; thread.start() is no way into training)
    assert _calls("start", methods=False) == {"cli.py": 1, "studies/scaling.py": 1, "studies/sweep.py": 1}
    for module in ("cli.py", "studies/scaling.py", "studies/sweep.py"):
        assert "from chexflow.train.run import start" in (PACKAGE / module).read_text(), module


def test_exit_codes_and_the_divergence_marker_exist_once():
    defined, literals = {}, {}
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if getattr(target, "id", None) in ("EXIT_PREEMPTED", "EXIT_DIVERGED", "DIVERGED_MARKER"):
                        defined.setdefault(target.id, set()).add(where)
            literal = isinstance(node, ast.Constant) and not isinstance(node.value, bool)
            if literal and node.value in ("diverged.json", 143):
                literals.setdefault(node.value, set()).add(where)
    assert defined == {name: {"train/epoch_report.py"} for name in ("EXIT_PREEMPTED", "EXIT_DIVERGED", "DIVERGED_MARKER")}
    assert literals == {"diverged.json": {"train/epoch_report.py"}, 143: {"train/epoch_report.py"}}
