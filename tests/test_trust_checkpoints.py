"""Every .pt chexflow reads is untrusted (issue 17 items 1, 2, 6, 7; issue 20 item 3).

A planted pickle never runs and never defeats pruning; a stale or foreign model is never taken for
this run's (best model keyed by run id, model files with a format version and run id, checked by
every reader); a full disk names the path and the free space and leaves nothing half-written; the
epoch-end checkpoint is written once and a max_steps stop resumes exactly. The hostile files are
generated here, never stored in the repository.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chexflow.settings import from_dict
from chexflow.train.config import TrainConfig
from chexflow.studies import sweep
from chexflow.train import checkpoint as ckpt
from chexflow.train import trainer as T
from chexflow.train import identity
from chexflow.train.backends import Backend
from chexflow.train.models import build_model
from conftest import checkpoint_step, cli_env
from test_distributed import train_cfg

LABELS = ["Atelectasis", "Cardiomegaly", "Effusion"]


class _Marker:
    """Unpickling this runs a shell command that creates a marker file (what an attacker's file does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_zip(path: Path, marker: Path) -> None:
    """A torch zip archive whose pickle calls os.system (the shape of a real checkpoint)."""
    torch.save({"model": {"w": torch.zeros(2)}, "run_id": path.stem.rsplit("-", 1)[-1], "x": _Marker(marker)}, path)


def plant_bare(path: Path, marker: Path) -> None:
    """A bare pickle (the issue's reproduction: torch.load ran it while looking for a magic number)."""
    path.write_bytes(pickle.dumps({"x": _Marker(marker)}, protocol=2))


def _state(step, run_id="r1"):
    return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {}, "scheduler": {},
            "step": step, "epoch": 0, "step_in_epoch": step, "run_id": run_id}


def _record(**over):
    base = dict(state_dict={"w": torch.zeros(3)}, run_id="abc", stage="finetune", dataset="nih_demo",
                task="multilabel", labels=LABELS, arch="resnet18", in_channels=1, crop=32, epoch=1,
                val_metric=0.6, val_metric_name="mean_auroc", config={})
    return ckpt.model_record(**{**base, **over})


# ------------------------------------------------------------------ 17.1: nothing runs code
@pytest.mark.parametrize("plant", [plant_zip, plant_bare], ids=["torch-zip", "bare-pickle"])
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, plant):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "step-000000999-r1.pt"
    plant(evil, marker)
    with pytest.raises(ckpt.RefusedFile) as err:
        ckpt.load_pt(evil)
    assert not marker.exists(), "unpickling ran the planted command"
    msg = str(err.value)
    assert msg.startswith(f"{evil}: refused: ")
    if plant is plant_zip:
        assert "not a weights-only file (unpickling would run code: GLOBAL posix.system)" in msg
    else:
        assert "not a torch zip archive" in msg
    # the same file as a model file: refused the same way (evaluation, init, selection, predict)
    with pytest.raises(ckpt.ModelFileError, match="refused"):
        ckpt.load_model_file(evil)
    assert not marker.exists()


def test_refused_checkpoints_are_set_aside_and_do_not_defeat_pruning(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=2)
    marker = tmp_path / "PWNED"
    plant_zip(tmp_path / "step-000000999-r1.pt", marker)
    plant_bare(tmp_path / "step-000000998-r1.pt", marker)
    # valid pickles that are not what they claim: another run inside, another step inside, old format
    ckpt.save_atomic({**_state(997, "other"), "format": ckpt.CHECKPOINT_FORMAT}, tmp_path / "step-000000997-r1.pt")
    ckpt.save_atomic({**_state(5), "format": ckpt.CHECKPOINT_FORMAT}, tmp_path / "step-000000996-r1.pt")
    ckpt.save_atomic(_state(995), tmp_path / "step-000000995-r1.pt")
    ckpt.save_atomic({**_state(994), "format": ckpt.CHECKPOINT_FORMAT, "history": "x"}, tmp_path / "step-000000994-r1.pt")
    logs: list[str] = []
    path, state = ckpt.load_newest_valid(tmp_path, run_id="r1", log=logs.append)
    assert not marker.exists()
    assert state["step"] == 3 and path.name == "step-000000003-r1.pt"
    reasons = {m.split("checkpoint ", 1)[1].split(" refused: ", 1)[0].rsplit("/", 1)[-1]: m for m in logs
               if " refused: " in m}
    assert "unpickling would run code: GLOBAL posix.system" in reasons["step-000000999-r1.pt"]
    assert "not a torch zip archive" in reasons["step-000000998-r1.pt"]
    assert "names run 'other', not this run 'r1'" in reasons["step-000000997-r1.pt"]
    assert "its name says step 996, its content step 5" in reasons["step-000000996-r1.pt"]
    assert "checkpoint format 1; this chexflow" in reasons["step-000000995-r1.pt"]
    assert "its 'history' is not a list of validated epochs" in reasons["step-000000994-r1.pt"]
    assert sorted(p.name for p in tmp_path.glob("*.refused")) == [f"step-00000099{i}-r1.pt.refused" for i in range(4, 10)]
    # pruning keeps this run's newest real checkpoints
    for step in (4, 5):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path, run_id="r1")] == [4, 5]
    # a file of this run's name planted above the current step after the resume does not count either
    plant_zip(tmp_path / "step-000000900-r1.pt", marker)
    ckpt.save_checkpoint(tmp_path, 6, _state(6), keep=2)
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path, run_id="r1")] == [5, 6, 900]
    assert not marker.exists()


# ------------------------------------------------------------------ 20.3: the model file validator
def test_model_file_round_trip_and_every_refusal_names_the_difference(tmp_path):
    good = tmp_path / "model.pt"
    net = build_model("resnet18", in_channels=1, num_outputs=3)
    ckpt.save_atomic(_record(state_dict=net.state_dict()), good)
    model, info = ckpt.load_model(good, expect={"task": "multilabel", "labels": LABELS, "run_id": "abc"})
    assert info["format"] == ckpt.MODEL_FORMAT and info["run_id"] == "abc" and not model.training
    assert torch.equal(model.state_dict()["fc.1.weight"], net.state_dict()["fc.1.weight"])
    assert ckpt.load_model_file(good, expect={"run_id": {"x", "abc"}})["epoch"] == 1

    def refused(expect=None, **fields) -> str:
        path = tmp_path / "other.pt"
        obj = _record(state_dict=net.state_dict())
        obj.update(fields)
        torch.save(obj, path)
        with pytest.raises(ckpt.ModelFileError) as err:
            ckpt.load_model(path, expect=expect)
        assert str(err.value).startswith(f"{path}: refused: ")
        return str(err.value)

    # another chexflow version: no format (main before this change) or another format number
    old = _record(state_dict=net.state_dict())
    del old["format"]
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(ckpt.ModelFileError, match="no model format version"):
        ckpt.load_model_file(tmp_path / "old.pt")
    assert f"model format 7 (chexflow 0.0.1); this chexflow {ckpt.__version__} reads model format 1" in \
        refused(format=7, chexflow_version="0.0.1")
    # another task: a multiclass pretraining model handed to multi-label evaluation
    assert "task: the file's 'multiclass', expected 'multilabel'" in refused({"task": "multilabel"}, task="multiclass")
    # other labels (same count): the first difference is named
    msg = refused({"labels": LABELS}, labels=["Atelectasis", "Mass", "Effusion"])
    assert "labels: the file has 3, expected 3; first difference at position 1: the file's 'Mass', expected " \
           "'Cardiomegaly'" in msg
    # another architecture, and weights that do not fit what the file says it is
    assert "arch: the file's 'resnet34', expected 'resnet18'" in refused({"arch": "resnet18"}, arch="resnet34")
    assert "its weights do not fit resnet18 with 1 input channel(s) and 4 outputs" in \
        refused(num_outputs=4, labels=LABELS + ["Mass"])
    # another run, both ids named
    assert "run_id: the file's 'abc', expected 'def'" in refused({"run_id": "def"})
    assert "run_id: the file's 'abc', expected one of ['d1', 'd2']" in refused({"run_id": frozenset({"d1", "d2"})})
    assert "labels (2) do not name its 3 outputs" in refused(labels=LABELS[:2])
    torch.save([torch.zeros(1)], tmp_path / "plain.pt")
    with pytest.raises(ckpt.ModelFileError, match="not a chexflow model file \\(holds a list\\)"):
        ckpt.load_model_file(tmp_path / "plain.pt")


def test_sweep_selection_copies_only_the_winners_own_model(tmp_path):
    results = []
    for trial, val in (("t000", 0.6), ("t001", 0.7)):
        model = tmp_path / f"{trial}.pt"
        ckpt.save_atomic(_record(run_id=f"run{trial}", val_metric=val), model)
        r = tmp_path / f"{trial}.json"
        r.write_text(json.dumps({"trial": trial, "params": {}, "status": "ok", "val_metric": val,
                                 "val_metric_name": "mean_auroc", "reason": None, "model": str(model),
                                 "run_id": f"run{trial}"}))
        results.append(r)
    kw = dict(out_csv=tmp_path / "trials.csv", out_json=tmp_path / "selection.json", out_model=tmp_path / "winner.pt")
    assert sweep.write_selection(results, **kw)["winner"]["trial"] == "t001"
    assert ckpt.load_model_file(tmp_path / "winner.pt")["run_id"] == "runt001"
    # the winner's file was replaced by another run's model (stale): refused naming both run ids
    shutil.copyfile(tmp_path / "t000.pt", tmp_path / "t001.pt")
    with pytest.raises(ckpt.ModelFileError, match="run_id: the file's 'runt000', expected 'runt001'"):
        sweep.write_selection(results, **kw)


# ------------------------------------------------------------------ 17.6: disk full
@pytest.fixture
def small_fs(tmp_path):
    """A real 4 MiB file system (tmpfs; we are root in the sandbox and CI)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_names_path_free_space_and_cause_and_leaves_nothing(small_fs):
    first = ckpt.save_checkpoint(small_fs, 1, {**_state(1), "model": {"w": torch.zeros(250_000)}}, keep=3)   # 1 MB
    big = {**_state(2), "model": {"w": torch.zeros(2_000_000)}}                                              # 8 MB
    with pytest.raises(ckpt.WriteError) as err:
        ckpt.save_checkpoint(small_fs, 2, big, keep=3)
    msg = str(err.value)
    path = ckpt.checkpoint_path(small_fs, 2, "r1")
    free = shutil.disk_usage(small_fs).free
    assert msg.startswith(f"{path}: not written: the file system is full (")
    assert f"{free / 2**20:.1f} MiB free of 4.0 MiB on its file system; the file needs about 7.6 MiB" in msg
    assert "nothing half-written was left" in msg and "inline_container.cc" in msg    # torch's own words kept
    assert sorted(p.name for p in small_fs.iterdir()) == [first.name], "a temp file or half checkpoint remained"
    assert ckpt.load_newest_valid(small_fs, run_id="r1", log=print)[1]["step"] == 1


@pytest.mark.slow
def test_trainer_on_a_full_disk_fails_naming_the_checkpoint(demo_manifest, tmp_path, small_fs):
    # ResNet-18: a checkpoint (85 MiB) larger than the small file system
    cfg = from_dict(TrainConfig, train_cfg("single", channels_last="auto", max_steps=2, epochs=1,
                                               model={"arch": "resnet18"}, checkpoint={"every_steps": 1, "keep": 2}))
    t = T.Trainer(cfg, T.TrainPaths(manifest=demo_manifest, out_dir=tmp_path / "out", ckpt_dir=small_fs), Backend())
    with pytest.raises(ckpt.WriteError, match=r"step-000000001-\w+\.pt: not written: the file system is full"):
        t.fit()
    assert list(small_fs.iterdir()) == []
    assert not (tmp_path / "out" / "model.pt").exists()


# ------------------------------------------------------------------ through the real trainer and CLI
def _cli_train(cfg: dict, manifest: Path, work: Path, tag: str, pretrained: Path | None = None):
    cmd = [sys.executable, "-m", "chexflow", "train", "--config-json", json.dumps(cfg), "--manifest", str(manifest),
           "--out-dir", str(work / "out"), "--ckpt-dir", str(work / "ckpt")]
    if pretrained is not None:
        cmd += ["--pretrained", str(pretrained)]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    (work / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    return proc


def _small(**over) -> dict:
    """A short fine-tuning run on one process: 4 steps per epoch of the demo data."""
    base = {"channels_last": "auto", "epochs": 2, "data": {"crop": 32, "workers": 0, "shuffle_buffer": 16,
                                                            "samples_per_epoch": 32},
            "checkpoint": {"every_steps": 2, "keep": 2}}
    return train_cfg("single", **{**base, **over})


@pytest.mark.slow
def test_planted_checkpoints_never_run_and_the_run_resumes_from_the_newest_valid(demo_manifest, tmp_path):
    first = _small(max_steps=3)
    proc = _cli_train(first, demo_manifest, tmp_path, "first")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = identity.run_id(from_dict(TrainConfig, first), demo_manifest, None)
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "ckpt", run_id=run_id)] == [2, 3]
    marker = tmp_path / "PWNED"
    plant_zip(tmp_path / "ckpt" / f"step-000000050-{run_id}.pt", marker)
    plant_bare(tmp_path / "ckpt" / f"step-000000060-{run_id}.pt", marker)
    (tmp_path / "out" / "model.pt").unlink()
    proc = _cli_train(_small(max_steps=6), demo_manifest, tmp_path, "second")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert not marker.exists(), "a planted checkpoint ran code"
    assert (f"step-000000050-{run_id}.pt refused: not a weights-only file (unpickling would run code: GLOBAL "
            "posix.system)") in log
    assert f"step-000000060-{run_id}.pt refused: not a torch zip archive" in log
    assert f"resuming from {tmp_path / 'ckpt'}/step-000000003-{run_id}.pt at step 3" in log
    # set aside, and pruning (keep 2) kept this run's two newest real checkpoints
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.refused")) == \
        [f"step-000000050-{run_id}.pt.refused", f"step-000000060-{run_id}.pt.refused"]
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "ckpt", run_id=run_id)] == [4, 6]
    assert ckpt.load_model_file(tmp_path / "out" / "model.pt", expect={"run_id": run_id})["epoch"] in (1, 2)


def _one_image_val_manifest(manifest: Path, root: Path) -> Path:
    """The demo data with a validation split of one image: no label has both classes there, so the
    validation mean AUROC is NaN in every epoch (a real data set, not a patched metric)."""
    import tarfile
    from chexflow.fsutil import sha256_file
    m = json.loads(manifest.read_text())
    src = manifest.parent / m["splits"]["val"]["shards"][0]["path"]
    root.mkdir(parents=True)
    one = root / "val-one.tar"
    with tarfile.open(src) as tin, tarfile.open(one, "w", format=tarfile.USTAR_FORMAT) as tout:
        members = tin.getmembers()
        key = members[0].name.split(".", 1)[0]
        for member in members:
            if member.name.split(".", 1)[0] == key:
                tout.addfile(member, tin.extractfile(member))
    for split in m["splits"].values():     # shards stay inside their manifest's folder: copies
        for s in split["shards"]:
            (root / s["path"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(manifest.parent / s["path"], root / s["path"])
    m["splits"]["val"]["shards"] = [{"path": one.name, "count": 1, "sha256": sha256_file(one)}]
    m["splits"]["val"]["n_images"] = 1
    out = root / "manifest.json"
    out.write_text(json.dumps(m))
    return out


@pytest.mark.slow
def test_no_valid_epoch_fails_and_never_writes_a_stale_model(demo_manifest, tmp_path):
    """Issue 17.2 as reproduced: a previous configuration's best model in the checkpoint directory,
    then a run that validates no epoch (none runs; NaN metric every epoch) wrote model.pt from it."""
    previous = _small(epochs=1)
    proc = _cli_train(previous, demo_manifest, tmp_path, "previous")
    assert proc.returncode == 0, proc.stderr[-3000:]
    prev_id = identity.run_id(from_dict(TrainConfig, previous), demo_manifest, None)
    best = tmp_path / "ckpt" / f"best-{prev_id}.pt"
    assert ckpt.load_model_file(best, expect={"run_id": prev_id, "epoch": 1})
    shutil.copyfile(best, tmp_path / "ckpt" / "best.pt")        # the name main used for every run
    (tmp_path / "out" / "model.pt").unlink()                     # Snakemake removes the outputs before a rerun

    # finetune.epochs: -1 (the config's range check refuses it too; the trainer refuses on its own)
    proc = _cli_train(_small(epochs=-1), demo_manifest, tmp_path, "no-epoch")
    assert proc.returncode != 0
    assert "epochs" in proc.stderr and "-1" in proc.stderr
    assert not (tmp_path / "out" / "model.pt").exists()
    # the trainer's own refusal, for a config that got past validation (built without it)
    cfg = from_dict(TrainConfig, _small())
    object.__setattr__(cfg, "epochs", 0)
    paths = T.TrainPaths(manifest=demo_manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt")
    with pytest.raises(T.NoValidEpoch, match=r"finetune: no epoch ran \(finetune.epochs: 0, .*no model written"):
        T.Trainer(cfg, paths, Backend()).fit()
    assert not (tmp_path / "out" / "model.pt").exists()

    # a NaN validation metric in every epoch
    nan_manifest = _one_image_val_manifest(demo_manifest, tmp_path / "one-val")
    proc = _cli_train(_small(), nan_manifest, tmp_path, "nan")
    assert proc.returncode == T.EXIT_NO_VALID_EPOCH, proc.stderr[-3000:]
    assert ("finetune: the validation mean_auroc was not finite in any epoch (epoch 1: nan, epoch 2: nan); "
            "no model written") in proc.stderr
    assert not (tmp_path / "out" / "model.pt").exists()
    assert best.exists(), "another run's files are left alone"


@pytest.mark.slow
def test_evaluation_refuses_a_model_of_another_config_naming_both_run_ids(demo_manifest, tmp_path):
    trained = _small(epochs=1)
    proc = _cli_train(trained, demo_manifest, tmp_path, "train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = tmp_path / "out" / "model.pt"
    ev = json.dumps({"batch_size": 64, "bootstrap_resamples": 20})

    def evaluate(train_section: dict, out: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "chexflow", "evaluate", "--config-json", ev, "--model", str(model),
                               "--manifest", str(demo_manifest), "--out-dir", str(tmp_path / out),
                               "--train-config-json", json.dumps(train_section)],
                              env=cli_env(), capture_output=True, text=True, timeout=600)

    other = _small(epochs=1, optim={"lr": 0.01})
    proc = evaluate(other, "wrong")
    own_id = identity.run_id(from_dict(TrainConfig, trained), demo_manifest, None)
    other_id = identity.run_id(from_dict(TrainConfig, other), demo_manifest, None)
    assert proc.returncode != 0
    assert f"{model}: refused: not the model expected here: run_id: the file's '{own_id}', expected '{other_id}'" \
        in proc.stderr
    assert not (tmp_path / "wrong" / "metrics.json").exists()
    proc = evaluate(trained, "right")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "right" / "metrics.json").read_text())
    assert metrics["model_run_id"] == own_id and metrics["model_run_id_checked"] is True


@pytest.mark.slow
def test_init_from_pretrained_refuses_another_architecture(demo_manifest, tmp_path):
    pre = tmp_path / "pretrain.pt"
    net = build_model("resnet34", in_channels=1, num_outputs=10)
    ckpt.save_atomic(_record(state_dict=net.state_dict(), arch="resnet34", task="multiclass",
                             labels=[str(i) for i in range(10)], stage="pretrain"), pre)
    cfg = from_dict(TrainConfig, _small(init="pretrained"))
    t = T.Trainer(cfg, T.TrainPaths(manifest=demo_manifest, out_dir=tmp_path / "out", ckpt_dir=tmp_path / "ckpt",
                                    pretrained=pre), Backend())
    model, opt, sched = t._build()
    with pytest.raises(ckpt.ModelFileError,
                       match=f"{pre}: refused: .*arch: the file's 'resnet34', expected '{cfg.model.arch}'"):
        t._restore(model, opt, sched)


# ------------------------------------------------------------------ 17.7: one write per step, exact resume
def _fit(cfg: TrainConfig, manifest: Path, work: Path, writes: list[str] | None = None, monkeypatch=None):
    if writes is not None:
        real = ckpt.save_atomic
        monkeypatch.setattr(ckpt, "save_atomic", lambda obj, path: (writes.append(Path(path).name), real(obj, path)))
    t = T.Trainer(cfg, T.TrainPaths(manifest=manifest, out_dir=work / "out", ckpt_dir=work / "ckpt"), Backend())
    assert t.fit() == 0
    return t


def _rows(work: Path) -> list[dict]:
    return [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_epoch_end_checkpoint_written_once_and_max_steps_stop_resumes_exactly(demo_manifest, tmp_path, monkeypatch):
    # 4 steps per epoch, 2 epochs, a checkpoint every 2 steps: steps 2, 4 (epoch end), 6, 8 (end)
    cfg = from_dict(TrainConfig, _small(checkpoint={"every_steps": 2, "keep": 10}))
    writes: list[str] = []
    ref = _fit(cfg, demo_manifest, tmp_path / "ref", writes, monkeypatch)
    steps = [int(w.split("-")[1]) for w in writes if w.startswith("step-")]
    assert steps == [2, 4, 6, 8], f"each step's checkpoint once: {writes}"
    assert [w for w in writes if not w.startswith("step-")] == \
        [f"best-{ref.run_id}.pt"] * len([w for w in writes if w.startswith("best-")]) + ["model.pt"]

    # stopped by max_steps inside epoch 1, then resumed without it: the uninterrupted run exactly
    work = tmp_path / "stop"
    stopped = _fit(dataclasses.replace(cfg, max_steps=3), demo_manifest, work)
    rows = _rows(work)
    assert [(r["epoch"], r["step"], r.get("max_steps_stop")) for r in rows] == [(1, 3, True)]
    first_model = ckpt.load_model_file(work / "out" / "model.pt", expect={"run_id": stopped.run_id})
    assert first_model["epoch"] == 1 and first_model["val_metric"] == rows[0]["val_metric"]
    # the same stopped run again (its outputs removed): nothing left to train, the same model
    (work / "out" / "model.pt").unlink()
    _fit(dataclasses.replace(cfg, max_steps=3), demo_manifest, work)
    again = ckpt.load_model_file(work / "out" / "model.pt")
    assert all(torch.equal(again["state_dict"][k], v) for k, v in first_model["state_dict"].items())
    resumed = _fit(cfg, demo_manifest, work)
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), f"{k} differs after a max_steps stop + resume"
    got, want = _rows(work), _rows(tmp_path / "ref")
    assert [(r["epoch"], r["step"]) for r in got] == [(r["epoch"], r["step"]) for r in want] == [(1, 4), (2, 8)]
    for key in ("train_loss", "val_loss", "val_metric", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key
