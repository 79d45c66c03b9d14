"""Only regular files are read, boundedly: a FIFO, a device node or a symbolic link with a name chexflow
reads (a step checkpoint, a model file, an archive, an image to predict, a list of them) never blocks,
never streams without end, and its target's bytes never appear in a message or the predictions'
error column. Blocking cases run in subprocesses with a timeout (a hang fails the test, it does not
stop the suite). The hostile files are made here."""
from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from chexflow.data import fashion_mnist, imagenet, nih
from chexflow.data.archives import ArchiveError
from chexflow.fsutil import NotRegularFile, ReplacedWhileOpening, check_regular, open_regular, read_regular
from chexflow.predict import files
from chexflow.settings import from_dict
from chexflow.train import checkpoint as ckpt
from chexflow.train import identity
from chexflow.train.config import TrainConfig
from conftest import checkpoint_step, cli_env, module_scratch
from test_predict import Study, read_predictions
from test_trust_checkpoints import _cli_train, _small

PASSWD = b"root:*:0:0:System Administrator:/var/root:/bin/sh\n"


@pytest.fixture(autouse=True)
def _alarm():
    """A blocking open would raise here after 10 minutes instead of hanging the suite (the subprocesses have
    their own, shorter timeouts)."""
    def hung(*_):
        raise TimeoutError("blocked")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(600)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def _secret(tmp_path: Path) -> Path:
    """A file outside every folder chexflow is given, holding what an attacker would want echoed."""
    path = tmp_path / "outside" / "passwd"
    path.parent.mkdir(parents=True)
    path.write_bytes(PASSWD)
    return path


# --------------------------------------------------------------------------- the helper

def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "p")
    with pytest.raises(NotRegularFile) as ei:
        open_regular(tmp_path / "p")
    assert str(ei.value) == f"{tmp_path / 'p'}: a FIFO (named pipe), not a regular file; not read"
    assert ei.value.strerror == "a FIFO (named pipe), not a regular file; not read"


def test_a_refusal_crosses_a_process_boundary_unchanged(tmp_path):
    """The trainer hands rank 0's OSError to every rank by pickling it (broadcast_object): the copy
    must name the same file, reason and errno, for the subclasses too."""
    os.mkfifo(tmp_path / "p")
    with pytest.raises(NotRegularFile) as ei:
        open_regular(tmp_path / "p")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 10)
    with pytest.raises(NotRegularFile) as too_big:
        open_regular(big, max_bytes=1)
    for exc in (ei.value, too_big.value, ReplacedWhileOpening(tmp_path / "s", "a regular file (replaced); not read")):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc)
        assert (str(copy), copy.filename, copy.strerror, copy.errno) == (str(exc), exc.filename, exc.strerror,
                                                                          exc.errno)


def test_a_device_and_a_link_to_it_are_refused(tmp_path):
    (tmp_path / "zero").symlink_to("/dev/zero")
    for path in ("/dev/zero", tmp_path / "zero"):
        with pytest.raises(NotRegularFile, match=r": a character device, not a regular file; not read$"):
            read_regular(path)
    with pytest.raises(NotRegularFile, match="a directory, not a regular file"):
        open_regular(tmp_path)


def test_a_link_is_followed_only_where_the_user_named_the_path(tmp_path):
    secret = _secret(tmp_path)
    (tmp_path / "link").symlink_to(secret)
    assert read_regular(tmp_path / "link") == PASSWD
    for refuse in (lambda p: open_regular(p, follow_symlinks=False), lambda p: check_regular(p, follow_symlinks=False)):
        with pytest.raises(NotRegularFile) as ei:
            refuse(tmp_path / "link")
        assert "a symbolic link, not a regular file (links are not followed here); not read" in str(ei.value)
        assert "root:*:" not in str(ei.value)


def test_reads_stop_at_the_bound_and_never_echo_content(tmp_path):
    secret = _secret(tmp_path)
    with pytest.raises(NotRegularFile) as ei:
        read_regular(secret, max_bytes=10, what="label table")
    assert str(ei.value) == f"{secret}: label table of {len(PASSWD)} bytes, more than the 10 allowed; not read"
    assert read_regular(secret, max_bytes=len(PASSWD)) == PASSWD


# --------------------------------------------------------------------------- checkpoints and model files

@pytest.mark.slow
def test_a_fifo_named_like_a_step_checkpoint_is_set_aside_and_the_run_resumes(demo_manifest, tmp_path):
    first = _small(max_steps=3)
    assert _cli_train(first, demo_manifest, tmp_path, "first").returncode == 0
    run_id = identity.run_id(from_dict(TrainConfig, first), demo_manifest, None)
    fifo = tmp_path / "ckpt" / f"step-000000050-{run_id}.pt"
    os.mkfifo(fifo)
    (tmp_path / "out" / "model.pt").unlink()
    cmd = [sys.executable, "-m", "chexflow", "train", "--config-json", json.dumps(_small(max_steps=6)), "--manifest",
           str(demo_manifest), "--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)   # it used to hang here
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert f"checkpoint {fifo} refused: a FIFO (named pipe), not a regular file; not read" in log
    assert f"resuming from {tmp_path / 'ckpt'}/step-000000003-{run_id}.pt at step 3" in log
    assert stat.S_ISFIFO(os.lstat(f"{fifo}.refused").st_mode) and not fifo.exists()
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "ckpt", run_id=run_id)] == [4, 6]


def test_a_link_to_dev_zero_named_like_a_checkpoint_is_set_aside_unopened(tmp_path):
    good = tmp_path / "step-000000002-r1.pt"
    torch.save({"step": 2}, good)
    (tmp_path / "step-000000009-r1.pt").symlink_to("/dev/zero")
    code = ("import sys; from chexflow.train import checkpoint as c\n"
            "print([p.name for p in c.list_checkpoints(sys.argv[1], run_id='r1')])")
    proc = _python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['step-000000002-r1.pt']"
    assert (f"checkpoint {tmp_path}/step-000000009-r1.pt refused: a symbolic link, not a regular file (links are "
            "not followed here); not read; renamed to step-000000009-r1.pt.refused") in proc.stderr
    assert os.readlink(tmp_path / "step-000000009-r1.pt.refused") == "/dev/zero"


def test_a_model_file_that_is_a_device_or_a_fifo_is_refused(tmp_path):
    (tmp_path / "model.pt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "best-r1.pt")
    code = ("import sys; from chexflow.train import checkpoint as c\n"
            "for p in sys.argv[1:]:\n    try:\n        c.load_model_file(p)\n"
            "    except c.ModelFileError as e:\n        print(e)")
    proc = _python(code, str(tmp_path / "model.pt"), str(tmp_path / "best-r1.pt"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{tmp_path / 'model.pt'}: refused: a character device, not a regular file; not read",
        f"{tmp_path / 'best-r1.pt'}: refused: a FIFO (named pipe), not a regular file; not read"]


def test_a_fifo_as_the_checkpoint_directorys_lease_is_taken_over_unopened(tmp_path):
    os.mkfifo(tmp_path / "lease.json")
    os.utime(tmp_path / "lease.json", (1, 1))          # untouched for decades: stale
    code = ("import sys; from chexflow.train import lease\n"
            "held = lease.acquire(sys.argv[1], wait_s=5, stale_s=60, on_lost=print)\n"
            "print('held', held.holder.pid)\nheld.release()")
    proc = _python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (f"taking over the lease {tmp_path / 'lease.json'} (unreadable): {tmp_path / 'lease.json'}: a FIFO (named "
            "pipe), not a regular file; not read; not a chexflow lease; untouched for") in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("held ")


def test_a_zip_with_compressed_entries_is_refused(tmp_path):
    import zipfile
    with zipfile.ZipFile(tmp_path / "m.pt", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * 100_000)
    with pytest.raises(ckpt.RefusedFile, match="zip entry 'archive/data.pkl' is compressed or larger than the file"):
        ckpt.load_pt(tmp_path / "m.pt")


# --------------------------------------------------------------------------- archives

def test_a_link_to_dev_zero_as_an_archive_is_refused(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / nih.archive_name(1)).symlink_to("/dev/zero")
    code = ("import sys; from chexflow.data import nih\n"
            "try:\n    list(nih.iter_members(sys.argv[1]))\nexcept Exception as e:\n    print(type(e).__name__, e)")
    proc = _python(code, str(raw / nih.archive_name(1)))
    assert proc.returncode == 0, proc.stderr
    archive = raw / nih.archive_name(1)
    assert proc.stdout.strip() == (f"ArchiveError {archive}: cannot read archive ({archive}: a character device, "
                                   "not a regular file; not read)")


def test_a_fifo_as_an_archive_is_refused_by_every_reader(tmp_path):
    os.mkfifo(tmp_path / "a.tar.gz")
    with pytest.raises(ArchiveError, match="a FIFO"):
        list(nih.iter_members(tmp_path / "a.tar.gz"))
    for read in (lambda p: imagenet.read_devkit(p), lambda p: list(imagenet.iter_val(p, on_skip=print)),
                 lambda p: list(imagenet.iter_train_part(p, ("n1",), seed=0, on_skip=print))):
        with pytest.raises(NotRegularFile, match="a FIFO"):
            read(tmp_path / "a.tar.gz")
    with pytest.raises(fashion_mnist.IdxError, match="a FIFO"):
        fashion_mnist.read_idx(tmp_path / "a.tar.gz")


def test_tables_and_lists_that_are_not_regular_files_are_refused(tmp_path):
    (tmp_path / "Data_Entry_2017.csv").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "test_list.txt")
    os.mkfifo(tmp_path / "BBox_List_2017.csv")
    with pytest.raises(nih.NIHError, match=r"Data_Entry_2017.csv: cannot read the label CSV \(.*Data_Entry_2017.csv: "
                                           "a character device, not a regular file; not read"):
        nih.read_label_table(tmp_path / "Data_Entry_2017.csv")
    with pytest.raises(NotRegularFile, match="test_list.txt: a FIFO"):
        nih.read_split_list(tmp_path / "test_list.txt")
    with pytest.raises(nih.NIHError, match="BBox_List_2017.csv: cannot read the box list .*a FIFO"):
        nih.read_box_list(tmp_path / "BBox_List_2017.csv")


# --------------------------------------------------------------------------- predict

@pytest.fixture(scope="module")
def study(tmp_path_factory, request):
    with module_scratch(tmp_path_factory, request, "predict_trust") as root:
        yield Study(root)


def _predict(study, tmp_path: Path, *inputs: str) -> pd.DataFrame:
    out = tmp_path / "out" / "predictions.csv"
    proc = subprocess.run([sys.executable, "-m", "chexflow", "predict", "--config-json",
                           json.dumps({"workers": 1, "batch_size": 4}), "--model", str(study.model), "--manifest",
                           str(study.manifest), "--metrics", str(study.metrics), "--out", str(out), *inputs],
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "root:*:" not in out.read_text() and "root:*:" not in proc.stdout + proc.stderr
    return read_predictions(out)


def test_predict_on_a_list_naming_a_fifo_and_dev_zero(study, tmp_path):
    good = sorted(study.scores)[0]
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "list.txt").write_text(f"pipe.png\n/dev/zero\n{study.pngs / good}\n")
    table = _predict(study, tmp_path, str(tmp_path / "list.txt"))
    errors = dict(zip(table["file"], table["error"]))
    assert errors == {str(tmp_path / "pipe.png"): "a FIFO (named pipe), not a regular file; not read",
                      "/dev/zero": "a character device, not a regular file; not read",
                      str(study.pngs / good): ""}
    row = table[table["error"] == ""]
    np.testing.assert_allclose(row[[f"{label}_score" for label in study.labels]].to_numpy(float)[0],
                               study.scores[good], atol=1e-5)


def test_predict_on_a_folder_never_follows_a_link_out_of_it(study, tmp_path):
    secret = _secret(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    good = sorted(study.scores)[0]
    (folder / good).write_bytes((study.pngs / good).read_bytes())
    (folder / "passwd.png").symlink_to(secret)                 # a link out, named like an image
    (folder / "IM0001").symlink_to(secret)                     # and like an extension-less DICOM
    (folder / "elsewhere").symlink_to(secret.parent, target_is_directory=True)   # a folder out: not descended
    (secret.parent / "x.png").write_bytes(PASSWD)
    table = _predict(study, tmp_path, str(folder))
    errors = dict(zip(table["file"].map(lambda f: Path(f).name), table["error"]))
    assert errors == {good: "", "passwd.png": "a symbolic link, not a regular file (links are not followed here); "
                                              "not read"}
    # the same link named explicitly (the user's own path) is followed, and still never echoed
    table = _predict(study, tmp_path, str(folder / "passwd.png"))
    assert table["error"].tolist() == ["not a PNG or JPEG file (its first bytes are neither signature)"]


def test_predict_on_a_folder_with_a_device_node_and_a_fifo(study, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    os.mknod(folder / "zero.png", stat.S_IFCHR | 0o600, os.makedev(1, 5))     # /dev/zero's numbers
    os.mkfifo(folder / "pipe.dcm")
    table = _predict(study, tmp_path, str(folder))
    errors = dict(zip(table["file"].map(lambda f: Path(f).name), table["error"]))
    assert errors == {"pipe.dcm": "a FIFO (named pipe), not a regular file; not read",
                      "zero.png": "a character device, not a regular file; not read"}


def test_a_list_file_that_is_not_a_regular_file_is_refused(tmp_path):
    (tmp_path / "l.txt").symlink_to("/dev/zero")
    # a .txt that is not a regular file is an input of its own (its row says why), never read as a list
    assert files.list_inputs([tmp_path / "l.txt"]) == [tmp_path / "l.txt"]
    (tmp_path / "big.txt").write_bytes(b"a.png\n" * 10)
    files.MAX_LIST_BYTES, old = 20, files.MAX_LIST_BYTES
    try:
        with pytest.raises(files.NoInputsError, match=r"big.txt: cannot read the list \(list of images of 60 bytes"):
            files.list_inputs([tmp_path / "big.txt"])
    finally:
        files.MAX_LIST_BYTES = old
